"""Prefect flows over the vidax stages.

- ``vidax-generate``: one request; every stage a task (local mode) or a child flow run of the
  per-stage deployment routed to a sized work pool (distributed mode);
- ``vidax-generate-batch``: a prompt file (any fsspec URL), lines validated first, then phase by
  phase (each component loaded once per phase), in-process or as one child run per phase and pool
  (``vidax-phase``); a failing prompt does not sink the others;
- ``vidax-rerun-stage``: recompute one stage of an existing run, then finish whatever is left;
- ``vidax-stage``: one stage of an existing run (what each per-stage deployment runs);
- ``vidax-phase``: one phase of many runs of a batch (what each ``batch-*`` deployment runs).

Only store URLs and run ids pass between flows; the data flows through the run store.
"""
from __future__ import annotations

import logging
import os
import re
import time
from datetime import timedelta

from prefect import flow, get_run_logger, task
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.events import emit_event
from prefect.states import Completed, Failed
from prefect.tasks import exponential_backoff

from stages import run as R
from stages.request import Request, validate, validate_run_id
from stages.store import RunStore, is_transient
from vidax import registry

from .batch import PromptFileError, parse_prompt_file


# ------------------------------------------------------------------ one line per anticipated failure
def anticipated(e: BaseException | None) -> bool:
    """A failure vidax reports in one line (a failed stage, a bad request or checkpoint, a store
    that stops answering): Prefect's run logs show that line; its traceback is a debug record."""
    from stages.request import RequestError
    from stages.store import StoreError
    from vidax.pipeline import OptionError
    from vidax.weights import CheckpointFormatError, CheckpointMismatchError

    return isinstance(e, (R.StageError, RequestError, StoreError, OptionError, CheckpointFormatError,
                          CheckpointMismatchError, PromptFileError)) or is_transient(e)


