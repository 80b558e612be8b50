"""The decode worker's HTTP adapter: reserve → (pages land) → commit → decode → stream.

The lease rules (coverage, tags, checksum, capabilities and epochs, quarantine until the writer is known done,
expiry, fencing, a router gone) live in ``kvseal.protocol.decode.DecodeCore``, and its actions are carried out
by ``kvseal.protocol.decode_host.DecodeHost`` (the code the simulator runs too). This module parses messages,
feeds the host and implements its ports (``EnginePorts``): pool changes on the engine thread, replies, stream
events and Forget requests on the event loop. What is only this service's: waiting boundedly for pages (a pool
that has none to spare *now*), the per-router token streams and their bounds.

Tokens go back multiplexed: each router holds one stream (``/streams/{subscriber}``) and gets one line per
engine step with every event of its requests, so the per-token cost of the extra hop is paid once per step.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvseal.engine.engine import Engine
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Event, Phase, Sequence
from kvseal.errors import (
    BadRequest,
    EngineError,
    Overloaded,
    PoolFull,
    TooManyRequests,
)
from kvseal.faults import Faults
from kvseal.kv.pool import PageRun, PageState
from kvseal.protocol import decode as core
from kvseal.protocol.decode import DecodeCore, LeaseRevoked, WriterFenced  # noqa: F401 - re-exported
from kvseal.protocol.decode_host import ENGINE_SIDE, DecodeHost, Held
from kvseal.server import listen
from kvseal.server.backend import StepBatcher, pool_health
from kvseal.server.dashboard import pool_snapshot
from kvseal.server.guard import INSECURE, peer_of
from kvseal.transfer import messages as P
from kvseal.transfer.auth import Forbidden, Peer

STREAMS_PER_ROUTER = 8  # a router holds one; a few more ride out restarts


class Outbox:
    """One router's events, in order; handed out a step's worth at a time (loop thread only).

    When its router's stream closes, ``on_gone`` is told the moment it happened (``gone_at``); a stream that
    opens again clears it.
    """

    def __init__(self, on_final: Callable[[Event], None], on_gone: Callable[[Outbox], None]) -> None:
        self.q: asyncio.Queue[Event] = asyncio.Queue()
        self.on_final = on_final
        self.on_gone = on_gone
        self.readers = 0
        self.gone_at: float | None = None
        self.owner = ""  # the router node that opened it; no other may read it

    def put_nowait(self, ev: Event) -> None:  # StepBatcher delivers here
        if ev.finish_reason is not None:
            self.on_final(ev)
        self.q.put_nowait(ev)

    async def lines(self, heartbeat: float) -> AsyncIterator[bytes]:
        """NDJSON: one list of ``TokenEvent`` per wake-up; ``[]`` when idle, so the router can tell a hung
        worker from a quiet one."""
        self.readers += 1
        self.gone_at = None
        try:
            while True:
                try:
                    batch = [await asyncio.wait_for(self.q.get(), heartbeat)]
                except TimeoutError:
                    yield b"[]\n"
                    continue
                while not self.q.empty():
                    batch.append(self.q.get_nowait())
                yield P.encode([_token_event(ev) for ev in batch]) + b"\n"
        finally:
            self.readers -= 1
            if self.readers == 0:
                self.gone_at = time.monotonic()
                self.on_gone(self)


def _token_event(ev: Event) -> P.TokenEvent:
    err = ev.error.to_dict() | {"status": ev.error.status} if isinstance(ev.error, EngineError) else None
    return P.TokenEvent(ev.rid, list(ev.token_ids), ev.finish_reason, err, list(ev.logprobs) or None)


def ack_error(e: EngineError) -> Response:
    return Response(P.encode(P.Ack(ok=False, status=e.status, code=e.code, message=str(e))),
                    status_code=e.status, media_type="application/json")


@dataclass(eq=False)
class Route:
    """Where a lease's events go: its router's outbox, and the engine-side sink that batches them there."""

    queue: Outbox
    sink: Callable[[Event], None]


class EnginePorts:
    """``DecodePorts`` over the engine (engine-side actions run on its thread), Mooncake's exposure and the
    routers' outboxes (I/O side, the event loop)."""

    def __init__(self, svc: DecodeService) -> None:
        self.svc, self.engine = svc, svc.engine

    def conceal(self, rid: int) -> None:
        if self.svc.exposure is not None:
            self.svc.exposure.conceal(rid)  # a late write now fails at the transport instead of landing

    def quarantine(self, rid: int, run: PageRun) -> None:
        self.engine.hold_quarantined(rid, run)

    def free(self, run: PageRun) -> None:
        self.engine.free_pages(run)

    def release(self, rid: int) -> None:
        self.engine.release_quarantine(rid)

    def stop(self, rid: int) -> None:
        self.engine.stop_request(rid)

    def verify(self, h: Held, c: P.Commit, tags: bool, checksum: bool) -> tuple[bool, bool]:
        pool = self.engine.pool
        tags_ok = not tags or pool.run_ok(h.run, c.rid, PageState.RESERVED, self.engine.tenant_tag(h.reserve.tenant))
        if tags_ok:  # a staged pool (a GPU's): the lease's own pages come in from the landing area, then are hashed
            pool.take_in(h.run.pages)
        sum_ok = not checksum or P.checksum(pool.kv, c.pages, c.n_tokens, c.rid, c.nonce, c.pages, c.generations,
                                            c.first_token) == c.checksum
        if tags_ok and not sum_ok and self.engine.metrics:
            self.engine.metrics.integrity_failures.inc()
        return tags_ok, sum_ok

    def start(self, h: Held, first: int) -> None:
        r = h.reserve
        params = SamplingParams(max_tokens=r.max_new, **r.sampling)
        self.engine.start_decoding(Sequence(r.rid, list(r.prompt), params, h.ctx.sink, eos_ids=self.svc.eos,
                                            tokens=list(r.prompt) + [first], num_cached=len(r.prompt), run=h.run,
                                            phase=Phase.RUNNING, tenant=r.tenant))

    def give_back(self, run: PageRun) -> None:
        self.engine.call(lambda: self.engine.free_pages(run))

    def expose(self, rid: int, pages: tuple[int, ...]) -> None:
        if self.svc.exposure is not None:
            self.svc.exposure.expose(rid, list(pages))

    def end(self, h: Held, reason: str, error: EngineError | None) -> None:
        h.ctx.queue.put_nowait(Event(h.reserve.rid, (), reason, error))

    def ask_forget(self, a: core.AskForget) -> None:
        self.svc._spawn(self.svc._ask_forget(a))


