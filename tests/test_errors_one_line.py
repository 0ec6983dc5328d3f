"""Anticipated failures end in one line, never a raw traceback (``--debug`` shows it).

- a stage that fails: ``vidax: error: <stage>: <what failed>``, that nothing of the stage was
  committed (what was committed before it is kept) and how to resume;
- a store that stops answering mid-stage: which request failed after how many attempts (a real GCS
  API on loopback, the network cut by ``tests/gcs_proxy.py``);
- an unreachable ``gs://`` bucket: gcsfs' own retry logging (an aiohttp traceback) stays quiet."""
import logging

import pytest

from stages import cli
from stages import run as R
from stages.store import RunStore

ARGS = ["--prompt", "a lighthouse", "--frames", "5", "--steps", "1", "--height", "32", "--width", "32"]


def _one_line(capsys):
    out, err = capsys.readouterr()
    err = err.strip()
    assert "Traceback" not in err and "Traceback" not in out, err
    assert err.count("\n") == 0, f"expected one line, got:\n{err}"
    return err


def _damaged_checkpoint(*a, **kw):
    from vidax.weights import CheckpointFormatError

    raise CheckpointFormatError("/models/Wan/transformer/diffusion_pytorch_model.safetensors: not a readable "
                                "safetensors file (Error while deserializing header: header too large)")


