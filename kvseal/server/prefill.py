"""The prefill worker's HTTP adapter: admit → prefill → write the leased pages → commit → release.

The rules (admission before any allocation, no placeholder path, a forgotten lease never written, deferred
release, WriterDone after a refused commit) live in ``kvseal.protocol.prefill.PrefillCore``; this module feeds it
(under one lock, from the event loop and the engine thread) and carries out its actions. The engine thread runs
the prefill, samples the first token and writes the KV into the decode pool (``handoff``); the commit travels on
the event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvseal.engine.engine import Engine
from kvseal.engine.errors import BadRequest, EngineError
from kvseal.engine.sampling import Logprob, SamplingParams
from kvseal.engine.sequence import Event, Sequence
from kvseal.faults import Faults
from kvseal.protocol import prefill as core
from kvseal.protocol.prefill import LeaseExpired, PrefillCore  # noqa: F401 - re-exported
from kvseal.server.backend import pool_health
from kvseal.server.dashboard import pool_snapshot
from kvseal.server.decode import ack_error
from kvseal.server.guard import peer_of
from kvseal.transfer import protocol as P


class PrefillService:
    def __init__(self, engine: Engine, writer: object, prefill_id: str, faults: Faults | None = None,
                 http: dict | None = None) -> None:
        self.engine = engine
        self.writer = writer
        self.prefill_id = prefill_id
        self.faults = faults or Faults()
        prot = engine.cfg.protections
        self.core = PrefillCore(prot.admission, prot.deferred_release)
        self.lock = threading.Lock()  # the core is fed from the event loop and the engine thread, one at a time
        self.client = httpx.AsyncClient(timeout=30, **(http or {}))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: dict[int, tuple[P.Prefill, asyncio.Future]] = {}
        engine.handoff = self.handoff

    @property
    def forgotten(self) -> dict[int, None]:
        return self.core.forgotten

    def _feed(self, event: Callable[[], object]) -> object:
        with self.lock:
            return event()

    async def prefill(self, p: P.Prefill) -> P.Ack:
        self.loop = asyncio.get_running_loop()
        cfg = self.engine.cfg
        n = len(p.prompt)
        bug = n + p.max_new > cfg.admit_limit and self.faults.fire("legacy_placeholder")
        acts = self._feed(lambda: self.core.prefill(p.rid, p.lease.nonce, n, p.max_new, cfg.admit_limit,
                                                    cfg.context_window, self.engine.pool.cfg.capacity_tokens, bug))
        if any(isinstance(a, core.Admit) and a.placeholder for a in acts):
            p.prompt = p.prompt[:1]  # the 2026 bug: a 1-token placeholder, committed as if complete
        params = SamplingParams(**{**p.sampling, "max_tokens": 1})  # prefill samples the first token only
        done: asyncio.Future = self.loop.create_future()
        self.pending[p.rid] = (p, done)
        seq = Sequence(p.rid, list(p.prompt), params, self._sink(p.rid, p.lease.nonce), lease=p.lease, group=p.group,
                       tenant=p.tenant)

        def admit() -> None:  # engine thread: a lease forgotten meanwhile never reaches the engine
            if self._feed(lambda: self.core.computing(p.rid, p.lease.nonce)):
                self.engine._admit(seq)  # admission: raises before any allocation

        try:
            if self.faults.fire("delay_prefill_admit"):
                await asyncio.sleep(self.faults.delay)
            try:
                await asyncio.wrap_future(self.engine.call(admit))
            except EngineError as e:  # refused by the engine: the router gets this error, nothing else to settle
                self._feed(lambda e=e: self.core.failed(p.rid, p.lease.nonce, e))
                raise
            return await done
        finally:
            self.pending.pop(p.rid, None)

    async def forget(self, f: P.Forget) -> dict:
        """Stop, or never start, writing into this lease: decode expired it, or the router gave up on it.
        ``{"writing": false}`` promises no byte will land."""
        writing, acts = self._feed(lambda: self.core.forget(f.rid, f.nonce))
        self._carry(acts)
        return {"writing": writing}

    def _carry(self, acts: list) -> None:
        """Event loop: carry out the core's actions."""
        for a in acts:
            if isinstance(a, core.StopCompute):
                self.engine.call(lambda rid=a.rid: self.engine._abort(rid))
            elif isinstance(a, core.ReleaseOwn):
                self.engine.call(lambda rid=a.rid: self.engine.release(rid))
            elif isinstance(a, core.Settle):
                self._settle(a.rid, a.result)

    def _sink(self, rid: int, nonce: int):
        def sink(ev: Event) -> None:  # engine thread
            if ev.error is not None and self.loop:
                err = ev.error if isinstance(ev.error, EngineError) else EngineError(str(ev.error))
                acts = self._feed(lambda: self.core.failed(rid, nonce, err))
                self.loop.call_soon_threadsafe(self._carry, acts)
        return sink

    def _settle(self, rid: int, result: object) -> None:
        entry = self.pending.get(rid)
        if entry and not entry[1].done():
            if isinstance(result, BaseException):
                entry[1].set_exception(result)
            else:
                entry[1].set_result(result)

    def handoff(self, seq: Sequence) -> None:
        """Engine thread, right after prefill: write the prompt's pages into the lease, then commit."""
        lease: P.Lease = seq.lease
        if not any(isinstance(a, core.Write) for a in self._feed(lambda: self.core.prefilled(seq.rid, lease.nonce))):
            self.engine.release(seq.rid)  # withdrawn meanwhile: nothing written, the request was answered
            return
        n = len(seq.prompt)
        k = self.engine.pool.cfg.pages_for(n)
        src, dst = list(seq.run.pages[:k]), lease.pages[:k]
        self.faults.crash("crash_before_write")
        late = self.faults.fire("reorder_commit")
        try:
            if not late:
                self._write(src, lease, dst)
            self.faults.crash("crash_after_write")
        except Exception as e:  # noqa: BLE001 - the transfer failed: nothing was committed
            acts = self._feed(lambda e=e: self.core.written(seq.rid, lease.nonce,
                                                            EngineError(f"KV transfer failed: {e}")))
            self.engine.release(seq.rid)
            self.loop.call_soon_threadsafe(self._carry, [a for a in acts if not isinstance(a, core.ReleaseOwn)])
            return
        acts = self._feed(lambda: self.core.written(seq.rid, lease.nonce))
        if any(isinstance(a, core.ReleaseOwn) for a in acts):
            self.engine.release(seq.rid)  # unsafe: free before decode has even seen the commit
        first = seq.tokens[-1]
        digest = P.checksum(self.engine.pool.kv, src, n, seq.rid, lease.nonce, dst, lease.generations[:k], first)
        if self.faults.fire("corrupt_commit"):
            first = (first + 1) % self.engine.model.cfg.vocab_size  # the message changed after it was hashed
        commit = P.Commit(rid=seq.rid, nonce=lease.nonce, n_tokens=n, first_token=first, pages=dst,
                          generations=lease.generations[:k], checksum=digest, cap=lease.cap)
        late_write = (lambda: self._write(src, lease, dst)) if late else None
        lp, cached = seq.logprob, seq.cached_tokens
        self.loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._commit(seq.rid, commit, late_write, lp, cached)))

    def _write(self, src: list[int], lease: P.Lease, dst: list[int]) -> None:
        """One-sided write of this worker's pages ``src`` into the leased decode pages ``dst``."""
        if self.faults.fire("delay_page_write"):
            time.sleep(self.faults.delay)
        mine = list(self.engine.pool.kv.shape)
        if lease.layout[1:] != mine[1:]:  # page count may differ; a page's shape may not
            raise ValueError(f"decode pool layout {lease.layout} does not match this worker's {mine}")
        dtype = str(self.engine.pool.kv.dtype).removeprefix("torch.")
        if lease.dtype and lease.dtype != dtype:  # e.g. --dtype auto on two hosts whose CPUs differ
            raise ValueError(f"decode pool holds {lease.dtype}, this worker computes {dtype}: give both --dtype")
        if not self.faults.fire("skip_page_write"):
            self.writer.write(self.engine.pool.kv, src, lease.target, lease.layout, dst)
        if self.faults.fire("corrupt_page_write"):
            self.writer.corrupt(lease.target, lease.layout, self.engine.pool.kv.dtype, dst)

    async def _commit(self, rid: int, commit: P.Commit, late_write: Callable[[], None] | None,
                      logprob: Logprob | None = None, cached: int = 0) -> None:
        p, _ = self.pending.get(rid, (None, None))
        t0 = time.perf_counter()
        try:
            ack = await self._send_commit(p.decode_url, commit)
            if late_write:  # reorder_commit: the bytes land only well after decode has answered the commit
                await asyncio.sleep(self.faults.delay)
                await asyncio.to_thread(late_write)
        except Exception as e:  # noqa: BLE001 - decode unreachable: the router will fence and fail it
            ack = P.Ack(ok=False, status=503, code="decode_unreachable", message=f"commit not delivered: {e}")
        if ack.ok:
            self.faults.crash("crash_after_commit")
        if self.engine.metrics:
            m, kv = self.engine.metrics, self.engine.pool.kv
            m.transfers.labels("ok" if ack.ok else ack.code or str(ack.status)).inc()
            m.transfer_seconds.observe(time.perf_counter() - t0)
            m.transfer_bytes.inc(len(commit.pages) * kv[0].numel() * kv.element_size())
        ack.first_logprob, ack.cached_tokens = logprob, cached
        acts = self._feed(lambda: self.core.acked(rid, commit.nonce, ack))
        # Deferred release: decode has answered (or is gone), so these pages may go. Pool tags change on the
        # engine thread only, and that call queues behind the engine's current step: the answer goes out first,
        # so a first token never waits for the next prefill batch.
        released = [self.engine.call(lambda: self.engine.release(rid)) for a in acts if isinstance(a, core.ReleaseOwn)]
        for a in acts:
            if isinstance(a, core.SendWriterDone):
                await self._writer_done(p, a.nonce)
        self._carry([a for a in acts if isinstance(a, core.Settle)])
        for fut in released:
            await asyncio.wrap_future(fut)

    async def _send_commit(self, url: str, commit: P.Commit) -> P.Ack:
        if self.faults.fire("delay_commit"):
            await asyncio.sleep(self.faults.delay)
        if self.faults.fire("drop_commit"):
            raise httpx.ConnectError("commit dropped (fault)")
        r = await self.client.post(url + "/kv/commit", content=P.encode(commit))
        if self.faults.fire("duplicate_commit"):
            r = await self.client.post(url + "/kv/commit", content=P.encode(commit))
        return P.decode(r.content, P.Ack)

    async def _writer_done(self, p: P.Prefill, nonce: int) -> None:
        try:
            done = P.WriterDone(rid=p.rid, nonce=nonce, cap=p.lease.cap)
            await self.client.post(p.decode_url + "/kv/writer_done", content=P.encode(done))
        except httpx.HTTPError:
            pass  # decode gone: nothing left to release there


