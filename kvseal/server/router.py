"""The router: the OpenAI front door over remote prefill and decode workers.

Per request: pick the least-loaded healthy decode and prefill (free pages, then queue length) → decode
reserves and returns a lease → prefill admits, computes, writes, commits → the first token comes back only
after decode verified the commit → the rest streams from decode, over one multiplexed stream per decode
worker (``TokenMux``: one line per engine step). Admission against min(context, prefill pool, decode pool)
happened in the API layer before any of this.

Status follows truth: an error from any worker is returned with that worker's original status and code.
A client that leaves mid-protocol never cuts a step in half: the reservation and the transfer each run to
their end (or fail), then the router hands back what they left on decode (``_step``). A worker that stops
answering fails its requests with 503 and is skipped until healthy again; a dead prefill is fenced on every
decode.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from kvseal.config import Protections
from kvseal.engine.errors import EngineError, Overloaded, TooManyRequests
from kvseal.engine.sequence import Event
from kvseal.faults import Faults
from kvseal.server.backend import GenRequest
from kvseal.server.mux import TokenMux
from kvseal.transfer import protocol as P


@dataclass
class Worker:
    url: str
    role: str
    healthy: bool = False
    info: dict = field(default_factory=dict)
    inflight: int = 0
    misses: int = 0  # consecutive failed probes
    last_ok: float = 0.0  # monotonic time of its last answer: evidence of life that a slow probe cannot erase
    mux: TokenMux | None = None  # decode workers: this router's token stream from it

    @property
    def score(self) -> tuple:
        return (-self.info.get("free_pages", 0) + self.inflight * 64, self.info.get("waiting", 0))


def remote_error(status: int, body: bytes) -> EngineError:
    """Rebuild a worker's error with its original status and code."""
    try:
        a = msgspec.json.decode(body)
    except msgspec.DecodeError:
        a = {}
    return worker_error(status, a if isinstance(a, dict) else {})


def worker_error(status: int, a: dict) -> EngineError:
    e = EngineError(a.get("message") or f"worker answered HTTP {status}")
    e.status = status
    e.code = a.get("code") or e.code
    e.type = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return e


class Unanswered(Overloaded):
    """The worker never answered (refused, reset, or still busy at the timeout): what it did is unknown."""


def _down(w: Worker) -> None:
    w.healthy = False