class DecodeService:
    """The HTTP adapter around ``DecodeHost``: it parses messages, feeds the host and hops threads (engine-side
    actions on the engine thread, the rest on the event loop). Every protocol rule is in the core, every action
    is carried out by the host."""

    def __init__(self, engine: Engine, eos_ids: tuple[int, ...], target: str, decode_id: str,
                 faults: Faults | None = None, lease_ttl: float = 0.0, reserve_wait: float = 20.0,
                 max_waiting: int = 256, http: dict | None = None, max_leases: int = 2048, max_streams: int = 64,
                 exposure: object | None = None) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.eos = frozenset(eos_ids)
        self.target = target
        self.decode_id = decode_id
        self.faults = faults or Faults()
        self.prot = engine.cfg.protections
        self.core = DecodeCore(secrets.token_bytes(32), decode_id, lease_ttl, max_leases,
                               coverage=self.prot.coverage, deferred_release=self.prot.deferred_release,
                               page_tags=self.prot.page_tags, checksum=self.prot.checksum)
        self.host = DecodeHost(self.core, EnginePorts(self))
        self.lock = self.host.lock
        if engine.metrics:
            engine.metrics.add_source(self._metric_rows)
        self.batcher = StepBatcher(engine)
        self.outboxes: dict[str, Outbox] = {}
        self.heartbeat = 1.0
        self.reserve_wait = reserve_wait
        self.max_waiting = max_waiting
        self.waiting_reserves = 0
        self._expiry: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.client = httpx.AsyncClient(timeout=5.0, limits=listen.client_limits(), **(http or {}))
        self.max_streams = max_streams
        self.exposure = exposure  # Mooncake: only open leases' pages are registered (kvseal.transfer.mooncake)

    @property
    def held(self) -> dict[int, Held]:
        return self.host.held

    @property
    def leases(self) -> dict:
        return self.core.leases

    @property
    def lease_ttl(self) -> float:
        return self.core.lease_ttl

    @lease_ttl.setter
    def lease_ttl(self, ttl: float) -> None:
        self.core.lease_ttl = ttl

    def outbox(self, subscriber: str, peer: Peer | None = INSECURE) -> Outbox:
        """The router's token stream: opened by the first reserve or stream request, then that router's only."""
        box = self.outboxes.get(subscriber)
        node = peer.node if peer is not None else ""
        if box is None:
            if len(self.outboxes) >= self.max_streams:
                raise TooManyRequests(f"decode serves at most {self.max_streams} router streams")
            if sum(b.owner == node for b in self.outboxes.values()) >= STREAMS_PER_ROUTER:
                raise TooManyRequests(f"router {node} has {STREAMS_PER_ROUTER} streams open")
            box = self.outboxes[subscriber] = Outbox(lambda ev: None, self._router_gone)
            box.owner = node
        elif box.owner != node and peer is not INSECURE:
            raise Forbidden(f"stream {subscriber[:16]!r} belongs to another router")
        return box

    # -- carrying out the host's actions across the two threads ----------------------------------------
    async def _carry(self, acts: list, commit: P.Commit | None = None) -> list:
        """Engine-side actions in one engine-thread call (in order with every other), then the rest here.
        Returns the replies."""
        records = self.host.records(acts)
        if any(isinstance(a, ENGINE_SIDE) for a in acts):
            acts = await asyncio.wrap_future(self.engine.call(lambda: self.host.on_engine(acts, commit)))
        return self.host.on_loop(acts, records)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- capabilities (for tests and tools; the core checks them) ---------------------------------------------
    def check_cap(self, c: P.Capability | None, rid: int, nonce: int, pages: list[int] = ()) -> None:
        self.core.check_cap(c, rid, nonce, list(pages), time.monotonic())

    def _router_gone(self, box: Outbox) -> None:
        asyncio.ensure_future(self._orphaned(box, box.gone_at))

    async def _orphaned(self, box: Outbox, gone_at: float) -> None:
        """A router's stream closed. If it has not come back within a grace period, the router is dead: the
        core stops what it reserved before then; the events nobody will read are dropped."""
        await asyncio.sleep(self.heartbeat * 5)
        if box.gone_at != gone_at:  # it reconnected (and perhaps left again: that departure has its own check)
            return
        sub = next((k for k, v in self.outboxes.items() if v is box), None)
        if sub is None:
            return
        await self._carry(self.host.router_gone(sub, gone_at))
        if box.gone_at == gone_at and not self.host.holds(sub):
            del self.outboxes[sub]

    def _sink(self, box: Outbox) -> Callable[[Event], None]:
        """Engine thread: a running request's events; its last one closes the lease."""
        batched = self.batcher.sink_for(box)

        def sink(ev: Event) -> None:
            if ev.finish_reason is not None:
                self.host.finished(ev.rid)
            batched(ev)
        return sink

    # -- reserve ----------------------------------------------------------------------------------------
    async def reserve(self, r: P.Reserve, peer: Peer | None = INSECURE) -> P.Lease:
        self.faults.crash("crash_at_reserve")
        router = peer.node if peer else ""
        cfg = self.engine.cfg
        self.host.begin_reserve(r, router, cfg.admit_limit, self.prot.admission, self.pool.cfg.capacity_tokens,
                                cfg.context_window)
        try:
            if self.faults.fire("delay_reserve"):
                await asyncio.sleep(self.faults.delay)
            box = self.outbox(r.subscriber, peer)
            run = await self._take_pages(r.rid, self.pool.cfg.pages_for(len(r.prompt)),
                                         self.engine.tenant_tag(r.tenant))
        except BaseException:
            self.host.abandon_reserve(r.rid)
            raise
        if self.lease_ttl and self._expiry is None:
            self._expiry = asyncio.ensure_future(self._expire_loop())
        cap, acts = self.host.reserved(r, router, run, Route(box, self._sink(box)), secrets.randbits(62),
                                       time.monotonic())
        self.host.on_loop(acts)
        return P.Lease(rid=r.rid, nonce=cap.nonce, pages=list(run.pages), generations=list(run.generations),
                       n_prompt=len(r.prompt), decode_id=self.decode_id, target=self.target,
                       layout=list(self.pool.kv.shape), cap=cap, dtype=str(self.pool.kv.dtype).removeprefix("torch."))

    async def _take_pages(self, rid: int, need: int, tenant: int) -> PageRun:
        """The prompt's pages, RESERVED for the lease (decode grows them as it generates). A pool that has
        them not *now* is waited on, up to ``reserve_wait`` seconds, by at most ``max_waiting`` requests; past
        either bound the answer is 503 and the router tells the client to retry."""
        def take() -> PageRun | None:
            spare = len(self.engine.running)  # a page of growth for every running request, as the engine admits
            ok = self.pool.can_allocate(need + spare)
            return self.pool.allocate(rid, need, PageState.RESERVED, tenant) if ok else None

        if self.waiting_reserves >= self.max_waiting:
            raise Overloaded(f"decode reserve queue full ({self.max_waiting} waiting)")
        self.waiting_reserves += 1
        try:
            deadline = time.monotonic() + self.reserve_wait
            while (run := await asyncio.wrap_future(self.engine.call(take))) is None:
                if time.monotonic() >= deadline:
                    raise PoolFull(f"decode KV pool full for {self.reserve_wait:g} s "
                                   f"({self.pool.num_free} pages free, {need} needed)")
                await asyncio.sleep(0.02)
            return run
        finally:
            self.waiting_reserves -= 1

    def _metric_rows(self) -> list[tuple]:
        """Leases by state and the transfers refused by reason, for /metrics."""
        with self.lock:
            states = collections.Counter(lease.state.name.lower() for lease in self.core.leases.values())
            refused = dict(self.core.refused)
        rows = [("kvseal_leases", "gauge", "Open leases by state", {"state": s}, states.get(s, 0))
                for s in ("reserved", "verifying", "running", "quarantined")]
        return rows + [("kvseal_transfer_refusals", "counter", "Transfers decode refused, by reason",
                        {"reason": r}, refused.get(r, 0)) for r in ("coverage", "tag", "checksum", "fence", "timeout")]

    # -- commit -----------------------------------------------------------------------------------------
    async def commit(self, c: P.Commit) -> P.Ack:
        self.faults.crash("crash_at_commit")
        return (await self._carry(self.host.commit(c, time.monotonic()), c))[0]

    # -- endings ----------------------------------------------------------------------------------------
    async def abort(self, a: P.Abort) -> dict:
        found = a.rid in self.core.leases
        acts = self.host.abort(a)
        if not found:  # lease bookkeeping already gone (stream closed first): the engine may still run it
            return {"found": await asyncio.wrap_future(self.engine.abort(a.rid))}
        await self._carry(acts)
        return {"found": True}

    async def fence(self, f: P.Fence) -> dict:
        """The writer is dead: the core moves its epoch on and revokes its open leases."""
        acts = self.host.fence(f.prefill_id)
        await self._carry(acts)
        return {"fenced": sum(isinstance(a, (core.Release, core.Free)) for a in acts),
                "epoch": self.core.writer_epoch(f.prefill_id)}

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.lease_ttl / 4, 0.25))
            try:
                await self.expire_stale()
            except Exception as e:  # noqa: BLE001 - one bad lease must not end expiry for all the others
                print(f"kvseal decode: lease expiry failed: {e!r}", flush=True)

    async def expire_stale(self) -> None:
        acts = self.host.expire(time.monotonic())
        await self._carry([a for a in acts if not isinstance(a, core.AskForget)])
        for a in acts:  # one pass, in order: a forget answered now frees now
            if isinstance(a, core.AskForget):
                await self._ask_forget(a)

    async def _ask_forget(self, a: core.AskForget) -> None:
        """Ask the writer to Forget the lease; an unreachable one is asked again at the next expiry pass."""
        try:
            r = await self.client.post(a.writer + "/kv/forget", content=P.encode(P.Forget(rid=a.rid, nonce=a.nonce)))
            writing = r.json()["writing"]
        except (httpx.HTTPError, ValueError, KeyError):
            return
        await self._carry(self.host.forget_answer(a.rid, a.nonce, writing))

    async def writer_done(self, w: P.WriterDone) -> dict:
        """The writer's own word (it must present the lease's capability)."""
        acts = self.host.writer_done(w, time.monotonic())
        await self._carry(acts)
        return {"released": bool(acts)}


