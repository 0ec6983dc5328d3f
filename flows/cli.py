"""The ``vidax`` console script: the stage commands plus ``vidax submit`` (Prefect event)."""
from __future__ import annotations

import sys

from stages import cli as stage_cli

PROMPTS_UPLOADED = "vidax.prompts.uploaded"


def submit(url: str, store: str | None = None, mode: str | None = None) -> str:
    """Emit ``vidax.prompts.uploaded`` for a prompt file; the ``generate-batch`` deployment's
    trigger starts a batch run for it. Returns the event id."""
    import asyncio
    import hashlib

    import fsspec
    from prefect.events import Event
    from prefect.events.clients import get_events_client

    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise stage_cli.RequestError("file", f"{url!r} does not exist")
    full = url if "://" in url else f"file://{fs._strip_protocol(path)}"
    # every label the trigger templates read is present (empty = the flow's default)
    resource = {"prefect.resource.id": f"vidax.prompts.{hashlib.sha256(full.encode()).hexdigest()[:16]}",
                "vidax.url": full, "vidax.store": store or "", "vidax.mode": mode or ""}
    ev = Event(event=PROMPTS_UPLOADED, resource=resource)

    async def send():  # deliver before returning (a CLI process exits right after)
        async with get_events_client() as client:
            await client.emit(ev)

    asyncio.run(send())
    return str(ev.id)


def _add_submit(ap) -> dict:
    sub = next(a for a in ap._actions if a.dest == "cmd")
    s = sub.add_parser("submit", help="announce a prompt file: the generate-batch deployment's trigger runs it")
    s.add_argument("file", help="prompt file URL (.txt, .jsonl, .csv; local path, gs://, ...)")
    s.add_argument("--store", default=None, help="run store for the batch (default: the deployment's)")
    s.add_argument("--mode", choices=["local", "distributed"], default=None)

    def cmd_submit(a) -> int:
        eid = submit(a.file, a.store, a.mode)
        print(f"submitted {a.file} (event {eid}); the generate-batch deployment will pick it up")
        return 0

    return {"submit": cmd_submit}


# ------------------------------------------------------------------ multi-host stage pods
#: what process 0 runs by default: the Prefect engine, executing the flow run ($PREFECT__FLOW_RUN_ID)
LEADER_COMMAND = "prefect flow-run execute"


def process_id_from_env() -> int:
    """This host's index in a multi-host job, before joining it: ``VIDAX_PROCESS_ID``, else a
    Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX``, else GKE's ``TPU_WORKER_ID``, else 0."""
    import os

    for name in ("VIDAX_PROCESS_ID", "JOB_COMPLETION_INDEX", "TPU_WORKER_ID"):
        v = os.environ.get(name, "").strip()
        if v:
            try:
                return int(v)
            except ValueError:
                raise stage_cli.RequestError(name, f"{v!r}: expected a process index (0, 1, ...)") from None
    return 0


def follower_command(flow_run_id: str, processes: int) -> str:
    """The command every host of a multi-host stage runs (the TPU job template's container command):
    process 0 executes the flow run, the others follow it."""
    return f"vidax stage --flow-run {flow_run_id} --processes {processes}"


def _flow_run_uuid(flow_run_id: str):
    import uuid

    try:
        return uuid.UUID(flow_run_id)
    except ValueError:
        raise stage_cli.RequestError("flow-run", f"{flow_run_id!r}: expected a flow run id (a UUID)") from None


def stage_of_flow_run(flow_run_id: str) -> dict:
    """The parameters (store, run_id, stage, force) of a ``vidax-stage`` flow run, read from the
    Prefect API; a one-line :class:`RequestError` naming ``flow-run`` otherwise."""
    import asyncio

    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    fid = _flow_run_uuid(flow_run_id)
    api = PREFECT_API_URL.value()
    if not api:  # (rather than a temporary server of its own, which knows no flow run)
        raise stage_cli.RequestError("flow-run", f"{flow_run_id}: no Prefect API to read it from; set PREFECT_API_URL "
                                     "(a worker sets it on every pod it starts)")

    async def read():
        async with get_client() as c:
            fr = await c.read_flow_run(fid)
            return fr, await c.read_flow(fr.flow_id)

    try:
        fr, fl = asyncio.run(read())
    except Exception as e:  # noqa: BLE001 - not found, or no server: one line
        raise stage_cli.RequestError("flow-run", f"cannot read flow run {flow_run_id} from the Prefect API at {api}: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if fl.name != "vidax-stage":
        raise stage_cli.RequestError("flow-run", f"{flow_run_id} is a run of {fl.name}; only vidax-stage runs "
                                     "(one stage each) can span several hosts")
    return dict(fr.parameters)


def _add_stage_hosts(ap) -> dict:
    sub = next(a for a in ap._actions if a.dest == "cmd")
    s = sub.choices["stage"]
    g = s.add_argument_group("multi-host stages (one Prefect flow run of vidax-stage over the hosts of a slice)")
    g.add_argument("--flow-run", metavar="ID", help="run on every host: process 0 (VIDAX_PROCESS_ID, else "
                   "JOB_COMPLETION_INDEX) executes this flow run (`prefect flow-run execute`, or "
                   "$VIDAX_LEADER_COMMAND); the others join its JAX job (VIDAX_COORDINATOR) and follow it through "
                   "the stage the flow run names, writing nothing")
    g.add_argument("--processes", type=int, metavar="N", help="processes (hosts) in the job: sets VIDAX_NUM_PROCESSES")

    def cmd_stage(a) -> int:
        import os
        import shlex

        if a.flow_run is None:
            if a.processes is not None:
                raise stage_cli.RequestError("processes", "goes with --flow-run")
            return stage_cli.cmd_stage(a)
        if a.run_id is not None or a.stage is not None:
            raise stage_cli.RequestError("flow-run", "give RUN_ID STAGE or --flow-run, not both (the flow run names "
                                         "its run and stage)")
        _flow_run_uuid(a.flow_run)
        if a.processes is not None:
            if a.processes < 1:
                raise stage_cli.RequestError("processes", f"{a.processes}: expected at least 1")
            os.environ["VIDAX_NUM_PROCESSES"] = str(a.processes)
        index = process_id_from_env()
        if index == 0:  # the leader: the Prefect engine runs the vidax-stage flow in this process
            os.environ["PREFECT__FLOW_RUN_ID"] = a.flow_run
            argv = shlex.split(os.environ.get("VIDAX_LEADER_COMMAND", "").strip() or LEADER_COMMAND)
            sys.stdout.flush()
            sys.stderr.flush()
            os.execvp(argv[0], argv)
        params = stage_of_flow_run(a.flow_run)
        a.run_id, a.stage = params.get("run_id"), params.get("stage")
        a.store = params.get("store") or os.environ.get("VIDAX_STORE") or a.store
        from vidax.core import runtime

        _, n = runtime.setup()  # join process 0's JAX job (before any device is touched)
        print(f"vidax: process {index} of {n}, following flow run {a.flow_run}: stage {a.stage} of run {a.run_id} "
              f"in {a.store}", flush=True)
        return stage_cli.cmd_stage(a)

    return {"stage": cmd_stage}


def _extend(ap) -> dict:
    return {**_add_submit(ap), **_add_stage_hosts(ap)}


def main(argv=None) -> int:
    return stage_cli.main(argv, extend=_extend)


if __name__ == "__main__":
    sys.exit(main())