class OneLineErrors(logging.Filter):
    """On Prefect's run and engine loggers: a record carrying an anticipated vidax failure
    (:func:`anticipated`) keeps its one-line message without the traceback, and the traceback
    follows as a debug record (shown when the logger's level is DEBUG, e.g.
    ``PREFECT_LOGGING_LEVEL=DEBUG``). Other exceptions keep their tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        ei = record.exc_info
        if not ei or ei[1] is None or getattr(record, "vidax_detail", False) or not anticipated(ei[1]):
            return True
        lg = logging.getLogger(record.name)
        if lg.isEnabledFor(logging.DEBUG):
            detail = logging.makeLogRecord({**record.__dict__, "levelno": logging.DEBUG, "levelname": "DEBUG",
                                            "msg": "traceback of: %s", "args": (R.describe_error(ei[1]),),
                                            "exc_text": None, "vidax_detail": True})
            lg.handle(detail)
        record.exc_info, record.exc_text = None, None
        return True


_ONE_LINE = OneLineErrors()
PREFECT_LOGGERS = ("prefect.task_runs", "prefect.flow_runs", "prefect.engine")


def quiet_logs(debug: bool | None = None) -> None:
    """One line per anticipated failure in the flows' logs, and the storage libraries' retry
    tracebacks demoted to debug records; ``debug`` (default: ``$VIDAX_DEBUG``) keeps every traceback."""
    from stages.store import quiet_storage_loggers

    if debug is None:
        debug = os.environ.get("VIDAX_DEBUG", "").lower() in ("1", "true", "yes")
    quiet_storage_loggers(not debug)
    for name in PREFECT_LOGGERS:
        if debug:
            logging.getLogger(name).removeFilter(_ONE_LINE)
        else:
            logging.getLogger(name).addFilter(_ONE_LINE)


quiet_logs()

def _retry_transient(task_, task_run, state) -> bool:
    try:
        state.result()
    except Exception as e:  # noqa: BLE001
        return is_transient(e)
    return False


def _artifact_key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:120]


def _stage_cache_key(context, parameters) -> str:
    return f"vidax-stage-{parameters['key']}"


@task(name="vidax-stage-task", task_run_name="{stage}", retries=3, retry_delay_seconds=exponential_backoff(2),
      retry_condition_fn=_retry_transient, cache_key_fn=_stage_cache_key, persist_result=True,
      cache_expiration=timedelta(days=30))
def stage_task(store: str, run_id: str, stage: str, key: str, force: bool = False) -> dict:
    """Run one stage in this process (skipping it if already committed with this key)."""
    from vidax.core import runtime

    runtime.setup()  # join a multi-host job (before any device is touched); persistent compilation cache
    logger = get_run_logger()
    run = RunStore(store).run(run_id)
    req = R.load_request(run)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    if keys.get(stage) != key:
        raise R.StageError(f"{stage}: the run's request changed since this task was planned")
    if not R.wanted(run, req, pipe, stage, keys, force):  # process 0's answer on a multi-host slice
        logger.info("%s is already committed (key %s): skipped", stage, key[:12])
        rec = run.record(stage)
        return {"stage": stage, "key": key, "status": "skipped", "seconds": rec["seconds"], "hardware": rec["hardware"]}
    progress_id = {}

    def progress(which, frac):
        if which not in progress_id:
            progress_id[which] = create_progress_artifact(
                progress=0.0, key=_artifact_key("vidax", run_id, which, "progress"),
                description=f"{which} progress of run {run_id}")
        update_progress_artifact(progress_id[which], progress=round(100 * frac, 1))

    res = R.run_stage(run, req, pipe, stage, keys, log=logger.info, progress=progress)
    R.write_manifest(run, req, keys)
    return {"stage": stage, "key": key, "status": res.status, "seconds": round(res.seconds, 3), "hardware": res.hardware}


def _emit_stage_failed(store: str, run_id: str, stage: str, error: str, attempt: int) -> None:
    emit_event(
        event="vidax.stage.failed",
        resource={"prefect.resource.id": f"vidax.run.{run_id}.{stage}", "vidax.store": store, "vidax.run_id": run_id,
                  "vidax.stage": stage, "vidax.stage_kind": stage.split("/")[0], "vidax.attempt": str(attempt)},
        payload={"error": error[:2000]},
    )


def _run_local(store: str, run_id: str, stage: str, key: str, force: bool = False, req=None, pipe=None) -> dict:
    run = RunStore(store).run(run_id)
    if req is None:
        req = R.load_request(run)
        pipe = R.make_pipeline(req)
    from vidax.core.mesh import process_count

    if process_count() > 1:
        # a multi-host stage: the followers (`vidax stage --flow-run`) take part in every decision the
        # task body takes, so it always runs (no cached result) and runs once (a retry has no follower)
        return stage_task.with_options(refresh_cache=True, retries=0)(store, run_id, stage, key, force)
    fresh = not force and R.committed(run, stage, key, req=req, pipe=pipe)
    return stage_task.with_options(refresh_cache=not fresh)(store, run_id, stage, key, force)


#: how long a stage's child run may take, per stage kind (seconds); VIDAX_STAGE_TIMEOUT_<KIND> overrides
STAGE_TIMEOUTS = {"encode": 3600, "sample": 6 * 3600, "decode": 3600, "mux": 1800}
#: a Running child whose stage has no live lease for this long is taken for crashed (dead worker)
CRASH_GRACE = float(os.environ.get("VIDAX_CRASH_GRACE", "60"))
#: how often a parent reads its stage's child run state (seconds)
CHILD_POLL_SECONDS = float(os.environ.get("VIDAX_CHILD_POLL_SECONDS", "2"))


def stage_timeout(kind: str) -> float:
    return float(os.environ.get(f"VIDAX_STAGE_TIMEOUT_{kind.upper()}", STAGE_TIMEOUTS.get(kind, 3600)))


def _flow_run_url(flow_run_id) -> str:
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui else str(flow_run_id)


def _launch(deployment: str, parameters: dict, job_variables: dict, idempotency_key: str, tags: list[str]):
    """A run of ``deployment`` as a child of this flow run, not waited for."""
    from prefect.deployments import run_deployment

    return run_deployment(deployment, parameters=parameters, job_variables=job_variables or None,
                          idempotency_key=idempotency_key, timeout=0, as_subflow=True, tags=tags)


def _await_child(fr, what: str, leases: list[tuple], timeout: float):
    """Wait for child run ``fr``, bounded: it must finish within ``timeout`` seconds, and while it
    is Running, at least one of its stages not yet committed (``leases``: (run, stage) pairs) must
    hold a live lease; one that holds none for :data:`CRASH_GRACE` seconds (its worker died:
    SIGKILL, OOM, preemption) is marked Crashed. Returns its final state."""
    import asyncio

    from prefect import get_client
    from prefect.states import Crashed

    deadline = time.time() + timeout
    orphaned_since = None

    async def read_state():
        async with get_client() as c:
            return (await c.read_flow_run(fr.id)).state

    async def crash(message):
        async with get_client() as c:
            await c.set_flow_run_state(fr.id, Crashed(message=message), force=True)

    while True:
        state = asyncio.run(read_state())
        if state is not None and state.is_final():
            return state
        now = time.time()
        if now > deadline:
            asyncio.run(crash(f"vidax: {what} exceeded its timeout ({timeout:.0f} s)"))
            return asyncio.run(read_state())
        if state is not None and state.is_running():
            open_ = [(run, st) for run, st in leases if run.record(st) is None]
            if any((lease := run.lease(st)) is not None and lease.live() for run, st in open_):
                orphaned_since = None
            elif orphaned_since is None:
                orphaned_since = now
            elif now - orphaned_since > CRASH_GRACE and open_:
                asyncio.run(crash(f"vidax: {what} stopped renewing its lease for {CRASH_GRACE:.0f} s "
                                  f"(its worker died)"))
                return asyncio.run(read_state())
        time.sleep(CHILD_POLL_SECONDS)


def _run_remote(store: str, run_id: str, stage: str, key: str, job_variables: dict, attempt: int) -> dict:
    """Launch the stage as a run of its deployment on its pool and wait for it, bounded
    (:func:`_await_child`): either way the parent fails the stage within a bounded time and
    announces it (``vidax.stage.failed``) so the rerun automation can pick it up."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    kind = stage.split("/")[0]
    name = registry.STAGE_DEPLOYMENTS[kind]
    fr = _launch(name, {"store": store, "run_id": run_id, "stage": stage}, job_variables,
                 f"{flow_run.id}:{stage}:{key}:attempt-{attempt}", [f"vidax-run:{run_id}", f"vidax-stage:{stage}"])
    pool = (job_variables or {}).get("tpu_accelerator") or name
    logger.info("%s -> %s (%s): child run %s %s", stage, name, pool, fr.name, _flow_run_url(fr.id))
    run = RunStore(store).run(run_id)
    state = _await_child(fr, stage, [(run, stage)], stage_timeout(kind))
    if state is None or not state.is_completed():
        # (a crashed child is announced by Prefect's own flow-run state event, which the rerun
        # automation listens to; a failed one by the vidax.stage.failed event its flow emits)
        what = state.type.value if state else "without a state"
        raise R.StageError(f"{stage}: child flow run {fr.name} ({name}) ended {what}: "
                           f"{state.message if state else ''}")
    logger.info("%s done (child run %s)", stage, fr.name)
    return {"stage": stage, "key": key, "status": "ran", "flow_run": str(fr.id)}


