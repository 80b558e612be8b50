"""Each protection against the fault that attacks it, with the protection on (caught) and off (damage seen)."""

import asyncio
import threading
import time

import pytest
import torch
from engine_util import chat_ids, make_engine

from kvseal.config import EngineConfig, PoolConfig, Protections
from kvseal.engine.engine import Engine
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Sequence
from kvseal.errors import KVIntegrityError, Overloaded
from kvseal.kv.pool import PagePool, PageRun, PageState
from kvseal.server.decode import DecodeService, LeaseRevoked
from kvseal.transfer import messages as P


# -- abort-ack retention: a late write never lands in a page handed to another request -----------------
def decode_service(prot: Protections, landing: bool = False) -> DecodeService:
    """``landing``: the pool has a landing area, as a GPU pool's (kvseal.transfer.staging), holding bytes of
    its own."""
    cfg = EngineConfig(pool=PoolConfig(num_pages=2, page_size=16), dtype="fp32", protections=prot)
    land = torch.full((2, 2, 2, 1, 16, 8), 7.0) if landing else None
    pool = PagePool(cfg.pool, 2, 1, 8, torch.float32, landing=land)
    return DecodeService(Engine(cfg, None, pool, role="decode").start(), (), "unused", "d0", reserve_wait=2.0)


def reserve(rid: int) -> P.Reserve:
    return P.Reserve(rid=rid, tenant="t", prompt=[1] * 20, max_new=4, sampling={}, prefill_id="p0")


async def late_write_scenario(prot: Protections) -> dict:
    svc = decode_service(prot)
    try:
        l1 = await svc.reserve(reserve(1))  # both pages of the pool
        await svc.abort(P.Abort(rid=1))  # client gone; prefill has not said it stopped writing
        try:
            l2 = await svc.reserve(reserve(2))
        except Overloaded:
            l2 = None
        svc.pool.kv[list(l1.pages)] = 7.0  # prefill's late write for request 1 lands now
        hit = l2 is not None and bool((svc.pool.kv[list(l2.pages)] == 7.0).any())
        released = await svc.writer_done(P.WriterDone(rid=1, nonce=l1.nonce, cap=l1.cap))
        late_commit_refused = True
        try:
            await svc.commit(P.Commit(rid=1, nonce=l1.nonce, n_tokens=20, first_token=0, pages=l1.pages[:2],
                                      generations=l1.generations[:2], checksum="", cap=l1.cap))
            late_commit_refused = False
        except LeaseRevoked:
            pass
        await asyncio.wrap_future(svc.engine.call(svc.pool.check_integrity))
        return {"l2": l2, "hit": hit, "released": released, "refused": late_commit_refused,
                "free": svc.pool.num_free}
    finally:
        svc.engine.stop()


def test_abort_ack_retention_keeps_late_writes_out_of_other_requests():
    r = asyncio.run(late_write_scenario(Protections()))
    assert r["l2"] is None  # quarantined pages are not handed out: request 2 waits (503), never shares them
    assert not r["hit"] and r["released"]["released"] and r["refused"]
    assert r["free"] == 2  # WriterDone gave the pages back


def test_without_retention_the_late_write_corrupts_the_next_owner():
    r = asyncio.run(late_write_scenario(Protections(deferred_release=False)))
    assert r["l2"] is not None and r["hit"], "the unprotected pool should hand the pages on and be overwritten"


