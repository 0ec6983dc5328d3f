"""``prefect server start`` for the tests, with a short lost-follower window in its event ordering.

Prefect's triggers process each state event only after the event it ``follows`` (Running before
Crashed). Two consumer tasks take events off the bus concurrently, and when a follower is checked
in the instant its leader is processed, the follower is parked until the lost-follower sweep,
``PRECEDING_EVENT_LOOKBACK`` (15 minutes) later. On a loaded 2-core machine that race parked the
``prefect.flow-run.Crashed`` event of a killed decode stage, so the crash-rerun automation fired
after the test had given up (the event and its leader are both in the server's event table; no
``automation.triggered`` event follows). Users' servers see the same delay (infra/README.md).

This runs the real server in this process with the window set to ``VIDAX_TEST_PREFECT_LOOKBACK``
seconds (default 20), so a parked event is evaluated within about 25 s; the sweep's own interval is
Prefect's (5 s). Nothing else is changed.
"""
import os
import sys
from datetime import timedelta


def main() -> None:
    import prefect.server.events.ordering as ordering
    import prefect.server.events.ordering.db as db_ordering
    import prefect.server.events.ordering.memory as memory_ordering

    lookback = timedelta(seconds=float(os.environ.get("VIDAX_TEST_PREFECT_LOOKBACK", "20")))
    for module in (ordering, memory_ordering, db_ordering):
        module.PRECEDING_EVENT_LOOKBACK = lookback

    from prefect.cli import app

    sys.argv = ["prefect", *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