class DisaggBackend:
    FENCE_AFTER = 3

    def __init__(self, prefill: list[str], decode: list[str], model_name: str, timeout: float = 30.0,
                 protections: Protections | None = None, faults: Faults | None = None, probe_timeout: float = 5.0,
                 max_inflight: int = 256, queue_timeout: float = 120.0, http: dict | None = None) -> None:
        self.prefills = [Worker(u.rstrip("/"), "prefill") for u in prefill]
        self.decodes = [Worker(u.rstrip("/"), "decode") for u in decode]
        self.model_name = model_name
        self.timeout = timeout
        self.prot = protections or Protections()
        self.faults = faults or Faults()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0),
                                        limits=httpx.Limits(max_connections=512), **(http or {}))
        self.context_window = 0
        self.pool_tokens = 0
        self._tasks: set[asyncio.Task] = set()
        self.probe_timeout = probe_timeout
        self.busy_grace = max(3 * probe_timeout, 10.0)
        self.max_inflight = max_inflight  # per worker: past it, new requests are shed with 429 at once
        self.queue_timeout = max(queue_timeout, timeout)  # a transfer's wait for prefill, queue included
        self.subscriber = secrets.token_hex(8)  # names this router's token stream on every decode
        for d in self.decodes:
            d.mux = TokenMux(self.client, d.url, self.subscriber, timeout, on_dead=lambda d=d: _down(d))

    # -- health -----------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        await asyncio.gather(*[self._probe(w) for w in self.prefills + self.decodes])
        live = [w for w in self.prefills + self.decodes if w.healthy and w.info]
        if live:
            self.context_window = min(w.info["context_window"] for w in live)
            self.pool_tokens = min(w.info["pool_tokens"] for w in live)

    async def _probe(self, w: Worker) -> None:
        """A busy worker is not a dead one. A refused connection is death; a probe that times out while the
        worker answered real work within ``busy_grace`` seconds is a busy worker, left in service. Otherwise
        skip it at its first miss, and fence a prefill only after FENCE_AFTER misses in a row, since fencing
        revokes every lease it is writing."""
        try:
            r = await self.client.get(w.url + "/health", params={"quick": "true"}, timeout=self.probe_timeout)
            w.info, w.healthy, w.misses = r.json(), r.status_code == 200, 0
            w.last_ok = time.monotonic()
        except (httpx.HTTPError, ValueError) as e:
            if isinstance(e, httpx.TimeoutException) and time.monotonic() - w.last_ok < self.busy_grace:
                return
            w.healthy = False
            w.misses += 1
            if w.role == "prefill" and w.misses == self.FENCE_AFTER:
                await self._fence(w)

    async def _fence(self, dead: Worker) -> None:
        for d in self.decodes:
            if d.healthy:
                try:
                    await self.client.post(d.url + "/kv/fence", content=P.encode(P.Fence(prefill_id=dead.url)))
                except httpx.HTTPError:
                    pass

    async def health_loop(self, period: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(period)

    async def health(self) -> dict:
        ok = any(w.healthy for w in self.prefills) and any(w.healthy for w in self.decodes)
        return {"status": "ok" if ok else "degraded",
                "pools": [w.info | {"url": w.url} for w in self.prefills + self.decodes if w.healthy],
                "workers": {w.url: w.healthy for w in self.prefills + self.decodes}}

    def check_capacity(self) -> None:
        """Shed before any work (parsing, tokenizing) when no worker pair has room: under overload the
        refusals must cost the host next to nothing, or they eat the cores that serve the admitted work."""
        self._pick(self.decodes)
        self._pick(self.prefills)

    def _pick(self, ws: list[Worker]) -> Worker:
        live = [w for w in ws if w.healthy]
        if not live:
            raise Overloaded(f"no healthy {ws[0].role} worker")
        room = [w for w in live if w.inflight < self.max_inflight]
        if not room:
            raise TooManyRequests(f"every {ws[0].role} worker has {self.max_inflight} requests in flight")
        return min(room, key=lambda w: w.score)

    # -- one request ------------------------------------------------------------------------------------
    async def _post(self, w: Worker, path: str, msg: object, timeout: float | None = None) -> bytes:
        try:
            kw = {"timeout": httpx.Timeout(timeout, connect=2.0)} if timeout else {}
            r = await self.client.post(w.url + path, content=P.encode(msg), **kw)
        except httpx.HTTPError as e:
            if not isinstance(e, httpx.ReadTimeout):  # a read timeout is a busy worker; the probe decides
                w.healthy = False
            raise Unanswered(f"{w.role} worker {w.url} unreachable: {type(e).__name__}") from None
        w.last_ok = time.monotonic()
        if r.status_code != 200:
            raise remote_error(r.status_code, r.content)
        return r.content

    async def generate(self, req: GenRequest) -> AsyncIterator[Event]:
        d, p = self._pick(self.decodes), self._pick(self.prefills)
        p.inflight += 1
        sampling = req.params.to_wire()
        d.inflight += 1
        committed = finished = False
        events = d.mux.register(req.rid)  # before the lease exists: no event of this request goes unclaimed
        try:
            reserve = P.Reserve(rid=req.rid, tenant=req.tenant, prompt=req.prompt, max_new=req.params.max_tokens,
                                sampling=sampling, prefill_id=p.url, subscriber=self.subscriber)
            # a lease granted after the client left is handed back: nothing was written into it
            lease = await self._step(self._reserve(d, reserve),
                                     undo=lambda lease: self._abort(d, req.rid, lease.nonce, writer_done=True))
            self.faults.crash("crash_after_reserve")
            msg = P.Prefill(rid=req.rid, tenant=req.tenant, prompt=req.prompt, max_new=req.params.max_tokens,
                            sampling=sampling, lease=lease, decode_url=d.url, group=req.group)
            # a transfer that committed after the client left started decode for nobody: stop it
            ack = await self._step(self._transfer(p, d, msg),
                                   undo=lambda _ack: self._abort(d, req.rid, 0, writer_done=True),
                                   unguarded=lambda: self._abort(d, req.rid, lease.nonce, writer_done=True))
            committed = True
            p.inflight -= 1
            yield Event(req.rid, (ack.first_token,), logprobs=(ack.first_logprob,) if ack.first_logprob else (),
                        cached_tokens=ack.cached_tokens)
            async for ev in self._events(events, req.rid):
                finished = ev.finish_reason is not None
                yield ev
        finally:
            d.inflight -= 1
            if not committed:
                p.inflight -= 1
            d.mux.unregister(req.rid)
            if committed and not finished:  # client left or stream broke: stop decode, free its pages.
                # A task, not an await: this finally may run inside a cancelled scope.
                self._spawn(self._abort(d, req.rid, 0, writer_done=True))

    async def _step(self, coro: Coroutine, undo: Callable[[Any], Coroutine],
                    unguarded: Callable[[], Coroutine] | None = None) -> Any:
        """One protocol step that a client disconnect must not cut in half.

        Guarded (default): the step runs to its end even if the client leaves; if it left, ``undo`` then
        releases what the finished step holds on decode. Unguarded (unsafe, the 2026 load balancer): the
        disconnect cancels the step where it stands and ``unguarded`` tells decode at once, as if the cancelled
        call had stopped the writer — while the prefill worker may still be writing into the lease.
        """
        task = self._spawn(coro)
        try:
            return await (asyncio.shield(task) if self.prot.disconnect_guard else task)
        except asyncio.CancelledError:
            if not self.prot.disconnect_guard:
                if unguarded:
                    self._spawn(unguarded())
            else:
                task.add_done_callback(lambda t: self._undo_after(t, undo))
            raise

    def _undo_after(self, task: asyncio.Task, undo: Callable[[Any], Coroutine]) -> None:
        """A step whose client left has ended: if it succeeded, undo it. (A failed step cleaned up itself.)"""
        if not task.cancelled() and task.exception() is None:
            self._spawn(undo(task.result()))

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _reserve(self, d: Worker, r: P.Reserve) -> P.Lease:
        return P.decode(await self._post(d, "/kv/reserve", r), P.Lease)

    async def _transfer(self, p: Worker, d: Worker, msg: P.Prefill) -> P.Ack:
        """Prefill's answer is final; on any failure, decode is told to drop the lease."""
        try:
            # queued behind other prompts on a live prefill is not a failure: wait up to the queue timeout
            return P.decode(await self._post(p, "/prefill", msg, timeout=self.queue_timeout), P.Ack)
        except Unanswered:  # unreachable, or busy past the timeout: ask it to drop the lease. If it confirms it
            # never wrote, decode may free the pages now; otherwise fencing or the TTL decides.
            stopped = await self._forget(p, msg.rid, msg.lease.nonce)
            await self._abort(d, msg.rid, msg.lease.nonce, writer_done=stopped)
            raise
        except EngineError:  # prefill answered: it wrote nothing more
            await self._abort(d, msg.rid, msg.lease.nonce, writer_done=True)
            raise

    async def _forget(self, p: Worker, rid: int, nonce: int) -> bool:
        """The router gave up on a transfer: prefill stops the request if it has not written yet. True only if
        prefill confirms it will never write into the lease."""
        try:
            r = await self.client.post(p.url + "/kv/forget", content=P.encode(P.Forget(rid=rid, nonce=nonce)),
                                       timeout=self.probe_timeout)
            return r.status_code == 200 and r.json().get("writing") is False
        except (httpx.HTTPError, ValueError):
            return False

    async def _abort(self, d: Worker, rid: int, nonce: int, writer_done: bool) -> None:
        try:
            await self.client.post(d.url + "/kv/abort",
                                   content=P.encode(P.Abort(rid=rid, nonce=nonce, writer_done=writer_done)))
        except httpx.HTTPError:
            pass

    async def _events(self, q: asyncio.Queue, rid: int) -> AsyncIterator[Event]:
        """This request's events from the decode stream. The stream's heartbeat proves the worker alive, not
        that this request moves: one that hears nothing for ``timeout`` seconds fails (503), never hangs."""
        while True:
            try:
                async with asyncio.timeout(self.timeout):
                    m = await q.get()
            except TimeoutError:
                raise Overloaded(f"decode sent nothing for request {rid} in {self.timeout:g} s") from None
            if isinstance(m, EngineError):  # the stream from decode died
                raise m
            if m.error:
                raise worker_error(m.error["status"], m.error)
            yield Event(rid, tuple(m.tokens), m.finish, logprobs=tuple(m.logprobs or ()))
            if m.finish is not None:
                return