# -- page tags: a page table that went stale is never read --------------------------------------------------
def stale_table_run(lm, prot: Protections) -> dict:
    prompt = chat_ids(lm, "List three colors.")
    pages = -(-(len(prompt) + 40) // 16)  # exactly the victim's reservation: the thief gets the same pages
    engine = make_engine(lm, pages=pages, protections=prot)
    events = []
    victim = Sequence(901, prompt, SamplingParams(max_tokens=40, temperature=0), events.append)

    victim_pages, victim_gens = [], []

    def steal() -> None:  # a scheduler bug: the victim's pages are freed and handed to someone else
        pool = engine.pool
        pool.free(victim.run)
        victim_pages.append(victim.run.pages)
        theirs = pool.allocate(902, pool.num_free)  # every free page, the victim's among them...
        keep = [i for i, p in enumerate(theirs.pages) if p not in victim.run.pages]
        victim_gens.append(tuple(theirs.generations[theirs.pages.index(p)] for p in victim.run.pages))
        pool.free(PageRun(tuple(theirs.pages[i] for i in keep), tuple(theirs.generations[i] for i in keep)))
        # ...then the others go back, so the victim still has pages to grow into

    try:
        engine.submit(victim).result()
        deadline = time.time() + 60
        while len(events) < 3 and time.time() < deadline:
            time.sleep(0.01)
        engine.call(steal).result()
        while not (events and events[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.05)
        return {"final": events[-1], "thief": engine.pool.owned_by(902),
                "thief_ok": engine.pool.run_ok(PageRun(victim_pages[0], victim_gens[0]), 902, PageState.OWNED)}
    finally:
        engine.stop()


def test_page_tags_fail_a_stale_table_closed(fp32_model):
    r = stale_table_run(fp32_model, Protections())
    assert r["final"].finish_reason == "error" and isinstance(r["final"].error, KVIntegrityError)
    assert r["thief"] > 0 and r["thief_ok"]  # the failed request let go only of pages still tagged for it


def test_without_page_tags_the_stale_pages_are_read(fp32_model):
    r = stale_table_run(fp32_model, Protections(page_tags=False))
    assert r["final"].finish_reason in ("stop", "length")  # served from pages it no longer owns


# -- admission boundaries -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,ok", [(1023, True), (1024, True), (1025, False)])
def test_engine_admission_boundary(fp32_model, n, ok):
    """The engine's own re-check: prompt + max_tokens against min(context, pool) = 1024."""
    engine = make_engine(fp32_model, pages=64, context_window=2048)
    try:
        seq = Sequence(5000 + n, [5] * (n - 1), SamplingParams(max_tokens=1, temperature=0), lambda ev: None)
        fut = engine.submit(seq)
        if ok:
            fut.result()
        else:
            with pytest.raises(Exception, match="1024"):
                fut.result()
            assert engine.pool.num_free == 64  # rejected before any page was allocated
    finally:
        engine.stop()


# -- an abort racing a commit: whichever reaches the engine thread second sees the other --------------------
async def abort_during_commit() -> tuple[P.Ack, int]:
    svc = decode_service(Protections())
    try:
        lease = await svc.reserve(reserve(3))
        pages, gens = lease.pages[:2], lease.generations[:2]
        digest = P.checksum(svc.pool.kv, pages, 20, 3, lease.nonce, pages, gens, 7)
        commit = P.Commit(rid=3, nonce=lease.nonce, n_tokens=20, first_token=7, pages=pages, generations=gens,
                          checksum=digest, cap=lease.cap)
        gate = threading.Event()
        svc.engine.call(gate.wait)  # hold the engine thread: the commit's verification queues behind it
        committing = asyncio.ensure_future(svc.commit(commit))
        await asyncio.sleep(0.05)  # the commit passed its event-loop checks
        aborting = asyncio.ensure_future(svc.abort(P.Abort(rid=3)))
        await asyncio.sleep(0.05)  # the abort flagged the lease
        gate.set()
        ack = await committing
        await aborting
        await svc.writer_done(P.WriterDone(rid=3, nonce=lease.nonce, cap=lease.cap))
        await asyncio.wrap_future(svc.engine.call(svc.pool.check_integrity))
        return ack, svc.pool.num_free
    finally:
        svc.engine.stop()


def test_an_abort_that_overtakes_a_commit_wins():
    ack, free = asyncio.run(abort_during_commit())
    assert not ack.ok and ack.code == "lease_revoked", ack
    assert free == 2


def test_a_request_whose_events_stop_fails_instead_of_hanging():
    """The decode stream stays alive (heartbeats), but nothing comes for this request: 503, not a hang."""
    from kvseal.server.router import DisaggBackend

    async def run() -> None:
        backend = DisaggBackend(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], "m", timeout=0.3)
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(P.TokenEvent(5, [11], None))
        got = []
        with pytest.raises(Overloaded, match="sent nothing for request 5"):
            async for ev in backend._events(q, 5):
                got.append(ev.token_ids)
        assert got == [(11,)]

    asyncio.run(asyncio.wait_for(run(), 5))  # without the bound this would hang: fail it instead


def test_a_duplicate_reserve_racing_the_first_leaks_no_pages():
    """Two reserves for one rid at once: the second is refused (403) and, once the first lease is aborted and
    its writer done, every page is back. (The second used to take pages of its own and overwrite the first's
    record before the core refused it, so the first lease's pages were never released.)"""
    async def scenario() -> tuple[list, int, int]:
        cfg = EngineConfig(pool=PoolConfig(num_pages=4, page_size=16), dtype="fp32")
        pool = PagePool(cfg.pool, 2, 1, 8, torch.float32)
        svc = DecodeService(Engine(cfg, None, pool, role="decode").start(), (), "unused", "d0")
        try:
            got = await asyncio.gather(svc.reserve(reserve(1)), svc.reserve(reserve(1)), return_exceptions=True)
            lease = next(g for g in got if isinstance(g, P.Lease))
            await svc.abort(P.Abort(rid=1))
            await svc.writer_done(P.WriterDone(rid=1, nonce=lease.nonce, cap=lease.cap))
            await asyncio.wrap_future(svc.engine.call(svc.pool.check_integrity))
            return got, svc.pool.num_free, pool.cfg.num_pages
        finally:
            svc.engine.stop()

    got, free, total = asyncio.run(scenario())
    assert sorted(type(g).__name__ for g in got) == ["Forbidden", "Lease"], got
    assert free == total, f"{total - free} pages never came back"


# -- decode's tag check at commit: a leased page handed to anyone else is never read as the lease's ----------
async def retagged_commit(prot: Protections, landing: bool = False) -> tuple[P.Ack, dict]:
    svc = decode_service(prot, landing)
    try:
        lease = await svc.reserve(reserve(1))
        k = svc.pool.cfg.pages_for(20)
        digest = P.checksum(svc.pool.kv, lease.pages[:k], 20, 1, lease.nonce, lease.pages[:k],
                            lease.generations[:k], 0)
        svc.pool.owner[lease.pages[0]] = 99  # a pool bug handed the page to request 99 meanwhile
        ack = await svc.commit(P.Commit(rid=1, nonce=lease.nonce, n_tokens=20, first_token=0, pages=lease.pages[:k],
                                        generations=lease.generations[:k], checksum=digest, cap=lease.cap))
        return ack, dict(svc.core.refused)
    finally:
        svc.engine.stop()


def test_a_commit_into_pages_tagged_for_another_request_is_refused():
    ack, refused = asyncio.run(retagged_commit(Protections()))
    assert not ack.ok and ack.status == 500 and ack.code == "kv_integrity_error", ack
    assert refused == {"tag": 1}


def test_a_staged_commit_into_pages_tagged_for_another_request_leaves_them_as_they_were():
    """A GPU pool's commit copies the lease's pages in from the landing area only once their tags hold: pages a
    pool bug handed to another request keep that request's bytes."""
    async def run() -> tuple[P.Ack, bool]:
        svc = decode_service(Protections(), landing=True)
        try:
            lease = await svc.reserve(reserve(1))
            k = svc.pool.cfg.pages_for(20)
            svc.pool.owner[lease.pages[0]] = 99  # request 99's page now, holding its keys and values
            svc.pool.kv[lease.pages[0]] = 1.0
            ack = await svc.commit(P.Commit(rid=1, nonce=lease.nonce, n_tokens=20, first_token=0,
                                            pages=lease.pages[:k], generations=lease.generations[:k], checksum="0",
                                            cap=lease.cap))
            return ack, bool((svc.pool.kv[lease.pages[0]] == 1.0).all())
        finally:
            svc.engine.stop()

    ack, untouched = asyncio.run(run())
    assert not ack.ok and ack.code == "kv_integrity_error", ack
    assert untouched, "the landing area was copied over another request's page"


def test_without_page_tags_the_retagged_pages_are_read():
    ack, refused = asyncio.run(retagged_commit(Protections(page_tags=False)))
    assert ack.ok and not refused, ack