def resolve_store(store: str) -> str:
    """The run store of a flow: the parameter, else $VIDAX_STORE, else ``vidax-runs`` in the
    working directory, which a deployment refuses: its runs execute in a temporary folder that is
    deleted afterwards, so the videos would be lost."""
    from prefect.runtime import deployment

    store = store or os.environ.get("VIDAX_STORE", "")
    in_deployment = deployment.id is not None
    if not store:
        if in_deployment:
            raise ValueError("store: no run store given; a deployment runs in a temporary folder, so pass "
                             "store='gs://bucket/vidax' (or an absolute path) or set VIDAX_STORE on the work pool")
        store = "vidax-runs"
    if in_deployment and "://" not in store and not os.path.isabs(store):
        raise ValueError(f"store: {store!r} is relative; a deployment runs in a temporary folder, so give a URL "
                         f"or an absolute path")
    return store


def _report(run, req: Request, results: list[dict], rerun_of: str | None = None) -> None:
    keys_rows = []
    for r in results:
        rec = run.record(r["stage"]) or {}
        keys_rows.append({"stage": r["stage"], "status": r.get("status", ""), "seconds": rec.get("seconds"),
                          "hardware": rec.get("hardware", ""), "key": r["key"][:12]})
    create_table_artifact(keys_rows, key=_artifact_key("vidax", run.run_id, "stages"),
                          description=f"Stages of run {run.run_id}: timing, hardware, key")
    videos = "\n".join(f"- video: `{run.url(n)}`" for n in R.video_names(len(req.prompts)))
    previews = "\n".join(f"- preview: `{run.url(n.replace('video', 'preview').replace('.mp4', '.png'))}`"
                         for n in R.video_names(len(req.prompts)))
    origin = f"\n\nThis rerun finished the run started by flow run {rerun_of}.\n" if rerun_of else ""
    details = (run.record("sample") or {}).get("details") or {}
    ev = details.get("dit_evaluations")
    evals = (f", step cache {(details.get('cache') or {}).get('method')}: DiT evaluations {ev['computed']} computed, "
             f"{ev['skipped']} skipped" if isinstance(ev, dict) else "")
    create_markdown_artifact(
        f"# vidax run `{run.run_id}`\n\n{req.model}, {req.width}x{req.height}, {req.num_frames} frames, "
        f"{req.steps} steps, seed {req.seed}{evals}\n\n> {req.prompts[0]}\n\n{videos}\n{previews}\n{origin}",
        key=_artifact_key("vidax", run.run_id, "output"), description=f"Output of run {run.run_id}")


