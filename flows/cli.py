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


def main(argv=None) -> int:
    return stage_cli.main(argv, extend=_add_submit)


if __name__ == "__main__":
    sys.exit(main())