def prefill_app(svc: PrefillService) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(EngineError)
    async def _err(_: Request, e: EngineError) -> Response:
        return ack_error(e)

    @app.exception_handler(msgspec.ValidationError)
    @app.exception_handler(msgspec.DecodeError)
    async def _bad(_: Request, e: Exception) -> Response:  # a signed peer sent a malformed message
        return ack_error(BadRequest(f"malformed message: {e}"))

    @app.post("/prefill")
    async def prefill(request: Request) -> Response:
        ack = await svc.prefill(P.decode(await request.body(), P.Prefill))
        return Response(P.encode(ack), status_code=200 if ack.ok else ack.status, media_type="application/json")

    @app.post("/kv/forget")
    async def forget(request: Request) -> JSONResponse:
        return JSONResponse(await svc.forget(P.decode(await request.body(), P.Forget)))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/pages")
    async def pages() -> JSONResponse:
        return JSONResponse(await pool_snapshot(svc.engine))

    @app.get("/health")
    async def health(request: Request, quick: bool = False) -> JSONResponse:
        if peer_of(request) is None:  # unsigned: liveness only, no pool details
            return JSONResponse({"status": "ok"})
        if svc.pending and svc.faults.fire("slow_health"):  # a probe stuck behind work in flight
            await asyncio.sleep(svc.faults.delay)
        return JSONResponse({"status": "ok", **await pool_health(svc.engine, quick), "machine": svc.engine.machine})

    return app