@flow(name="vidax-generate", log_prints=True)
def generate(request: dict, store: str = "", run_id: str | None = None, mode: str = "local",
             job_variables: dict | None = None) -> dict:
    """Generate one video. ``mode="local"`` runs every stage in this process; ``"distributed"``
    launches each stage as a run of its per-stage deployment (sized work pool) and checks it.
    Empty ``store``: $VIDAX_STORE, else ``vidax-runs`` in the working directory."""
    from prefect.runtime import flow_run
    from vidax.core import runtime

    runtime.setup()  # join a multi-host job before anything touches a device

    logger = get_run_logger()
    store = resolve_store(store)
    req = validate(Request.from_json(request))
    if mode not in ("local", "distributed"):
        raise ValueError(f"mode: {mode!r}; choose local or distributed")
    run_id = validate_run_id(run_id) if run_id else req.default_run_id()
    rs = RunStore(store)
    rs.check_writable()
    run = rs.run(run_id)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    if mode == "local":  # a remote checkpoint's headers, once fetched, before anything is written (distributed:
        R.check_weights(req, pipe)  # the stages' own machines fetch it; the parent never loads weights)
    run.write_json("request.json", req.to_json())
    recipe = registry.get(req.model)
    attempt = flow_run.run_count or 1
    logger.info("run %s in %s: %s stages (%s), mode %s", run_id, rs.url, len(keys), ", ".join(keys), mode)
    run.write_json("prefect.json", {"generate_flow_run": str(flow_run.id), "url": _flow_run_url(flow_run.id),
                                    "mode": mode})
    progress = create_progress_artifact(progress=0.0, key=_artifact_key("vidax", run_id, "stages-progress"),
                                        description=f"stages of run {run_id} committed")
    results = []
    for n, stage in enumerate(keys):
        if n:
            update_progress_artifact(progress, progress=round(100 * n / len(keys), 1))
        try:
            if mode == "local":
                results.append(_run_local(rs.url, run_id, stage, keys[stage], req=req, pipe=pipe))
            else:
                kind = stage.split("/")[0]
                jv = {**recipe.job_variables(kind, req.preset), **(job_variables or {}).get(kind, {})}
                if R.committed(run, stage, keys[stage], req=req, pipe=pipe):
                    results.append({"stage": stage, "key": keys[stage], "status": "skipped"})
                else:
                    results.append(_run_remote(rs.url, run_id, stage, keys[stage], jv, attempt))
        except Exception as e:
            if mode == "local":  # in distributed mode the stage's own flow run reports it
                _emit_stage_failed(rs.url, run_id, stage, str(e), attempt)
            R.write_manifest(run, req, keys)
            raise
    R.write_manifest(run, req, keys)
    update_progress_artifact(progress, progress=100.0)
    _report(run, req, results)
    videos = [run.url(n) for n in R.video_names(len(req.prompts))]
    for v in videos:
        logger.info("video: %s", v)
    return {"run_id": run_id, "store": rs.url, "videos": videos, "stages": results}


