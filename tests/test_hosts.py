"""The hosts: the code that carries the protocol machines' actions out, shared by the services and the simulator.

Each hole found in the services' old adapters has a direct test here that goes red without its fix (the
simulator finds each too, as the ``duplicate_reserve``, ``unconfirmed_fence`` and ``restart_unfenced`` variants,
in ``test_protocol_models``), and the layout rule that keeps them closed: no lease-state test, page free or engine
private call in ``kvseal/server/``.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from kvseal.protocol import router as rc
from kvseal.protocol.machine import Variants
from kvseal.server.router import DisaggBackend

ROOT = Path(__file__).resolve().parent.parent


def _fenced(health: rc.WorkerHealth) -> list:
    acts = []
    for _ in range(3):
        acts += health.probe_failed(100.0, timed_out=False)
    return acts


def test_a_fenced_prefill_comes_back_only_when_every_decode_confirmed():
    h = rc.WorkerHealth("p", "prefill", decodes=("d1", "d2"))
    assert _fenced(h) == [rc.Fence("p", ("d1", "d2"))] and h.state is rc.HealthState.FENCED
    h.confirmed("d1")
    assert h.probe_ok(101.0) == [rc.Fence("p", ("d2",))], "the decode that missed it is asked again"
    assert h.state is rc.HealthState.FENCED, "back in service while d2 still takes its old capabilities"
    assert h.probe_failed(102.0, timed_out=False) == [rc.Fence("p", ("d2",))]
    assert h.probe_unhealthy(102.5) == [rc.Fence("p", ("d2",))] and h.state is rc.HealthState.FENCED, \
        "an unhealthy answer must not clear the fence on the way to DOWN (then UP)"
    h.confirmed("d2")
    assert h.probe_ok(103.0) == [] and h.healthy


def test_without_confirmation_a_fenced_prefill_comes_back_at_once():
    h = rc.WorkerHealth("p", "prefill", decodes=("d1", "d2"), variants=Variants.only("unconfirmed_fence"))
    _fenced(h)
    assert h.probe_ok(101.0) == [] and h.healthy  # the bug: d1 and d2 may never have heard the fence


def test_a_prefill_that_restarted_between_probes_is_fenced():
    """A new process behind the same URL, seen in fewer misses than a fence needs (none, here): the process that
    held the router's unsettled leases is dead, so they are fenced now rather than left QUARANTINED to the TTL.
    A decode that restarts is not fenced (its pool died with it), nor a prefill answering as the same process."""
    h = rc.WorkerHealth("p", "prefill", decodes=("d1",))
    assert h.probe_ok(100.0, "a") == [] and h.healthy
    assert h.probe_ok(101.0, "a") == [] and h.healthy
    assert h.probe_failed(101.5, timed_out=False) == [] and h.state is rc.HealthState.DOWN
    assert h.probe_ok(102.0, "b") == [rc.Fence("p", ("d1",))] and h.state is rc.HealthState.FENCED
    h.confirmed("d1")
    assert h.probe_ok(103.0, "b") == [] and h.healthy
    assert h.probe_ok(104.0, "c") == [rc.Fence("p", ("d1",))], "a restart with no probe missed at all"
    d = rc.WorkerHealth("d", "decode")
    assert d.probe_ok(100.0, "a") == [] and d.probe_ok(101.0, "b") == [] and d.healthy


def test_ignoring_the_start_token_leaves_a_restarted_prefill_unfenced():
    h = rc.WorkerHealth("p", "prefill", decodes=("d1",), variants=Variants.only("restart_unfenced"))
    assert h.probe_ok(100.0, "a") == [] and h.probe_ok(101.0, "b") == [] and h.healthy  # the bug (the soak's find)


def test_the_router_fences_an_unreachable_decode_until_it_answers():
    """The router's adapter: d2 is unreachable (probes and fence alike) when the fence goes out; the old code
    fenced only the decodes it believed healthy, once. d2 is asked at each probe, and the prefill stays out of
    service until d2 confirmed."""
    prefill_up, d2_reachable = [False], [False]
    fences: list[str] = []

    def handle(req: httpx.Request) -> httpx.Response:
        host = req.url.host
        if req.url.path == "/health":
            if (host == "p" and not prefill_up[0]) or (host == "d2" and not d2_reachable[0]):
                raise httpx.ConnectError("refused")
            return httpx.Response(200, json={"status": "ok", "context_window": 64, "pool_tokens": 64})
        if req.url.path == "/kv/fence":
            fences.append(host)
            if host == "d2" and not d2_reachable[0]:
                raise httpx.ConnectError("unreachable")
            return httpx.Response(200, json={"fenced": 0})
        return httpx.Response(404)

    async def run() -> None:
        r = DisaggBackend(["http://p"], ["http://d1", "http://d2"], "m",
                          http={"transport": httpx.MockTransport(handle)})
        p = r.prefills[0]
        for _ in range(3):
            await r.refresh()
        assert p.health.state is rc.HealthState.FENCED and sorted(fences) == ["d1", "d2"]
        assert not r.decodes[1].healthy  # unreachable: the old code would never have tried it
        prefill_up[0] = True
        await r.refresh()
        assert not p.healthy, "the prefill came back while d2 never moved its epoch"
        assert fences.count("d2") == 2
        d2_reachable[0] = True
        await r.refresh()  # d2 confirms in this round
        await r.refresh()
        assert p.healthy and fences.count("d1") == 1
        await r.client.aclose()

    asyncio.run(run())


def test_server_has_no_lease_state_test_page_free_or_engine_private_call():
    """Every lease-state decision is the core's, every page the host's ports' (over the engine's public
    methods): what the simulator runs is what ships."""
    bad = []
    for f in sorted((ROOT / "kvseal" / "server").glob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"LeaseState\.|\.state is|pool\.free\(|engine\._[a-z]|\.quarantined\[", line):
                bad.append(f"{f.name}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
