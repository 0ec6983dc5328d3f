import os

# Fake CPU devices for sharding tests; must be set before JAX is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the test-only audio+video family (tests/toyfamily) goes through every registry-wide test
os.environ.setdefault("VIDAX_FAMILIES", "tests.toyfamily.recipes")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# compile-count tests count real compilations: no persistent compilation cache in tests
os.environ.setdefault("VIDAX_COMPILE_CACHE", "off")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


from tests.prefect_env import prefect_server  # noqa: E402,F401 - session fixture, started on first use


import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator():
    """A real GCS JSON API on loopback (``gcp-storage-emulator``, in memory) with the bucket
    ``vidax-test``; yields its URL for ``STORAGE_EMULATOR_HOST``. It does not enforce if-not-exists
    preconditions."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket",
                             "vidax-test", "-q", "-M"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("gcp-storage-emulator did not start")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)