@flow(name="vidax-stage", log_prints=True)
def stage(store: str, run_id: str, stage: str, force: bool = False) -> dict:
    """Run one stage of an existing run (the per-stage deployments run this). On a multi-host slice
    this flow run is process 0; every other host runs ``vidax stage --flow-run ID`` (the TPU job
    template starts it on each pod) and follows it through the same stage."""
    from prefect.runtime import flow_run
    from vidax.core import runtime

    hosts = int(os.environ.get("VIDAX_NUM_PROCESSES") or 1)
    if hosts > 1:  # before joining: that waits for the other hosts
        from .cli import follower_command

        get_run_logger().info(
            "multi-host stage: this flow run is process 0 of %d (coordinator %s); each other host i = 1..%d "
            "runs, with VIDAX_PROCESS_ID=i, VIDAX_COORDINATOR and VIDAX_NUM_PROCESSES=%d: %s", hosts,
            os.environ.get("VIDAX_COORDINATOR", "from the environment"), hosts - 1, hosts,
            follower_command(str(flow_run.id), hosts))
    runtime.setup()  # join a multi-host job before anything touches a device

    run = RunStore(store).run(validate_run_id(run_id))
    req = R.load_request(run)
    keys = R.stage_keys(req, R.make_pipeline(req))
    if stage not in keys:
        raise R.StageError(f"unknown stage {stage!r}; run {run_id} has {', '.join(keys)}")
    try:
        return _run_local(store, run_id, stage, keys[stage], force)
    except Exception as e:
        _emit_stage_failed(store, run_id, stage, str(e), flow_run.run_count or 1)
        raise


@flow(name="vidax-phase", log_prints=True)
def phase(store: str, kind: str, run_ids: list[str], attempt: int = 1) -> dict:
    """One phase (stage kind) of many runs of a distributed batch, each component loaded once for
    all of them (:func:`stages.run.generate_many`); the ``batch-*`` deployments run this. A stage
    that fails is announced alone (``vidax.stage.failed``), so a failed decode stage is rerun alone."""
    from vidax.core import runtime

    runtime.setup()  # join a multi-host job before anything touches a device
    logger = get_run_logger()
    if kind not in R.PHASES:
        raise ValueError(f"kind: {kind!r}; choose one of {', '.join(R.PHASES)}")
    rs = RunStore(store)
    items = []
    for rid in run_ids:
        run = rs.run(validate_run_id(rid))
        items.append(R.BatchItem(run, R.load_request(run), label=rid))
    R.generate_many(items, log=logger.info, phases=(kind,))
    failed = {}
    for it in items:
        if it.error is not None:
            failed[it.run.run_id] = R.describe_error(it.error)
            if isinstance(it.error, R.StageFailed):
                _emit_stage_failed(rs.url, it.run.run_id, it.error.stage, str(it.error), attempt)
    message = f"{kind}: {len(items) - len(failed)} of {len(items)} run(s) done" + (
        f"; failed: {', '.join(failed)}" if failed else "")
    logger.info(message)
    if failed:
        return Failed(message=message, data={"failed": failed})
    return Completed(message=message, data={"failed": {}})


