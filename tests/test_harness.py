"""The test harness itself: sampled sweeps and services that die with the worker that started them."""
import os
import signal
import socket
import subprocess
import sys
import time

import prefect  # noqa: F401 - imported at collection, before the session's server starts (see below)

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


def _triggered_by(srv, automation_id) -> dict:
    """{triggering event id: when the automation's trigger fired} from the server's event log."""
    import datetime
    import json
    import urllib.request

    body = json.dumps({"filter": {"event": {"name": ["prefect.automation.triggered"]},
                                  "resource": {"id": [f"prefect.automation.{automation_id}"]}},
                       "limit": 50}).encode()
    req = urllib.request.Request(f"{srv.api}/events/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        events = json.loads(r.read())["events"]
    return {e["payload"]["triggering_event"]["id"]: datetime.datetime.fromisoformat(e["occurred"]) for e in events}


def test_the_test_server_evaluates_a_parked_event_within_seconds(prefect_server):
    """tests/prefect_server.py: an event whose leader (``follows``) never arrives is parked by
    Prefect's event ordering and evaluated after the test server's shortened window (20 s), not
    after Prefect's 15 minutes; an event without a leader is evaluated at once."""
    import asyncio
    import datetime
    import json
    import urllib.request
    import uuid

    from prefect import get_client
    from prefect.events.actions import DoNothing
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    srv = prefect_server
    tag = uuid.uuid4().hex[:8]

    async def create():
        async with get_client() as c:
            trigger = EventTrigger(match={"prefect.resource.id": f"vidax.harness.{tag}.*"}, expect={"vidax.harness.ping"},
                                   posture=Posture.Reactive, threshold=1, within=0)
            return await c.create_automation(AutomationCore(name=f"harness-{tag}", trigger=trigger, actions=[DoNothing()]))

    automation = asyncio.run(create())

    def post(follows=None) -> tuple[str, datetime.datetime]:
        now = datetime.datetime.now(datetime.timezone.utc)
        ev = {"id": str(uuid.uuid4()), "occurred": now.isoformat(), "event": "vidax.harness.ping",
              "resource": {"prefect.resource.id": f"vidax.harness.{tag}.{uuid.uuid4().hex[:6]}"}}
        if follows:
            ev["follows"] = follows
        req = urllib.request.Request(f"{srv.api}/events", data=json.dumps([ev]).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        return ev["id"], now

    def wait_for(event_id, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            fired = _triggered_by(srv, automation)
            if event_id in fired:
                return fired[event_id]
            time.sleep(1)
        return None

    # the automation is live once an event without a leader fires it (posted again until it does)
    deadline = time.time() + 60
    while True:
        first, _ = post()
        if wait_for(first, 5) is not None:
            break
        assert time.time() < deadline, "the automation never fired for an event without a leader"
    parked, sent = post(follows=str(uuid.uuid4()))  # a leader that never comes
    fired = wait_for(parked, 90)
    assert fired is not None, "an event whose leader never arrived was not evaluated within 90 s"
    waited = (fired - sent).total_seconds()
    assert waited >= 15, f"the event was not parked (fired after {waited:.1f} s)"


def test_prefect_imported_before_the_session_server_still_reaches_it(prefect_server):
    """Prefect reads its settings from the environment when first imported (this module imports it
    at collection, before the session's server exists): the server fixture must still be what
    clients and ``run_deployment`` reach, not a temporary server Prefect starts for itself (the cause
    of a flows test's setup timing out and a deployment run never seen by the test's worker)."""
    import asyncio

    from prefect import get_client
    from prefect.context import GLOBAL_SETTINGS_CONTEXT

    assert GLOBAL_SETTINGS_CONTEXT.settings.api.url != prefect_server.api  # imported before the server

    async def url():
        async with get_client() as c:
            await c.api_healthcheck()
            return str(c.api_url)
    assert asyncio.run(url()).rstrip("/") == prefect_server.api
