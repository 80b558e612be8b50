"""Every fault point of the transfer protocol, end to end on real processes (router + prefill + decode).

Each fault ends the request exactly once with the right status, and every surviving pool gets all its pages
back. Where a protection stands against the fault, the same run with that protection off shows the damage.

The protocol's fault points share one cluster per set of protections (its workers start with
``KVSEAL_FAULTS=armable``; each test arms its own fault and starts on an idle, whole cluster, every worker in
service; a worker a crash point killed is started again on its port afterwards). A run that leaks pages by
design, stops or kills the router, or needs other worker flags gets its own.
"""

import os
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from conftest import MODEL, Trio, complete, wait_pages_back

from kvseal.faults import CRASH_EXIT, DECODE_POINTS

PROMPT = "The capital of France is"
POOL = ["--kv-pool-tokens", "8192"]
ARMABLE = {"KVSEAL_FAULTS": "armable"}


@pytest.fixture(scope="module")
def hardened():
    with Trio(POOL, ["--timeout", "10"], env=ARMABLE) as t:
        yield t


@pytest.fixture(scope="module")
def no_checksum():
    unsafe = ["--unsafe-no-checksum"]
    with Trio([*POOL, *unsafe], unsafe, env={**ARMABLE, "KVSEAL_UNSAFE": "1"}) as t:
        yield t


@contextmanager
def armed(t: Trio, fault: str, delay: float = 2.0):
    """``t`` idle and whole, every worker in service, with ``fault`` armed on both workers until the end."""
    t.wait_ready()
    wait_pages_back(t.pre)
    wait_pages_back(t.dec)
    t.arm(fault, delay)
    try:
        yield t
    finally:
        for s in (t.pre, t.dec):
            if s.proc.poll() is not None:  # a crash fault fired: the same worker again, on its port, armable
                s.restart()
        t.arm("")


@contextmanager
def cluster(request, fault: str, shared: str, env: dict | None = None, delay: float = 2.0, **own):
    """The module's ``shared`` cluster armed with ``fault``; or, with ``own`` Trio arguments, a cluster of
    the test's own started with the fault (``env``)."""
    if own:
        with Trio(**own, env={"KVSEAL_FAULTS": fault, "KVSEAL_FAULT_DELAY": str(delay), **(env or {})}) as t:
            yield t
    else:
        with armed(request.getfixturevalue(shared), fault, delay) as t:
            yield t


@pytest.mark.parametrize("fault,status", [
    ("duplicate_commit", 200),  # the second commit changes nothing
    ("delay_commit", 200),  # late is not wrong
    ("drop_commit", 503),  # decode never hears: the lease is dropped, pages come back
    ("crash_before_write", 503),  # prefill dies before writing: fenced, the lease is freed
    ("crash_after_write", 503),  # prefill dies between writes and commit: fenced, the lease is freed
    ("crash_after_commit", 503),  # decode runs a verified request nobody will read: stopped
    ("crash_at_reserve", 503),  # decode dies before it leased anything
    ("crash_at_commit", 503),  # decode dies holding the lease: prefill frees its own pages
])
def test_protocol_faults_end_cleanly(request, fault, status):
    with cluster(request, fault, "hardened") as t:
        r = complete(t.url, PROMPT)
        assert r.status_code == status, r.text
        if status == 200:
            assert "Paris" in r.json()["choices"][0]["text"]
        crashed = t.dec if fault in DECODE_POINTS else t.pre
        for s in (t.pre, t.dec):
            if fault.startswith("crash") and s is crashed:
                assert s.proc.wait(10) == CRASH_EXIT  # the fault did fire
            else:
                wait_pages_back(s, timeout=30)


@pytest.mark.parametrize("fault", ["corrupt_page_write", "skip_page_write", "reorder_commit", "corrupt_commit"])
@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "unsafe"])
def test_checksum_catches_bad_bytes_and_bad_messages(request, fault, checksum, colocated):
    """Pages corrupted, never written, written after the commit; a commit corrupted on the way."""
    with cluster(request, fault, "hardened" if checksum else "no_checksum", delay=1) as t:
        r = complete(t.url, PROMPT)
        if checksum:
            assert r.status_code == 500 and r.json()["error"]["code"] == "kv_integrity_error", r.text
            wait_pages_back(t.pre)
            wait_pages_back(t.dec)
            return
        assert r.status_code == 200, r.text  # the damage: bad KV accepted and served as a success
        if fault != "corrupt_page_write":  # one flipped slot may not change greedy output; the rest must
            reference = complete(colocated.url, PROMPT).json()["choices"][0]["text"]
            assert r.json()["choices"][0]["text"] != reference