def decode_app(svc: DecodeService) -> FastAPI:
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

    @app.post("/kv/reserve")
    async def reserve(request: Request) -> Response:
        lease = await svc.reserve(P.decode(await request.body(), P.Reserve), peer_of(request))
        return Response(P.encode(lease), media_type="application/json")

    @app.post("/kv/commit")
    async def commit(request: Request) -> Response:
        ack = await svc.commit(P.decode(await request.body(), P.Commit))
        return Response(P.encode(ack), status_code=200 if ack.ok else ack.status, media_type="application/json")

    @app.post("/kv/abort")
    async def abort(request: Request) -> JSONResponse:
        return JSONResponse(await svc.abort(P.decode(await request.body(), P.Abort)))

    @app.post("/kv/writer_done")
    async def writer_done(request: Request) -> JSONResponse:
        return JSONResponse(await svc.writer_done(P.decode(await request.body(), P.WriterDone)))

    @app.post("/kv/fence")
    async def fence(request: Request) -> JSONResponse:
        return JSONResponse(await svc.fence(P.decode(await request.body(), P.Fence)))

    @app.get("/streams/{subscriber}")
    async def streams(subscriber: str, request: Request) -> StreamingResponse:
        box = svc.outbox(subscriber, peer_of(request))
        return StreamingResponse(box.lines(svc.heartbeat), media_type="application/x-ndjson")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.engine.metrics.page(), media_type="text/plain; version=0.0.4")

    @app.get("/pages")
    async def pages() -> JSONResponse:
        snap = await pool_snapshot(svc.engine)
        with svc.lock:
            leases = collections.Counter(lease.state.name.lower() for lease in svc.core.leases.values())
            refused, recent = dict(svc.core.refused), list(svc.core.recent)
        return JSONResponse({**snap, "leases": dict(leases), "refused": refused,
                             "recent": [{"reason": r, "rid": str(rid)} for r, rid in reversed(recent)]})

    @app.get("/health")
    async def health(request: Request, quick: bool = False) -> JSONResponse:
        if peer_of(request) is None:  # unsigned: liveness only, no pool details
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", **await pool_health(svc.engine, quick), "leases": len(svc.leases),
                             "machine": svc.engine.machine})

    return app
