"""The prefill worker's HTTP adapter: admit → prefill → write the leased pages → commit → release.

The rules (admission before any allocation, no placeholder path, a forgotten lease never written, deferred
release, WriterDone after a refused commit) live in ``kvseal.protocol.prefill.PrefillCore``, and its actions are
carried out by ``kvseal.protocol.prefill_host.PrefillHost`` (the code the simulator runs too); this module feeds the
host from the event loop and the engine thread and implements its ports (``EnginePorts``). The engine thread runs
the prefill, samples the first token and writes the KV into the decode pool (``handoff``); the commit travels on
the event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable

import httpx
import msgspec
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvseal.engine.engine import Engine
from kvseal.engine.sampling import Logprob, SamplingParams
from kvseal.engine.sequence import Event, Sequence
from kvseal.errors import BadRequest, EngineError
from kvseal.faults import Faults
from kvseal.protocol import prefill as core
from kvseal.protocol.prefill import LeaseExpired, PrefillCore  # noqa: F401 - re-exported
from kvseal.protocol.prefill_host import PrefillHost
from kvseal.server import listen
from kvseal.server.backend import pool_health
from kvseal.server.dashboard import pool_snapshot
from kvseal.server.decode import ack_error
from kvseal.server.guard import peer_of
from kvseal.transfer import messages as P
from kvseal.transfer.staging import stage_out


class EnginePorts:
    """``PrefillPorts`` over the engine (engine side: call on its thread) and httpx (I/O side: the loop)."""

    def __init__(self, svc: PrefillService) -> None:
        self.svc, self.engine = svc, svc.engine

    def stop(self, rid: int, nonce: int) -> None:
        self.engine.stop_request(rid)

    def release(self, rid: int, nonce: int) -> None:
        self.engine.release(rid)

    def send_commit(self, rid: int, nonce: int) -> None:
        commit = self.svc.commits.pop(rid)
        self.svc.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.svc._commit(rid, *commit)))

    def writer_done(self, rid: int, nonce: int) -> None:
        # look the request up now: the Settle that follows in the same pass ends it and drops its entry
        p, _ = self.svc.pending.get(rid, (None, None))
        if p is not None and p.lease.nonce == nonce:
            self.svc._spawn(self.svc._writer_done(p))

    def settle(self, rid: int, nonce: int, result: object) -> None:
        entry = self.svc.pending.get(rid)
        if entry and entry[0].lease.nonce == nonce and not entry[1].done():
            if isinstance(result, BaseException):
                entry[1].set_exception(result)
            else:
                entry[1].set_result(result)


class PrefillService:
    """The HTTP adapter around ``PrefillHost``: it parses messages, runs the engine's steps (compute, write the
    pages, checksum, send the commit) and hops threads; every rule is the core's, every action the host's."""

    def __init__(self, engine: Engine, writer: object, prefill_id: str, faults: Faults | None = None,
                 http: dict | None = None) -> None:
        self.engine = engine
        self.writer = writer
        self.prefill_id = prefill_id
        # drawn at start: a router that sees a new one knows the process that held its leases is gone (fenced)
        self.incarnation = secrets.token_hex(8)
        self.faults = faults or Faults()
        prot = engine.cfg.protections
        self.core = PrefillCore(prot.admission, prot.deferred_release)
        self.host = PrefillHost(self.core, EnginePorts(self))
        self.lock = self.host.lock
        self.client = httpx.AsyncClient(timeout=30, limits=listen.client_limits(), **(http or {}))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: dict[int, tuple[P.Prefill, asyncio.Future]] = {}
        self.commits: dict[int, tuple] = {}  # rid → the commit prepared on the engine thread, for send_commit
        self._tasks: set[asyncio.Task] = set()
        engine.handoff = self.handoff

    @property
    def forgotten(self) -> dict[int, None]:
        return self.core.forgotten

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_loop(self, acts: list, nonce: int) -> None:
        """From the engine thread: the I/O side of ``acts`` on the event loop."""
        if acts:
            self.loop.call_soon_threadsafe(self.host.on_loop, acts, nonce)

    async def prefill(self, p: P.Prefill) -> P.Ack:
        self.loop = asyncio.get_running_loop()
        cfg = self.engine.cfg
        n, nonce = len(p.prompt), p.lease.nonce
        bug = n + p.max_new > cfg.admit_limit and self.faults.fire("legacy_placeholder")
        acts = self.host.feed(lambda: self.core.prefill(p.rid, nonce, n, p.max_new, cfg.admit_limit,
                                                        cfg.context_window, self.engine.pool.cfg.capacity_tokens, bug))
        if any(isinstance(a, core.Admit) and a.placeholder for a in acts):
            p.prompt = p.prompt[:1]  # the 2026 bug: a 1-token placeholder, committed as if complete
        try:
            params = SamplingParams(**{**p.sampling, "max_tokens": 1})  # prefill samples the first token only
            seq = Sequence(p.rid, list(p.prompt), params, self._sink(p.rid, nonce), lease=p.lease, group=p.group,
                           tenant=p.tenant, cache_salt=p.cache_salt)
        except (TypeError, ValueError, OverflowError) as e:  # the door checks them: a peer's bug, settled here
            err = BadRequest(f"malformed sampling parameters: {e}")
            self.host.on_loop(self.host.feed(lambda: self.core.failed(p.rid, nonce, err)), nonce)
            raise err from None
        done: asyncio.Future = self.loop.create_future()
        self.pending[p.rid] = (p, done)

        def admit() -> None:  # engine thread: a lease forgotten meanwhile never reaches the engine
            if self.host.feed(lambda: self.core.computing(p.rid, nonce)):
                self.engine.admit(seq)  # the engine's own admission: raises before any allocation

        try:
            if self.faults.fire("delay_prefill_admit"):
                await asyncio.sleep(self.faults.delay)
            try:
                await asyncio.wrap_future(self.engine.call(admit))
            except EngineError as e:  # refused by the engine: the router gets this error, nothing else to settle
                self.host.feed(lambda e=e: self.core.failed(p.rid, nonce, e))
                raise
            return await done
        finally:
            self.pending.pop(p.rid, None)

    async def forget(self, f: P.Forget) -> dict:
        """Stop, or never start, writing into this lease: decode expired it, or the router gave up on it.
        ``{"writing": false}`` promises no byte will land."""
        writing, acts = self.host.feed(lambda: self.core.forget(f.rid, f.nonce))
        engine, loop = self.host.split(acts)
        if engine:
            self.engine.call(lambda: self.host.on_engine(engine, f.nonce))
        self.host.on_loop(loop, f.nonce)
        return {"writing": writing}

    def _sink(self, rid: int, nonce: int):
        def sink(ev: Event) -> None:  # engine thread
            if ev.error is not None and self.loop:
                err = ev.error if isinstance(ev.error, EngineError) else EngineError(str(ev.error))
                acts = self.host.feed(lambda: self.core.failed(rid, nonce, err))
                self.host.on_engine(acts, nonce)
                self._on_loop(acts, nonce)
        return sink

    def handoff(self, seq: Sequence) -> None:
        """Engine thread, right after prefill: write the prompt's pages into the lease, then commit."""
        lease: P.Lease = seq.lease
        rid, nonce = seq.rid, lease.nonce
        acts = self.host.feed(lambda: self.core.prefilled(rid, nonce))
        if not any(isinstance(a, core.Write) for a in acts):  # withdrawn meanwhile: nothing written
            self.host.on_engine(acts, nonce)
            return
        n = len(seq.prompt)
        k = self.engine.pool.cfg.pages_for(n)
        src, dst = list(seq.run.pages[:k]), lease.pages[:k]
        self.faults.crash("crash_before_write")
        late = self.faults.fire("reorder_commit")
        try:
            data, at = stage_out(self.engine.pool.kv, src)  # the pool itself, or a GPU pool's pages copied to the host
            if not late:
                self._write(data, at, lease, dst)
            self.faults.crash("crash_after_write")
        except Exception as e:  # noqa: BLE001 - the transfer failed: nothing was committed
            acts = self.host.feed(lambda e=e: self.core.written(rid, nonce, EngineError(f"KV transfer failed: {e}")))
            engine, loop = self.host.split(acts)
            self.host.on_engine(engine, nonce)
            self._on_loop(loop, nonce)
            return
        first = seq.tokens[-1]
        digest = P.checksum(data, at, n, rid, nonce, dst, lease.generations[:k], first)  # the bytes that were sent
        if self.faults.fire("corrupt_commit"):
            first = (first + 1) % self.engine.model.cfg.vocab_size  # the message changed after it was hashed
        commit = P.Commit(rid=rid, nonce=nonce, n_tokens=n, first_token=first, pages=dst,
                          generations=lease.generations[:k], checksum=digest, cap=lease.cap)
        late_write = (lambda: self._write(data, at, lease, dst)) if late else None
        self.commits[rid] = (commit, late_write, seq.logprob, seq.cached_tokens, seq.prompt_lps)
        acts = self.host.feed(lambda: self.core.written(rid, nonce))
        engine, loop = self.host.split(acts)
        self.host.on_engine(engine, nonce)  # unsafe mode only: free before decode has even seen the commit
        if not loop:
            self.commits.pop(rid, None)
        self.host.on_loop(loop, nonce)  # SendCommit: hands the commit to the event loop

    def _write(self, data: torch.Tensor, src: list[int], lease: P.Lease, dst: list[int]) -> None:
        """One-sided write of pages ``src`` of ``data`` (this worker's pool, or its staged copy) into the leased
        decode pages ``dst``."""
        if self.faults.fire("delay_page_write"):
            time.sleep(self.faults.delay)
        mine = list(self.engine.pool.kv.shape)
        if lease.layout[1:] != mine[1:]:  # page count may differ; a page's shape may not
            raise ValueError(f"decode pool layout {lease.layout} does not match this worker's {mine}")
        dtype = str(self.engine.pool.kv.dtype).removeprefix("torch.")
        if lease.dtype and lease.dtype != dtype:  # e.g. --dtype auto on two hosts whose CPUs differ
            raise ValueError(f"decode pool holds {lease.dtype}, this worker computes {dtype}: give both --dtype")
        if not self.faults.fire("skip_page_write"):
            self.writer.write(data, src, lease.target, lease.layout, dst, transient=data is not self.engine.pool.kv)
        if self.faults.fire("corrupt_page_write"):
            self.writer.corrupt(lease.target, lease.layout, self.engine.pool.kv.dtype, dst)

    async def _commit(self, rid: int, commit: P.Commit, late_write: Callable[[], None] | None,
                      logprob: Logprob | None = None, cached: int = 0, prompt_lps: list[Logprob] = ()) -> None:
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
        ack.prompt_logprobs = list(prompt_lps) or None
        acts = self.host.feed(lambda: self.core.acked(rid, commit.nonce, ack))
        # Deferred release: decode has answered (or is gone), so these pages may go. Pool tags change on the
        # engine thread only, and that call queues behind the engine's current step: the answer goes out first,
        # so a first token never waits for the next prefill batch.
        engine, loop = self.host.split(acts)
        released = self.engine.call(lambda: self.host.on_engine(engine, commit.nonce)) if engine else None
        self.host.on_loop(loop, commit.nonce)
        if released is not None:
            await asyncio.wrap_future(released)

    async def _send_commit(self, url: str, commit: P.Commit) -> P.Ack:
        if self.faults.fire("delay_commit"):
            await asyncio.sleep(self.faults.delay)
        if self.faults.fire("drop_commit"):
            raise httpx.ConnectError("commit dropped (fault)")
        r = await self.client.post(url + "/kv/commit", content=P.encode(commit))
        if self.faults.fire("duplicate_commit"):
            r = await self.client.post(url + "/kv/commit", content=P.encode(commit))
        return P.decode(r.content, P.Ack)

    async def _writer_done(self, p: P.Prefill) -> None:
        try:
            done = P.WriterDone(rid=p.rid, nonce=p.lease.nonce, cap=p.lease.cap)
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

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> Response:  # logged where it is contained (guard.py)
        return ack_error(EngineError(f"internal error ({type(e).__name__})"))

    @app.post("/prefill")
    async def prefill(request: Request) -> Response:
        ack = await svc.prefill(P.decode(await request.body(), P.Prefill))
        return Response(P.encode(ack), status_code=200 if ack.ok else ack.status, media_type="application/json")

    @app.post("/kv/forget")
    async def forget(request: Request) -> JSONResponse:
        return JSONResponse(await svc.forget(P.decode(await request.body(), P.Forget)))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.engine.metrics.page(), media_type="text/plain; version=0.0.4")

    @app.get("/pages")
    async def pages() -> JSONResponse:
        return JSONResponse(await pool_snapshot(svc.engine))

    @app.get("/health")
    async def health(request: Request, quick: bool = False) -> JSONResponse:
        if peer_of(request) is None:  # unsigned: liveness only, no pool details
            return JSONResponse({"status": "ok"})
        if svc.pending and svc.faults.fire("slow_health"):  # a probe stuck behind work in flight
            await asyncio.sleep(svc.faults.delay)
        return JSONResponse({"status": "ok", **await pool_health(svc.engine, quick), "machine": svc.engine.machine,
                             "incarnation": svc.incarnation})

    return app