def test_a_failing_stage_is_one_line_and_keeps_what_was_committed(tmp_path, capsys, monkeypatch):
    store = str(tmp_path / "s")
    monkeypatch.setattr(R, "run_sample", _damaged_checkpoint)  # the checkpoint damaged after validation
    rc = cli.main(["generate", *ARGS, "--run-id", "r", "--store", store])
    assert rc == 1
    err = _one_line(capsys)
    assert err.startswith("vidax: error: sample: CheckpointFormatError: /models/Wan/transformer/"), err
    assert "nothing of sample was committed" in err and f"vidax stage r sample --store file://{store}" in err, err
    run = RunStore(store).run("r")
    assert run.record("encode") is not None and run.record("sample") is None
    # --debug: the traceback, and the same line last
    rc = cli.main(["generate", *ARGS, "--run-id", "r", "--store", store, "--debug"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" in err and "CheckpointFormatError" in err
    assert err.strip().splitlines()[-1].startswith("vidax: error: sample:")
    # the same through `vidax stage`
    assert cli.main(["stage", "r", "sample", "--store", store]) == 1
    assert _one_line(capsys).startswith("vidax: error: sample: CheckpointFormatError")


def test_an_injected_fault_names_its_stage_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VIDAX_FAULTS", "decode/0:fail")
    assert cli.main(["generate", *ARGS, "--run-id", "r", "--store", str(tmp_path / "s")]) == 1
    err = _one_line(capsys)
    assert err.startswith("vidax: error: decode/0: injected fault"), err
    assert "nothing of decode/0 was committed" in err


def test_an_unexpected_error_outside_a_stage_is_one_line(tmp_path, capsys, monkeypatch):
    def boom(*a, **kw):
        raise KeyError("surprise")

    monkeypatch.setattr(R, "write_manifest", boom)
    assert cli.main(["generate", *ARGS, "--run-id", "r", "--store", str(tmp_path / "s")]) == 1
    err = _one_line(capsys)
    assert err.startswith("vidax: error: KeyError: 'surprise'") and "--debug" in err, err


# ------------------------------------------------------------------ a real GCS API
@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
    import stages.store as S
    from tests.gcs_proxy import FaultProxy

    p = FaultProxy(gcs_emulator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
    monkeypatch.setenv("VIDAX_GCS_RETRIES", "1")
    monkeypatch.setattr(S, "RETRY_BASE_S", 0.02)
    monkeypatch.setattr(S, "RETRY_ATTEMPTS", 3)
    monkeypatch.setattr(S, "LEASE_CONFIRM_S", 0.0)
    yield p
    p.close()


def test_a_store_that_stops_answering_mid_stage(proxy, capsys, monkeypatch):
    import time

    store = f"gs://vidax-test/cut-{time.time_ns()}"
    real = R.run_sample

    def cut_then_sample(*a, **kw):
        proxy.cut_after(0)  # from the sample stage's first request on, the network is gone
        return real(*a, **kw)

    monkeypatch.setattr(R, "run_sample", cut_then_sample)
    assert cli.main(["generate", *ARGS, "--run-id", "r", "--store", store]) == 1
    err = _one_line(capsys)
    assert err.startswith("vidax: error: sample: "), err
    assert "kept failing after 3 attempts" in err and "nothing of sample was committed" in err, err
    proxy.heal()
    run = RunStore(store).run("r")
    assert run.record("encode") is not None and run.record("sample") is None


def test_an_unreachable_bucket_is_one_line(tmp_path):
    """In a process of its own (pytest's log capture would hide what gcsfs prints to stderr)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "VIDAX_GCS_RETRIES": "2",
           "VIDAX_STORAGE_BACKOFF": "0.02"}
    p = subprocess.run([sys.executable, "-m", "stages.cli", "generate", *ARGS, "--store", "gs://vidax-test/nowhere"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    err = p.stderr.strip()
    assert p.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 0, err
    assert err.startswith("vidax: error: store: cannot write to store gs://vidax-test/nowhere"), err
    assert list(tmp_path.iterdir()) == []


def test_storage_library_errors_are_demoted_not_printed(caplog):
    """gcsfs logs an exhausted retry with ``logger.exception`` (its aiohttp traceback): demoted to a
    debug record, which no default handler prints; ``--debug`` keeps it an error."""
    from stages.store import quiet_storage_loggers

    def log_one():
        caplog.clear()
        try:
            raise ConnectionError("reset by peer")
        except ConnectionError:
            logging.getLogger("gcsfs").exception("_call out of retries on exception")
        (rec,) = [r for r in caplog.records if r.name == "gcsfs"]
        return rec.levelno

    caplog.set_level(logging.DEBUG, logger="gcsfs")
    quiet_storage_loggers()
    assert log_one() == logging.DEBUG
    assert logging.DEBUG < logging.lastResort.level  # (what prints a record when no handler is set)
    quiet_storage_loggers(False)
    try:
        assert log_one() == logging.ERROR
    finally:
        quiet_storage_loggers()


# ------------------------------------------------------------------ Prefect's run logs
def test_prefect_run_logs_show_one_line_and_the_traceback_at_debug(tmp_path):
    """What Prefect's task engine logs for a failed stage task (``Task run failed with exception:
    ... - Retries are exhausted``, ``exc_info=True``): the line without the traceback; the traceback
    as a debug record. An unexpected exception keeps its traceback."""
    from flows import flows as F

    F.quiet_logs(debug=False)
    assert all(F._ONE_LINE in logging.getLogger(n).filters for n in F.PREFECT_LOGGERS)
    # the same filter on a logger of our own (Prefect's handlers want a run context)
    lg = logging.getLogger("vidax-test.task_runs")
    lg.propagate, records = False, []
    handler = logging.Handler()
    handler.emit = records.append
    lg.addHandler(handler)
    lg.addFilter(F.OneLineErrors())
    lg.setLevel(logging.DEBUG)
    run = RunStore(str(tmp_path / "s")).run("r")

    def fail(exc):
        records.clear()
        try:
            try:
                _damaged_checkpoint()
            except Exception as e:  # noqa: BLE001
                raise exc(e) from e
        except Exception as e:  # noqa: BLE001
            lg.error("Task run failed with exception: %r - Retries are exhausted", e, exc_info=True)
        return [(r.levelno, r.exc_info is not None, r.getMessage()) for r in records]

    detail, line = fail(lambda e: R.StageFailed("sample", run, e))
    assert line[0] == logging.ERROR and not line[1] and "nothing of sample was committed" in line[2]
    assert detail[0] == logging.DEBUG and detail[1] and "traceback of: sample: CheckpointFormatError" in detail[2]
    (other,) = fail(lambda e: RuntimeError("a bug"))
    assert other[0] == logging.ERROR and other[1]  # not anticipated: the traceback stays
    lg.setLevel(logging.INFO)  # the traceback only at debug level
    (line,) = fail(lambda e: R.StageFailed("sample", run, e))
    assert line[0] == logging.ERROR and not line[1]