@flow(name="vidax-rerun-stage", log_prints=True)
def rerun_stage(store: str, run_id: str, stage: str) -> dict:
    """Recompute one stage of an existing run, then run any later stage that is not committed."""
    from vidax.core import runtime

    runtime.setup()  # join a multi-host job before anything touches a device
    logger = get_run_logger()
    run = RunStore(store).run(validate_run_id(run_id))
    req = R.load_request(run)
    keys = R.stage_keys(req, R.make_pipeline(req))
    if stage not in keys:
        raise R.StageError(f"unknown stage {stage!r}; run {run_id} has {', '.join(keys)}")
    results = [_run_local(store, run_id, stage, keys[stage], force=True)]
    names = list(keys)
    for later in names[names.index(stage) + 1:]:
        results.append(_run_local(store, run_id, later, keys[later]))
    R.write_manifest(run, req, keys)
    origin = {}
    try:
        origin = run.read_json("prefect.json") or {}
    except Exception:  # noqa: BLE001 - the link is informational
        pass
    _report(run, req, results, rerun_of=origin.get("url"))
    logger.info("run %s complete (it was started by %s): %s", run_id, origin.get("url", "an unknown flow run"),
                ", ".join(run.url(n) for n in R.video_names(len(req.prompts))))
    return {"run_id": run_id, "stages": results, "started_by": origin.get("generate_flow_run")}


def _batch_local(good: list, store: str, logger) -> list[dict]:
    """A prompt file's lines in this process, phase by phase (:func:`stages.run.generate_many`):
    every line's encode, then sampling, decoding and mux, each phase loading each component once
    per model; each line its own run (its artifacts as a ``vidax-generate`` run's)."""
    from vidax.core import runtime

    runtime.setup()
    rs = RunStore(store)
    rs.check_writable()
    items = [R.BatchItem(rs.run(b.run_id or b.request.default_run_id()), b.request, label=f"line {b.line}")
             for b in good]
    R.generate_many(items, log=logger.info)
    rows = []
    for b, it in zip(good, items):
        if it.ok:
            results = [{"stage": r.stage, "key": r.key, "status": r.status, "seconds": round(r.seconds, 3),
                        "hardware": r.hardware} for r in it.results.values()]
            _report(it.run, it.req, results)
            rows.append({"line": b.line, "prompt": b.request.prompts[0][:60], "status": "done", "run": it.run.run_id,
                         "output / error": ", ".join(it.run.url(n) for n in R.video_names(len(it.req.prompts)))})
        else:
            err = R.describe_error(it.error)
            logger.error("line %d failed: %s", b.line, err)
            if isinstance(it.error, R.StageFailed):
                _emit_stage_failed(rs.url, it.run.run_id, it.error.stage, str(it.error), 1)
            rows.append({"line": b.line, "prompt": b.request.prompts[0][:60], "status": "failed",
                         "run": it.run.run_id, "output / error": err[:300]})
    return rows


