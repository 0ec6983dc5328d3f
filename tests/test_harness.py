"""The test harness itself: sampled sweeps and services that die with the worker that started them."""
import os
import signal
import socket
import subprocess
import sys
import time

from tests import sweep


def test_a_sweep_sample_is_reproducible_from_its_seed(monkeypatch):
    monkeypatch.setattr(sweep, "ALL", False)  # as under make test
    items = list(range(40))
    a = sweep.sample(items, 5, "x")
    assert a == sweep.sample(items, 5, "x") and len(a) == 5 and a == sorted(a)
    assert sweep.sample(items, 50, "x") == items
    groups = sweep.sample_per_group(items, lambda i: i % 4, 2, "y")
    assert sorted(i % 4 for i in groups) == [0, 0, 1, 1, 2, 2, 3, 3]
    draws = set()
    for seed in range(20):  # other seeds, other samples
        monkeypatch.setattr(sweep, "SEED", seed)
        draws.add(tuple(sweep.sample(items, 5, "x")))
    assert len(draws) > 10
    monkeypatch.setattr(sweep, "ALL", True)
    assert sweep.sample(items, 5, "x") == items and sweep.sample_per_group(items, lambda i: i % 4, 2, "y") == items


def test_an_emulator_dies_with_the_process_that_started_it(tmp_path):
    """A pytest-xdist worker killed by a crash runs no teardown: its GCS emulator must not outlive it."""
    script = ("import sys, time; from tests.gcs_proxy import start_emulator; "
              "proc, url = start_emulator('b'); print(url.rsplit(':', 1)[1], flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        port = int(p.stdout.readline())
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # it serves
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                time.sleep(0.2)
            except OSError:
                break
        else:
            raise AssertionError(f"the emulator on port {port} outlived its parent")
    finally:
        p.kill()