def leave_early(url: str, after: float) -> None:
    """A streaming client that hangs up ``after`` seconds in, before any token has come."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    timeout = httpx.Timeout(30, read=after)
    with pytest.raises(httpx.ReadTimeout), httpx.stream("POST", url + "/v1/completions", json=body,
                                                         timeout=timeout) as r:
        for _ in r.iter_lines():
            pass


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "unsafe"])
def test_client_leaving_during_reserve_never_leaks_the_lease(request, guard):
    """Decode grants the lease 3 s late; the client left at 1 s. Guarded, the lease is handed back;
    unguarded, the reservation is cut off mid-call and its pages stay reserved for nobody (its own cluster)."""
    unsafe = ["--unsafe-no-disconnect-guard"]
    own = {} if guard else {"worker": [*POOL, *unsafe], "router": unsafe}
    with cluster(request, "delay_reserve", "hardened", {"KVSEAL_UNSAFE": "1"}, delay=3, **own) as t:
        leave_early(t.url, after=1.0)
        if guard:
            wait_pages_back(t.dec, timeout=20)
        else:
            time.sleep(6)
            assert t.dec.health()["reserved"] > 0, "the cut-off reservation should have leaked its pages"
        wait_pages_back(t.pre)


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "unsafe"])
def test_client_leaving_mid_transfer_never_frees_pages_under_a_live_writer(request, guard):
    """Prefill writes the pages 3 s late; the client left at 0.6 s. Guarded, decode holds the lease until
    the write and commit have landed, then stops and frees it; unguarded (the 2026 load balancer), decode
    is told the writer is gone and frees the pages while prefill is still about to write into them."""
    unsafe = ["--unsafe-no-disconnect-guard"]
    own = {} if guard else {"worker": [*POOL, *unsafe], "router": unsafe}
    with cluster(request, "delay_page_write", "hardened", {"KVSEAL_UNSAFE": "1"}, delay=3, **own) as t:
        t0 = time.time()
        leave_early(t.url, after=0.6)
        time.sleep(max(0.0, 1.6 - (time.time() - t0)))
        mid = t.dec.health()  # the write is still ~1.5 s away
        if guard:
            assert mid["reserved"] > 0, f"pages released while the writer is live: {mid}"
            wait_pages_back(t.dec, timeout=20)  # then the committed request is stopped, nothing leaks
        else:
            assert mid["reserved"] == 0 and mid["free_pages"] == mid["total_pages"], \
                f"the unguarded router should have freed the lease under the live writer: {mid}"
        wait_pages_back(t.pre, timeout=20)


@pytest.mark.parametrize("ttl", ["2", "0"], ids=["ttl", "no-ttl"])
def test_a_router_dying_after_reserve_leaks_no_lease(ttl):
    """The router dies holding a fresh lease, before prefill heard of the request: nobody will ever abort
    it. Decode expires it after its TTL and frees it once prefill confirms it is not (and will never be)
    writing into it; with no TTL its pages stay reserved for nobody."""
    with Trio(POOL, env={"KVSEAL_FAULTS": "crash_after_reserve"}, decode=["--lease-ttl", ttl]) as t:
        with pytest.raises(httpx.HTTPError):
            complete(t.url, PROMPT)
        assert t.router.proc.wait(10) == CRASH_EXIT
        if ttl != "0":
            wait_pages_back(t.dec, timeout=20)
        else:
            time.sleep(8)  # past the router-gone grace period too: that stops the lease but cannot free it
            h = t.dec.health()
            assert h["free_pages"] < h["total_pages"], "without a TTL the orphaned lease should still hold its pages"
        wait_pages_back(t.pre)


def test_a_prefill_back_before_it_could_be_fenced_leaves_nothing_to_the_ttl():
    """kill -9 of prefill mid-transfer: the router's Forget finds nobody there, so decode keeps the lease
    QUARANTINED (for all it knows the writer lives). The prefill is back before three missed probes could fence
    it (the router is stopped meanwhile: it misses none at all). The router sees a new process at its next
    probe and fences the old one: the pages come back in seconds, not at the 120 s lease TTL. (Found by the
    soak, once worker starts became fast.)"""
    with Trio(POOL, env={"KVSEAL_FAULTS": "delay_page_write", "KVSEAL_FAULT_DELAY": "60"}) as t:
        client = threading.Thread(target=lambda: complete(t.url, PROMPT), daemon=True)
        client.start()
        until(lambda: t.dec.health()["reserved"] > 0, "no lease taken")
        t.pre.kill()
        until(lambda: t.dec.health()["quarantined"] > 0, "the lease was not quarantined")
        os.kill(t.router.proc.pid, signal.SIGSTOP)
        try:
            t.pre.restart()
        finally:
            os.kill(t.router.proc.pid, signal.SIGCONT)
        client.join(30)
        wait_pages_back(t.dec, timeout=15)


def until(ok, what: str, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not ok():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_a_router_dying_mid_stream_stops_its_decode_work():
    """kill -9 of the router while decode streams a long answer: nobody will read it or abort it. Decode sees
    the router's event stream close, waits a grace period for a reconnect, then stops the request and frees
    its pages, instead of generating thousands of tokens for nobody."""
    with Trio(POOL) as t:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", t.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            while "text" not in next(lines):  # decode is generating
                pass
            t.router.proc.kill()
            t.router.proc.wait(10)
        assert t.dec.health()["free_pages"] < t.dec.health()["total_pages"]
        wait_pages_back(t.dec, timeout=20)  # 6000 tokens take minutes here: only a stop frees them this soon
        wait_pages_back(t.pre)


def test_workers_with_different_page_shapes_refuse_to_transfer():
    """Prefill pages of 16 slots, decode pages of 8: the lease's layout is refused before any byte is
    written, the request fails with an error (never 200 over misread KV) and both pools get every page back."""
    with Trio(POOL, prefill=["--page-size", "16"], decode=["--page-size", "8"]) as t:
        r = complete(t.url, PROMPT)
        assert r.status_code >= 500 and "layout" in r.json()["error"]["message"], r.text
        wait_pages_back(t.pre)
        wait_pages_back(t.dec)