def _batch_distributed(good: list, store: str, logger, slices: int, job_variables: dict | None = None) -> list[dict]:
    """A prompt file's lines as phases of child runs: per phase (stage kind) and group of runs that
    share weights (:func:`stages.run.weights_group`), up to ``slices`` runs of that phase's batch
    deployment (``registry.PHASE_DEPLOYMENTS``: one child per pool by default), each running its
    share of the runs' stages with each component loaded once. A child that leaves stages not
    committed is launched once more for its runs (a killed sampling child: they resume from their
    step checkpoints); a decode stage that a child left is rerun alone by the automation (a failed
    stage is announced by the child, one left by a crashed child by this flow). A run with a stage
    not committed stops there, the others go on."""
    from prefect.runtime import flow_run

    rs = RunStore(store)
    rs.check_writable()
    items: list[tuple] = []  # (prompt line, BatchItem)
    for b in good:
        it = R.BatchItem(rs.run(b.run_id or b.request.default_run_id()), b.request, label=f"line {b.line}")
        try:
            it.pipe = R.make_pipeline(b.request)
            it.keys = R.stage_keys(b.request, it.pipe)
            it.run.write_json("request.json", b.request.to_json())
            it.run.write_json("prefect.json", {"generate_flow_run": str(flow_run.id), "url": _flow_run_url(flow_run.id),
                                               "mode": "distributed-batch"})
            it.results = {}
        except Exception as e:  # noqa: BLE001 - this line fails alone
            it.error = e
        items.append((b.line, it))

    def stages_of(it, kind):
        return [st for st in it.keys if st.split("/")[0] == kind]

    def done(it, st):
        return R.committed(it.run, st, it.keys[st], req=it.req, pipe=it.pipe)

    groups: dict[tuple, list] = {}
    for _, it in items:
        if it.error is None:
            groups.setdefault(R.weights_group(it.req), []).append(it)
    for kind in R.PHASES:
        name = registry.PHASE_DEPLOYMENTS[kind]
        for g, members in enumerate(groups.values()):
            todo = []
            for it in (m for m in members if m.error is None):
                left = [st for st in stages_of(it, kind) if not done(it, st)]
                for st in stages_of(it, kind):
                    it.results[st] = {"stage": st, "key": it.keys[st], "status": "ran" if st in left else "skipped"}
                if left:
                    todo.append(it)
            for attempt in (1, 2):
                if not todo:
                    break
                n = max(1, min(slices, len(todo)))
                chunks = [todo[i::n] for i in range(n)]
                first = chunks[0][0].req
                jv = {**registry.get(first.model).job_variables(kind, first.preset), **(job_variables or {}).get(kind, {})}
                children = []
                for c, chunk in enumerate(chunks):
                    ids = [it.run.run_id for it in chunk]
                    fr = _launch(name, {"store": rs.url, "kind": kind, "run_ids": ids, "attempt": attempt}, jv,
                                 f"{flow_run.id}:{kind}:{g}:{c}:attempt-{attempt}", [f"vidax-phase:{kind}"])
                    logger.info("[%s] %d run(s) (%s) -> %s: child run %s %s", kind, len(ids), ", ".join(it.label for it in chunk),
                                name, fr.name, _flow_run_url(fr.id))
                    children.append((fr, chunk))
                ended = []
                for fr, chunk in children:
                    leases = [(it.run, st) for it in chunk for st in stages_of(it, kind)]
                    state = _await_child(fr, f"{kind} of {len(chunk)} run(s)", leases, stage_timeout(kind) * len(leases))
                    what = state.type.value if state else "without a state"
                    logger.info("[%s] child run %s ended %s: %s", kind, fr.name, what, (state.message if state else "") or "")
                    ended.append((fr, chunk, state))
                left = [it for it in todo if not all(done(it, st) for st in stages_of(it, kind))]
                if not left:
                    break
                if kind == "decode" or attempt == 2:
                    for fr, chunk, state in ended:
                        if state is None or state.is_crashed() or state.is_cancelled():  # announced by no one yet
                            for it in chunk:
                                for st in stages_of(it, kind):
                                    if not done(it, st):
                                        _emit_stage_failed(rs.url, it.run.run_id, st, f"child run {fr.name} crashed", 1)
                    for it in left:
                        st = next(st for st in stages_of(it, kind) if not done(it, st))
                        it.error = R.StageError(f"{st}: not committed by its child run (see its log); run it again "
                                                f"with: vidax stage {it.run.run_id} {st} --store {rs.url}")
                    break
                logger.warning("[%s] %d run(s) left by their child run(s): launched again, resuming from what they "
                               "committed", kind, len(left))
                todo = left
        logger.info("[%s] done: %d of %d run(s) on", kind, sum(it.error is None for _, it in items), len(items))
    rows = []
    for line, it in items:
        if it.error is None:
            R.write_manifest(it.run, it.req, it.keys)
            _report(it.run, it.req, list(it.results.values()))
            rows.append({"line": line, "prompt": it.req.prompts[0][:60], "status": "done", "run": it.run.run_id,
                         "output / error": ", ".join(it.run.url(n) for n in R.video_names(len(it.req.prompts)))})
        else:
            err = R.describe_error(it.error)
            logger.error("line %d failed: %s", line, err)
            rows.append({"line": line, "prompt": it.req.prompts[0][:60], "status": "failed", "run": it.run.run_id,
                         "output / error": err[:300]})
    return rows


