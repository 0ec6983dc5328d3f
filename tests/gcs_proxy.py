"""A fault-injecting HTTP proxy between gcsfs and the GCS emulator (tests and benchmarks).

Point ``STORAGE_EMULATOR_HOST`` at :attr:`FaultProxy.url`; every request is forwarded to the
emulator unless a fault applies:

- ``fail_next(status, n)``: the next ``n`` requests get ``status`` (503, 429...) without reaching
  the emulator;
- ``drop_after_apply(n)``: the next ``n`` requests reach the emulator, then the connection is
  closed before the answer (the change is applied, the client never hears of it);
- ``cut_after(n)``: after ``n`` more requests the network is cut: every later request fails
  (connection closed) until :meth:`heal`;
- ``random_faults(p, seed)``: each request fails with probability ``p`` (a 503 or a dropped
  answer after applying);
- ``latency`` seconds added to every request.

It also logs every request (method, path, bytes up/down) for traffic measurements.
"""
from __future__ import annotations

import http.client
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.children import dies_with_parent


class FaultProxy:
    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.lock = threading.Lock()
        self.log: list[tuple[str, str, int, int]] = []
        self.latency = 0.0
        self._fail = []  # [status, remaining]
        self._drop = 0
        self._cut_after: int | None = None
        self._cut = False
        self._p = 0.0
        self._rng = random.Random(0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                action = proxy._decide()
                if proxy.latency:
                    time.sleep(proxy.latency)
                if action == "cut":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(action, int):
                    msg = b'{"error": {"code": %d, "message": "injected"}}' % action
                    # recorded before the reply: the client may look at the log as soon as it has it
                    proxy._record(self.command, self.path, len(body), 0)
                    self.send_response(action)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "transfer-encoding",
                                                                                     "content-length")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                proxy._record(self.command, self.path, len(body), len(data))
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # cut / dropped connections are the point
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    # -------------------------------------------------------------- faults
    def _decide(self):
        with self.lock:
            if self._cut:
                return "cut"
            if self._cut_after is not None:
                if self._cut_after <= 0:
                    self._cut = True
                    return "cut"
                self._cut_after -= 1
            if self._fail:
                status, left = self._fail
                self._fail = [status, left - 1] if left > 1 else []
                return status
            if self._drop:
                self._drop -= 1
                return "drop"
            if self._p and self._rng.random() < self._p:
                return self._rng.choice([503, 429, "drop"])
        return None

    def _record(self, method, path, up, down):
        with self.lock:
            self.log.append((method, path, up, down))

    def fail_next(self, status: int, n: int = 1):
        with self.lock:
            self._fail = [status, n]

    def drop_after_apply(self, n: int = 1):
        with self.lock:
            self._drop = n

    def cut_after(self, n: int):
        with self.lock:
            self._cut_after, self._cut = n, False

    def random_faults(self, p: float, seed: int = 0):
        with self.lock:
            self._p, self._rng = p, random.Random(seed)

    def heal(self):
        with self.lock:
            self._fail, self._drop, self._cut_after, self._cut, self._p = [], 0, None, False, 0.0

    def reset_log(self):
        with self.lock:
            self.log = []

    def traffic(self) -> dict:
        with self.lock:
            return {"requests": len(self.log), "bytes_up": sum(x[2] for x in self.log),
                    "bytes_down": sum(x[3] for x in self.log)}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def start_emulator(bucket: str) -> tuple[subprocess.Popen, str]:
    """``gcp-storage-emulator`` (in memory) on a free loopback port with ``bucket``; returns the
    process and its URL for ``STORAGE_EMULATOR_HOST``. It does not enforce if-not-exists
    preconditions."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen(dies_with_parent([str(exe), "start", "--host", "127.0.0.1", "--port", str(port),
                                              "--default-bucket", bucket, "-q", "-M"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("gcp-storage-emulator did not start")
