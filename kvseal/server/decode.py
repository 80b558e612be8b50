"""The decode worker's side of the protocol: reserve → (pages land) → verify commit → decode → stream.

A lease reserves the prompt's pages (waiting, boundedly, while the pool has none to spare); the engine
grows them as the request decodes. Leases live here, keyed by request id. A commit is accepted only if: the
lease exists with that nonce (not revoked), it covers exactly the reserved prompt (coverage: token count and
page list), the pages are still RESERVED for this request with the leased generations (tags), and the
xxh3-128 checksum over the bytes now in this pool and the metadata matches (checksum). Only then do the pages
become OWNED and the request join the decode batch. Anything else quarantines the pages and fails the request.

An aborted lease keeps its pages QUARANTINED until the writer says it stopped (``WriterDone``) or is fenced.
A lease never committed within ``lease_ttl`` (its router died after reserving) is aborted the same way, and
its prefill is asked to forget it: once prefill confirms it is not writing, the pages are freed.

Every lease carries a capability (``P.Capability``) that decode MACs with a key that never leaves it; a
commit or WriterDone must present it. It is checked without state: a capability for another lease, pages
outside it, or a writer fenced since (its epoch moved on) are refused (403, 403, 410) before anything else.
State is bounded: an unknown lease id creates nothing, open leases per writer and per router are capped, and
so are token streams; a stream belongs to the router that opened it.

Tokens go back multiplexed: each router holds one stream (``/streams/{subscriber}``) and gets one line per
engine step with every event of its requests, so the per-token cost of the extra hop is paid once per step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvseal.engine.engine import Engine
from kvseal.engine.errors import (
    BadRequest,
    ContextLengthError,
    EngineError,
    KVIntegrityError,
    Overloaded,
    TooManyRequests,
)
from kvseal.engine.sampling import SamplingParams
from kvseal.engine.sequence import Event, Phase, Sequence
from kvseal.faults import Faults
from kvseal.kv.pool import PageRun, PageState
from kvseal.server.backend import StepBatcher, pool_health
from kvseal.server.guard import INSECURE, peer_of
from kvseal.transfer import protocol as P
from kvseal.transfer.auth import Forbidden, Peer

STREAMS_PER_ROUTER = 8  # a router holds one; a few more ride out restarts


def _cap_bytes(c: P.Capability) -> bytes:
    return msgspec.msgpack.encode([c.rid, c.nonce, c.decode_id, c.writer, c.epoch, c.pages, c.generations,
                                   c.expires])


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


@dataclass(eq=False)
class LeaseState:
    reserve: P.Reserve
    run: PageRun
    nonce: int
    queue: Outbox
    sink: object
    committed: bool = False
    aborted: bool = False
    checksum: str = ""
    router: str = ""  # the node that reserved it
    born: float = field(default_factory=time.monotonic)


class WriterFenced(EngineError):
    """A capability from before its writer was fenced: that writer is dead to this decode."""

    status = 410
    code = "writer_fenced"


class LeaseRevoked(Overloaded):
    """A commit for a lease that was aborted or fenced: refused, nothing read. A fault, not corruption."""

    code = "lease_revoked"


def ack_error(e: EngineError) -> Response:
    return Response(P.encode(P.Ack(ok=False, status=e.status, code=e.code, message=str(e))),
                    status_code=e.status, media_type="application/json")


class DecodeService:
    def __init__(self, engine: Engine, eos_ids: tuple[int, ...], target: str, decode_id: str,
                 faults: Faults | None = None, lease_ttl: float = 0.0, reserve_wait: float = 20.0,
                 max_waiting: int = 256, http: dict | None = None, max_leases: int = 2048, max_streams: int = 64,
                 exposure: object | None = None) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.eos = frozenset(eos_ids)
        self.target = target
        self.decode_id = decode_id
        self.leases: dict[int, LeaseState] = {}
        self.faults = faults or Faults()
        self.prot = engine.cfg.protections
        self.batcher = StepBatcher(engine)
        self.outboxes: dict[str, Outbox] = {}
        self.heartbeat = 1.0
        self.lease_ttl = lease_ttl  # 0: leases never expire
        self.reserve_wait = reserve_wait
        self.max_waiting = max_waiting
        self.waiting_reserves = 0
        self._expiry: asyncio.Task | None = None
        self.client = httpx.AsyncClient(timeout=5.0, **(http or {}))
        self.cap_key = secrets.token_bytes(32)  # MACs capabilities; never leaves this process
        self.epochs: dict[str, int] = {}  # writer → epoch; fencing bumps it
        self.max_leases = max_leases  # open leases per writer and per router
        self.max_streams = max_streams
        self.exposure = exposure  # Mooncake: only open leases' pages are registered (kvseal.transfer.mooncake)

    def outbox(self, subscriber: str, peer: Peer | None = INSECURE) -> Outbox:
        """The router's token stream: opened by the first reserve or stream request, then that router's only."""
        box = self.outboxes.get(subscriber)
        node = peer.node if peer is not None else ""
        if box is None:
            if len(self.outboxes) >= self.max_streams:
                raise TooManyRequests(f"decode serves at most {self.max_streams} router streams")
            if sum(b.owner == node for b in self.outboxes.values()) >= STREAMS_PER_ROUTER:
                raise TooManyRequests(f"router {node} has {STREAMS_PER_ROUTER} streams open")
            box = self.outboxes[subscriber] = Outbox(self._ended, self._router_gone)
            box.owner = node
        elif box.owner != node and peer is not INSECURE:
            raise Forbidden(f"stream {subscriber[:16]!r} belongs to another router")
        return box

    # -- capabilities -----------------------------------------------------------------------------------
    def _mac(self, c: P.Capability) -> str:
        body = _cap_bytes(c)
        return hmac.new(self.cap_key, body, hashlib.sha256).hexdigest()

    def grant(self, rid: int, nonce: int, writer: str, run: PageRun) -> P.Capability:
        c = P.Capability(rid=rid, nonce=nonce, decode_id=self.decode_id, writer=writer,
                         epoch=self.epochs.get(writer, 0), pages=list(run.pages), generations=list(run.generations),
                         expires=time.time() + self.lease_ttl if self.lease_ttl else 0.0)
        c.mac = self._mac(c)
        return c

    def check_cap(self, c: P.Capability | None, rid: int, nonce: int, pages: list[int] = ()) -> None:
        """403 unless ``c`` is a capability this decode granted for this very lease and covers ``pages``; 410 if
        its writer was fenced since. Stateless: a forged or foreign capability never reaches a lease."""
        if c is None or not hmac.compare_digest(self._mac(c), c.mac):
            raise Forbidden(f"request {rid}: no valid lease capability")
        if c.rid != rid or c.nonce != nonce or c.decode_id != self.decode_id:
            raise Forbidden(f"request {rid}: the capability is for another lease")
        if not set(pages) <= set(c.pages):
            raise Forbidden(f"request {rid}: pages outside the lease")
        if c.epoch != self.epochs.get(c.writer, 0):
            raise WriterFenced(f"request {rid}: writer {c.writer} was fenced")
        if c.expires and time.time() > c.expires:
            raise WriterFenced(f"request {rid}: the lease expired")

    def _router_gone(self, box: Outbox) -> None:
        asyncio.ensure_future(self._orphaned(box, box.gone_at))

    async def _orphaned(self, box: Outbox, gone_at: float) -> None:
        """A router's stream closed. If it has not come back within a grace period, the router is dead: stop
        the leases it held then (committed ones stop and free at once; the others keep their pages QUARANTINED
        until WriterDone or the TTL), and drop the events nobody will read."""
        await asyncio.sleep(self.heartbeat * 5)
        if box.gone_at != gone_at:  # it reconnected (and perhaps left again: that departure has its own check)
            return
        sub = next((k for k, v in self.outboxes.items() if v is box), None)
        for rid, st in list(self.leases.items()):
            if st.queue is box and st.born < gone_at:
                await self.abort(P.Abort(rid=rid, nonce=st.nonce))
        if box.gone_at == gone_at and sub is not None and not any(st.queue is box for st in self.leases.values()):
            del self.outboxes[sub]

    def _ended(self, ev: Event) -> None:
        """A request's last event: a verified, running lease is done. An aborted one stays until WriterDone."""
        st = self.leases.get(ev.rid)
        if st is not None and st.committed:
            self.leases.pop(ev.rid, None)

    # -- reserve ----------------------------------------------------------------------------------------
    async def reserve(self, r: P.Reserve, peer: Peer | None = INSECURE) -> P.Lease:
        self.faults.crash("crash_at_reserve")
        self._bound_leases(r.prefill_id, peer.node if peer else "")
        if self.faults.fire("delay_reserve"):
            await asyncio.sleep(self.faults.delay)
        n = len(r.prompt) + r.max_new
        if self.prot.admission and n > self.engine.cfg.admit_limit:
            raise ContextLengthError(len(r.prompt), r.max_new, self.engine.cfg.context_window,
                                     self.pool.cfg.capacity_tokens)
        run = await self._take_pages(r.rid, self.pool.cfg.pages_for(len(r.prompt)), self.engine.tenant_tag(r.tenant))
        if self.lease_ttl and self._expiry is None:
            self._expiry = asyncio.ensure_future(self._expire_loop())
        try:
            box = self.outbox(r.subscriber, peer)
        except EngineError:
            self.engine.call(lambda: self.pool.free(run))
            raise
        st = LeaseState(r, run, secrets.randbits(62), box, self.batcher.sink_for(box),
                        router=peer.node if peer else "")
        self.leases[r.rid] = st
        if self.exposure is not None:
            self.exposure.expose(r.rid, list(run.pages))
        return P.Lease(rid=r.rid, nonce=st.nonce, pages=list(run.pages), generations=list(run.generations),
                       n_prompt=len(r.prompt), decode_id=self.decode_id, target=self.target,
                       layout=list(self.pool.kv.shape), cap=self.grant(r.rid, st.nonce, r.prefill_id, run))

    def _bound_leases(self, writer: str, router: str) -> None:
        if len(self.leases) < self.max_leases:
            return
        if len(self.leases) >= 4 * self.max_leases:
            raise TooManyRequests(f"{len(self.leases)} leases open on this decode")
        if sum(st.reserve.prefill_id == writer for st in self.leases.values()) >= self.max_leases:
            raise TooManyRequests(f"{self.max_leases} leases open for writer {writer}")
        if sum(st.router == router for st in self.leases.values()) >= self.max_leases:
            raise TooManyRequests(f"{self.max_leases} leases open for router {router}")

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
                    raise Overloaded(f"decode KV pool full for {self.reserve_wait:g} s "
                                     f"({self.pool.num_free} pages free, {need} needed)")
                await asyncio.sleep(0.02)
            return run
        finally:
            self.waiting_reserves -= 1

    # -- commit -----------------------------------------------------------------------------------------
    async def commit(self, c: P.Commit) -> P.Ack:
        self.faults.crash("crash_at_commit")
        self.check_cap(c.cap, c.rid, c.nonce, c.pages)
        st = self.leases.get(c.rid)
        if st is None or st.nonce != c.nonce or st.aborted:
            why = "no lease" if st is None else ("wrong nonce" if st.nonce != c.nonce else "lease revoked")
            raise LeaseRevoked(f"commit for request {c.rid} refused: {why}; its pages were never readable")
        if st.committed:  # a duplicated commit: already verified and running, change nothing
            return P.Ack(ok=st.checksum == c.checksum, status=409, code="duplicate_commit",
                         message="commit already accepted", first_token=c.first_token)
        k = self.pool.cfg.pages_for(len(st.reserve.prompt))
        covered = (c.n_tokens == len(st.reserve.prompt) and c.pages == list(st.run.pages[:k])
                   and c.generations == list(st.run.generations[:k]))
        if self.prot.coverage and not covered:
            e = KVIntegrityError(f"commit for request {c.rid} covers {c.n_tokens} tokens / {len(c.pages)} pages, "
                                 f"lease reserved {len(st.reserve.prompt)} tokens / {k} pages")
            return await asyncio.wrap_future(self.engine.call(lambda: self._reject(st, e)))
        return await asyncio.wrap_future(self.engine.call(lambda: self._verify_and_admit(st, c)))

    def _verify_and_admit(self, st: LeaseState, c: P.Commit) -> P.Ack:
        """Engine thread: tags and checksum against the bytes in this pool, then OWNED and running. The pages
        stop taking writes first, so nothing lands between the check and the first read."""
        rid = c.rid
        self._conceal(rid)
        if st.aborted:  # aborted after the loop let this commit through: the abort owns the pages now
            return P.Ack(ok=False, status=503, code=LeaseRevoked.code, message=f"request {rid}: lease aborted")
        if self.prot.page_tags and not self.pool.run_ok(st.run, rid, PageState.RESERVED,
                                                         self.engine.tenant_tag(st.reserve.tenant)):
            return self._reject(st, KVIntegrityError(f"request {rid}: leased pages no longer reserved for it"))
        if self.prot.checksum:
            got = P.checksum(self.pool.kv, c.pages, c.n_tokens, rid, c.nonce, c.pages, c.generations, c.first_token)
            if got != c.checksum:
                if self.engine.metrics:
                    self.engine.metrics.integrity_failures.inc()
                return self._reject(st, KVIntegrityError(f"request {rid}: KV checksum mismatch"))
        self.pool.set_state(st.run, PageState.OWNED)
        st.committed = True
        st.checksum = c.checksum
        r = st.reserve
        params = SamplingParams(max_tokens=r.max_new, **r.sampling)
        seq = Sequence(rid, list(r.prompt), params, st.sink, eos_ids=self.eos,
                       tokens=list(r.prompt) + [c.first_token], num_cached=len(r.prompt), run=st.run,
                       phase=Phase.RUNNING, tenant=r.tenant)
        reason = seq.finish_reason(c.first_token)
        if reason:  # the first token already ended it: nothing to decode
            self.pool.free(st.run)
            st.sink(Event(rid, (), reason))
        else:
            self.engine._admit(seq)
        return P.Ack(ok=True, first_token=c.first_token)

    def _conceal(self, rid: int) -> None:
        if self.exposure is not None:
            self.exposure.conceal(rid)

    def _reject(self, st: LeaseState, e: EngineError) -> P.Ack:
        self._conceal(st.reserve.rid)
        self.engine.quarantined[st.reserve.rid] = self.pool.quarantine(st.run)
        st.aborted = True
        st.sink(Event(st.reserve.rid, (), "error", e))
        return P.Ack(ok=False, status=e.status, code=e.code, message=str(e))

    # -- endings ----------------------------------------------------------------------------------------
    async def abort(self, a: P.Abort) -> dict:
        st = self.leases.get(a.rid)
        if st is None:  # lease bookkeeping already gone (stream closed first): the engine may still run it
            return {"found": await asyncio.wrap_future(self.engine.abort(a.rid))}
        if st.committed:
            await asyncio.wrap_future(self.engine.abort(a.rid))
            self.leases.pop(a.rid, None)
        elif not st.aborted:  # a writer may still target the pages: quarantine until WriterDone
            st.aborted = True

            def q() -> None:
                self._conceal(a.rid)  # a late write now fails at the transport instead of landing
                if st.committed:  # its commit was verified just before: stop it like any running request
                    self.engine._abort(a.rid)
                    return
                if not self.prot.deferred_release:  # unsafe: straight back to the free list
                    self.pool.free(st.run)
                    return
                self.engine.quarantined[a.rid] = self.pool.quarantine(st.run)

            await asyncio.wrap_future(self.engine.call(q))
            st.queue.put_nowait(Event(a.rid, (), "abort"))  # loop thread: straight to the queue
        if a.writer_done and st.aborted and not st.committed:
            await self._writer_done(P.WriterDone(rid=a.rid, nonce=st.nonce))
        return {"found": True}

    async def fence(self, f: P.Fence) -> dict:
        """The writer is dead: its epoch moves on (whatever it sends from now on is 410), its leases are
        revoked and their pages freed."""
        self.epochs[f.prefill_id] = self.epochs.get(f.prefill_id, 0) + 1
        n = 0
        for rid, st in list(self.leases.items()):
            if st.reserve.prefill_id == f.prefill_id and not st.committed:
                await self.abort(P.Abort(rid=rid))
                await self._writer_done(P.WriterDone(rid=rid, nonce=st.nonce))
                n += 1
        return {"fenced": n}

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(self.lease_ttl / 4, 0.25))
            try:
                await self.expire_stale()
            except Exception as e:  # noqa: BLE001 - one bad lease must not end expiry for all the others
                print(f"kvseal decode: lease expiry failed: {e!r}", flush=True)

    async def expire_stale(self) -> None:
        """Leases older than the TTL and never committed: abort (pages QUARANTINED), then free them once the
        prefill they name confirms it is not writing into them. An unreachable prefill is asked again later."""
        now = time.monotonic()
        for rid, st in list(self.leases.items()):
            if st.committed or now - st.born < self.lease_ttl:
                continue
            if not st.aborted:
                await self.abort(P.Abort(rid=rid, nonce=st.nonce))
            try:
                r = await self.client.post(st.reserve.prefill_id + "/kv/forget",
                                           content=P.encode(P.Forget(rid=rid, nonce=st.nonce)))
                writing = r.json()["writing"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            if not writing and not st.committed:
                await self._writer_done(P.WriterDone(rid=rid, nonce=st.nonce))

    async def writer_done(self, w: P.WriterDone) -> dict:
        """The writer's own word (it must present the lease's capability)."""
        self.check_cap(w.cap, w.rid, w.nonce)
        return await self._writer_done(w)

    async def _writer_done(self, w: P.WriterDone) -> dict:
        st = self.leases.get(w.rid)
        if st is None or st.nonce != w.nonce:
            return {"released": False}
        if st.aborted:
            self.leases.pop(w.rid, None)
            freed = await asyncio.wrap_future(self.engine.call(lambda: self.engine.release_quarantine(w.rid)))
            return {"released": freed}
        return {"released": False}


def decode_app(svc: DecodeService) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(EngineError)
    async def _err(_: Request, e: EngineError) -> Response:
        return ack_error(e)

    @app.exception_handler(msgspec.ValidationError)
    @app.exception_handler(msgspec.DecodeError)
    async def _bad(_: Request, e: Exception) -> Response:  # a signed peer sent a malformed message
        return ack_error(BadRequest(f"malformed message: {e}"))

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

    @app.get("/health")
    async def health(request: Request, quick: bool = False) -> JSONResponse:
        if peer_of(request) is None:  # unsigned: liveness only, no pool details
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", **await pool_health(svc.engine, quick), "leases": len(svc.leases)})

    return app