@flow(name="vidax-generate-batch", log_prints=True)
def generate_batch(prompt_file: str, store: str = "", defaults: dict | None = None, slices: int = 1,
                   mode: str = "", job_variables: dict | None = None):
    """Generate one video per line of a prompt file (.txt / .jsonl / .csv at any fsspec URL), phase
    by phase: every line's encode, then sampling, decoding and mux, each component loaded once per
    phase for all the lines that share it. ``mode="local"``: in this process; ``"distributed"``: per
    phase, up to ``slices`` child runs of the phase's batch deployment (its pool; ``job_variables``
    per stage kind, as :func:`generate` takes them, over the model's own). Empty ``store`` /
    ``mode`` (e.g. from an event that names none) mean $VIDAX_STORE (default ``vidax-runs``) and
    $VIDAX_MODE (default local)."""
    logger = get_run_logger()
    store = resolve_store(store)
    mode = mode or os.environ.get("VIDAX_MODE", "local")
    if mode not in ("local", "distributed"):
        raise ValueError(f"mode: {mode!r}; choose local or distributed")
    try:
        lines = parse_prompt_file(prompt_file, defaults)
    except PromptFileError as e:
        logger.error("%s", e)
        return Failed(message=str(e))
    bad = [b for b in lines if b.error]
    for b in bad:
        logger.error("%s line %d rejected: %s", prompt_file, b.line, b.error)
    good = [b for b in lines if b.request is not None]
    logger.info("%d prompts to run, %d lines rejected, mode %s", len(good), len(bad), mode)
    rows = [{"line": b.line, "prompt": "", "status": "rejected", "run": "", "output / error": b.error} for b in bad]
    rows += _batch_local(good, store, logger) if mode == "local" else _batch_distributed(good, store, logger, slices,
                                                                                         job_variables)
    rows.sort(key=lambda r: r["line"])
    create_table_artifact(rows, key=_artifact_key("vidax-batch", prompt_file.rsplit("/", 1)[-1]),
                          description=f"Batch summary for {prompt_file}")
    summary = {"file": prompt_file, "rows": rows, "done": sum(r["status"] == "done" for r in rows),
               "failed": [r["line"] for r in rows if r["status"] == "failed"],
               "rejected": [r["line"] for r in rows if r["status"] == "rejected"]}
    message = batch_message(summary)
    logger.info(message)
    if summary["failed"] or not good:  # rejected lines alone do not fail a batch whose prompts all ran
        return Failed(message=message)
    return Completed(message=message, data=summary)  # the run's state says what was done and rejected


def batch_message(summary: dict) -> str:
    """The state message of a ``generate-batch`` run: how many prompts were done (of how many run),
    which lines failed and which were rejected, and where the table is."""
    ran = summary["done"] + len(summary["failed"])
    return (f"{summary['done']} of {ran} prompt(s) done; failed lines {summary['failed']}; rejected lines "
            f"{summary['rejected']} (table artifact: batch summary for {summary['file']})")
