import os

# Fake CPU devices for sharding tests, and the XLA:CPU optimisation level of the tier; both must be
# set before JAX is imported anywhere (tests/children.py: ``xla_flags``).
from tests.sweep import xla_flags  # noqa: E402

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the test-only audio+video family (tests/toyfamily) goes through every registry-wide test
os.environ.setdefault("VIDAX_FAMILIES", "tests.toyfamily.recipes")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# JAX's persistent compilation cache is off in the tests unless VIDAX_TEST_SHARED_COMPILE_CACHE=1
# (then one per session, for the workers and every child: tests/children.py). Its write, XLA:CPU's
# `executable.serialize()` (jaxlib 0.10.2), is where every recorded native crash of a test worker
# happened; a worker killed by a crash is replaced and its test run again (below).
os.environ.setdefault("VIDAX_COMPILE_CACHE_MIN_SECONDS", "0.1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# drawn here, in the controlling process, before pytest-xdist starts the workers that inherit them:
# the sweeps' seed and the child processes' compilation cache
from tests import children, sweep  # noqa: E402
from vidax.core import runtime  # noqa: E402

runtime.compile_cache()  # before the first compilation of this process

from tests.prefect_env import prefect_server  # noqa: E402,F401 - session fixture, started on first use


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator():
    """A real GCS JSON API on loopback (``gcp-storage-emulator``, in memory) with the bucket
    ``vidax-test``; yields its URL for ``STORAGE_EMULATOR_HOST``. It does not enforce if-not-exists
    preconditions."""
    from tests.gcs_proxy import start_emulator

    try:
        proc, url = start_emulator("vidax-test")
    except RuntimeError as e:
        pytest.fail(str(e))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def seeded_store(tmp_path_factory):
    """A store holding one finished tiny run (built once per worker; the bad-input catalogues
    check that a refusal leaves it byte-identical)."""
    from stages import cli

    root = tmp_path_factory.mktemp("seeded") / "store"
    assert cli.main(["generate", "--prompt", "a lighthouse", "--frames", "5", "--steps", "1", "--height", "32",
                     "--width", "32", "--run-id", "keep", "--store", str(root)]) == 0
    return root


@pytest.fixture
def store(seeded_store, tmp_path):
    """A copy of :func:`seeded_store` for one test."""
    import shutil

    d = tmp_path / "store"
    shutil.copytree(seeded_store, d)
    return d


@pytest.fixture(scope="session")
def tiny_wan_folder(tmp_path_factory):
    """A complete tiny Wan2.1 diffusers folder (tokenizer, UMT5, DiT, VAE, scheduler, all saved by
    ``save_pretrained``), built once per worker; copy it before damaging it."""
    from tests.test_sources import _tiny_wan_diffusers

    folder = tmp_path_factory.mktemp("wan-tiny") / "Wan-tiny"
    _tiny_wan_diffusers(folder)
    return folder


@pytest.fixture(scope="session")
def cond_image(tmp_path_factory):
    """A 160x90 RGB PNG (random pixels) to condition image-to-video runs on."""
    import numpy as np
    import PIL.Image

    p = tmp_path_factory.mktemp("img") / "first-frame.png"
    rng = np.random.default_rng(3)
    PIL.Image.fromarray((rng.random((90, 160, 3)) * 255).astype(np.uint8)).save(p)
    return str(p)


# ------------------------------------------------------------------ a worker killed by a native crash
# XLA:CPU's compiler has crashed a test worker with SIGSEGV (three times in full runs: twice while
# compiling a program of tests/test_ltx_vae.py, once one of tests/test_wan_vae.py, each passing
# alone). pytest-xdist replaces the
# worker; the crashed test is queued again and that run decides. The crash itself is reported as
# "rerun", not as a failure, and the session fails if a crashed test crashes again or never ran
# again. (``make test`` distributes by test, ``--dist load``: after a crash, ``--dist loadfile``
# left the session waiting forever with both workers idle.)
_CRASHED: dict = {}  # nodeid -> the outcome of its run after the crash (None: not run again yet)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem in _CRASHED:  # crashed again: a failure
        return
    try:
        sched.mark_test_pending(crashitem)  # --dist load / worksteal: queue it again
    except NotImplementedError:
        pass  # --dist loadfile requeues the crashed file's unfinished tests itself
    _CRASHED[crashitem] = None
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}; run again on the replacement worker"


def pytest_report_teststatus(report, config):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})


def pytest_runtest_logreport(report):
    if report.nodeid in _CRASHED and report.when in ("setup", "call") and report.outcome != "rerun":
        if report.when == "call" or report.failed:
            _CRASHED[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(sweep.describe())


def pytest_unconfigure(config):
    if children.MADE_CACHE and not hasattr(config, "workerinput"):  # the controller: the session is over
        import shutil

        shutil.rmtree(children.COMPILE_CACHE, ignore_errors=True)
        shutil.rmtree(children.VIDAX_CACHE, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    lost = [n for n, outcome in _CRASHED.items() if outcome is None]
    if lost:
        print(f"\ncrashed and never run again: {', '.join(lost)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif _CRASHED:
        print(f"\nworker crashes, the tests run again: {_CRASHED}")



# The slowest files first (seconds per file: README, Tests): pytest-xdist hands tests out in
# collection order, and a long Prefect or conformance test started last leaves one worker idle
# while the other finishes it.
FIRST = ("test_flows.py", "test_conformance.py", "test_multihost.py", "test_wan_vae.py", "test_reliability.py",
         "test_stepcache.py", "test_probe.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(FIRST)))  # stable: the rest keep their order
