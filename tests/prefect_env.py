"""A real Prefect server (SQLite, loopback, free port) and process workers for the flow tests.

The session fixture ``prefect_server`` (registered in conftest.py) starts on first use and points
the PREFECT_* settings of this process at it before Prefect is imported by the tests.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.children import ENV, dies_with_parent

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class PrefectServer:
    def __init__(self):
        self.home = Path(tempfile.mkdtemp(prefix="vidax-prefect-"))
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **ENV,  # flow runs share the session's compilation cache
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.home}/prefect.db",
            "PREFECT_LOGGING_LEVEL": "INFO",
            # the server's own INFO lines (triggers, event ordering) in server.log, for a failing test's report
            "PREFECT_SERVER_LOGGING_LEVEL": "INFO",
            # workers pick up scheduled runs within 1 s (default 10 s), parents poll children twice a second
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "VIDAX_CHILD_POLL_SECONDS": "0.5",
            "PYTHONUNBUFFERED": "1",
            # flow-run processes import this checkout (and the test-only family under tests/)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        self.procs = []

    def start(self):
        log = open(self.home / "server.log", "w")
        p = subprocess.Popen(dies_with_parent([sys.executable, "-m", "tests.prefect_server", "server", "start",
                                              "--host", "127.0.0.1", "--port", self.port]),
                             env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.home)
        self.procs.append(p)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.api}/health", timeout=1)
                return self
            except OSError:
                if p.poll() is not None:
                    break
                time.sleep(0.5)
        raise RuntimeError(f"prefect server did not start: {(self.home / 'server.log').read_text()[-3000:]}")

    def cli(self, *args, check=True, timeout=300, cwd=REPO, env=None):
        r = subprocess.run([str(BIN / "prefect"), *args], env={**self.env, **(env or {})}, cwd=cwd,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}")
        return r

    def worker(self, pool: str, env=None):
        log = open(self.home / f"worker-{pool}.log", "a")
        p = subprocess.Popen(dies_with_parent([BIN / "prefect", "worker", "start", "--pool", pool, "--type", "process"]),
                             env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, cwd=self.home)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.environ.get("VIDAX_TEST_KEEP_PREFECT"):  # its database, server and worker logs
            shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_server():
    """One server per test session (per xdist worker): Prefect caches its API settings in-process,
    so a second server in the same process would not be reached."""
    srv = PrefectServer().start()
    old = {k: os.environ.get(k) for k in srv.env if k.startswith("PREFECT_")}
    os.environ.update({k: v for k, v in srv.env.items() if k.startswith("PREFECT_")})
    old.setdefault("PREFECT_LOGGING_TO_API_ENABLED", os.environ.get("PREFECT_LOGGING_TO_API_ENABLED"))
    os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"  # this process's logs stay local (no noise at teardown)
    # Prefect reads its settings from the environment once, when it is first imported: in a worker
    # where an earlier test imported it, the variables above come too late and get_client() /
    # run_deployment() would start and use a temporary server of their own. Enter them as settings.
    import prefect.settings as ps

    updates = {getattr(ps, k): os.environ[k] for k in [*srv.env, "PREFECT_LOGGING_TO_API_ENABLED"]
               if k.startswith("PREFECT_") and hasattr(ps, k)}
    try:
        with ps.temporary_settings(updates=updates):
            yield srv
    finally:
        srv.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
