"""The router: the OpenAI front door over remote prefill and decode workers.

Per request: pick the least-loaded healthy decode and prefill (free pages, then queue length) → decode
reserves and returns a lease → prefill admits, computes, writes, commits → the first token comes back only
after decode verified the commit → the rest streams from decode, over one multiplexed stream per decode
worker (``TokenMux``: one line per engine step). Admission against min(context, prefill pool, decode pool)
happened in the API layer before any of this.

Status follows truth: an error from any worker is returned with that worker's original status and code.
The protocol rules (what a client that leaves undoes, what an unanswered prefill means, when a worker is
skipped or fenced) are the machines of ``kvseal.protocol.router``; ``kvseal.protocol.router_host`` carries out a
request's actions through this module's ports (``HttpPorts``), the same host the simulator runs.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import httpx
import msgspec

from kvseal.config import Protections
from kvseal.engine.request import Event
from kvseal.errors import EngineError, Overloaded, PoolFull, TooManyRequests, Unanswered
from kvseal.faults import Faults
from kvseal.protocol import router as rp
from kvseal.protocol.router import RouterRequest, WorkerHealth
from kvseal.protocol.router_host import RouterHost
from kvseal.server import listen
from kvseal.server.backend import GenRequest
from kvseal.server.mux import TokenMux
from kvseal.transfer import messages as P

log = logging.getLogger("kvseal.router")

SIGNED_ONLY = ("machine", "incarnation")  # worker /health fields a signed caller sees and the router's open one not


@dataclass
class Worker:
    url: str
    role: str
    health: WorkerHealth
    info: dict = field(default_factory=dict)
    inflight: int = 0
    mux: TokenMux | None = None  # decode workers: this router's token stream from it

    @property
    def healthy(self) -> bool:
        return self.health.healthy

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


def _down(w: Worker) -> None:
    w.health.down()


@dataclass(eq=False)
class Flight:
    """One request on this router: its machine, its workers, where its first token (or error) goes, and the
    step in flight."""

    m: RouterRequest
    d: Worker
    p: Worker
    req: GenRequest
    first: asyncio.Queue = field(default_factory=asyncio.Queue)
    step: asyncio.Task | None = None
    holding: bool = False  # its lease holds decode pages (counted in DisaggBackend.holders)
    ended: bool = False  # its generator has ended: nothing of it is held any more


def bug(e: Exception, step: str) -> Unanswered:
    """A bug met while a worker was being asked: logged, and answered as a worker that did not answer, since
    what it did is unknown (the machine's way for that never frees a page a write may still reach)."""
    log.error("unhandled error in the router's %s step", step, exc_info=e)
    return Unanswered(f"internal error ({type(e).__name__}) in the router's {step} step")


class HttpPorts:
    """``RouterPorts`` over httpx: each step an asyncio task that answers the host when the worker does."""

    def __init__(self, b: DisaggBackend) -> None:
        self.b = b

    def _step(self, f: Flight, coro: Coroutine) -> None:
        f.step = self.b._spawn(coro)

    def reserve(self, f: Flight, answer: Callable[[object], None]) -> None:
        self._step(f, self._reserve(f, answer))

    async def _reserve(self, f: Flight, answer: Callable[[object], None]) -> None:
        req = f.req
        r = P.Reserve(rid=req.rid, tenant=req.tenant, prompt=req.prompt, max_new=req.params.max_tokens,
                      sampling=req.params.to_wire(), prefill_id=f.p.url, subscriber=self.b.subscriber)
        until = time.monotonic() + self.b.queue_timeout
        try:
            while True:
                try:
                    lease = P.decode(await self.b._post(f.d, "/kv/reserve", r), P.Lease)
                    break
                except EngineError as e:
                    # A choice (or prompt) of a request whose other choices fill decode's pool would wait for
                    # its own siblings: after decode's wait it is asked again while any of them still holds pages
                    # (they are bounded by max_tokens and free as they finish), within the queue timeout (a
                    # sibling counts until its reply is read, so others filling the pool are waited on too).
                    # Decode kept nothing of the refusal.
                    if (e.code != PoolFull.code or f.ended or not self.b.siblings_hold(f)
                            or time.monotonic() >= until):
                        raise
        except EngineError as e:
            answer(e)
            return
        except msgspec.MsgspecError as e:  # a malformed answer: whatever decode did, its TTL ends it
            answer(Unanswered(f"decode answered a malformed lease: {e}"))
            return
        except Exception as e:  # noqa: BLE001 - a bug: the request must still end; decode's TTL ends the lease
            answer(bug(e, "reserve"))
            return
        self.b.hold(f)
        self.b.faults.crash("crash_after_reserve")
        answer(lease)

    def prefill(self, f: Flight, lease: P.Lease, answer: Callable[[object], None]) -> None:
        self._step(f, self._prefill(f, lease, answer))

    async def _prefill(self, f: Flight, lease: P.Lease, answer: Callable[[object], None]) -> None:
        req = f.req
        msg = P.Prefill(rid=req.rid, tenant=req.tenant, prompt=req.prompt, max_new=req.params.max_tokens,
                        sampling=req.params.to_wire(), lease=lease, decode_url=f.d.url, group=req.group,
                        cache_salt=req.cache_salt)
        try:  # queued behind other prompts on a live prefill is not a failure: wait up to the queue timeout
            ack = P.decode(await self.b._post(f.p, "/prefill", msg, timeout=self.b.queue_timeout), P.Ack)
        except EngineError as e:  # Unanswered, or prefill's refusal
            answer(e)
            return
        except msgspec.MsgspecError as e:  # what prefill did is unknown: the Forget path finds out
            answer(Unanswered(f"prefill answered a malformed ack: {e}"))
            return
        except Exception as e:  # noqa: BLE001 - a bug: as unknown as an unanswered prefill, the same path
            answer(bug(e, "prefill"))
            return
        answer(ack)

    def forget(self, f: Flight, rid: int, nonce: int, answer: Callable[[bool], None]) -> None:
        async def run() -> None:
            try:
                sure = await self.b._forget(f.p, rid, nonce)
            except Exception as e:  # noqa: BLE001 - a bug: not confirmed, so the lease is never freed early
                bug(e, "forget")
                sure = False
            answer(sure)
        self._step(f, run())

    def abort(self, f: Flight, rid: int, nonce: int, writer_done: bool) -> None:
        self.b._spawn(self.b._abort(f.d, rid, nonce, writer_done))

    def first_token(self, f: Flight, ack: P.Ack) -> None:
        f.first.put_nowait(ack)

    def fail(self, f: Flight, error: EngineError) -> None:
        f.first.put_nowait(error)

    def cancel(self, f: Flight) -> None:
        if f.step is not None:
            f.step.cancel()


class DisaggBackend:
    FENCE_AFTER = 3

    def __init__(self, prefill: list[str], decode: list[str], model_name: str, timeout: float = 30.0,
                 protections: Protections | None = None, faults: Faults | None = None, probe_timeout: float = 5.0,
                 max_inflight: int = 256, queue_timeout: float = 120.0, http: dict | None = None) -> None:
        self.probe_timeout = probe_timeout
        self.busy_grace = max(3 * probe_timeout, 10.0)
        self.decodes = [self._worker(u, "decode") for u in decode]
        self.prefills = [self._worker(u, "prefill") for u in prefill]
        self.model_name = model_name
        self.timeout = timeout
        self.prot = protections or Protections()
        self.faults = faults or Faults()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0),
                                        limits=listen.client_limits(512, 512), **(http or {}))
        self.context_window = 0
        self.pool_tokens = 0
        self._tasks: set[asyncio.Task] = set()
        self._full: tuple[float, asyncio.Future] | None = None  # the full health round in flight: (started, result)
        self.max_inflight = max_inflight  # per worker: past it, new requests are shed with 429 at once
        self.queue_timeout = max(queue_timeout, timeout)  # a transfer's wait for prefill, queue included
        self.subscriber = secrets.token_hex(8)  # names this router's token stream on every decode
        self.holders: collections.Counter = collections.Counter()  # (batch, decode url) -> its leases there
        self.host = RouterHost(HttpPorts(self))
        for d in self.decodes:
            d.mux = TokenMux(self.client, d.url, self.subscriber, timeout, on_dead=lambda d=d: _down(d))

    async def pages(self) -> list[dict]:
        """Every page of every worker's pool (their signed ``/pages``), for the dashboard; a worker that does not
        answer is listed with its error."""
        async def one(w: Worker) -> dict:
            try:
                r = await self.client.get(w.url + "/pages", timeout=self.probe_timeout)
                r.raise_for_status()
                return {"name": f"{w.role} {w.url}", **r.json()}
            except (httpx.HTTPError, ValueError) as e:
                return {"name": f"{w.role} {w.url}", "error": str(e)[:200], "state": "", "tenant": ""}

        return list(await asyncio.gather(*[one(w) for w in self.prefills + self.decodes]))

    def metric_rows(self) -> list[tuple]:
        """The GAIE gauges for the router as one model server: requests before their first token are waiting,
        the rest running; KV usage is the fullest decode pool's at its last probe."""
        before_first = sum(p.inflight for p in self.prefills)
        total = sum(d.inflight for d in self.decodes)
        usage = [1.0 - d.info["free_pages"] / d.info["total_pages"] for d in self.decodes
                 if d.healthy and d.info.get("total_pages")]
        return [("kvseal:num_requests_waiting", "gauge", "Requests before their first token", None, before_first),
                ("kvseal:num_requests_running", "gauge", "Requests decoding", None, max(total - before_first, 0)),
                ("kvseal:kv_cache_usage_perc", "gauge", "Used fraction of the fullest decode pool (0..1)", None,
                 max(usage, default=0.0)),
                *[("kvseal_worker_healthy", "gauge", "1 while the router sends the worker work", {"worker": w.url,
                   "role": w.role}, float(w.healthy)) for w in self.prefills + self.decodes]]

    # -- health -----------------------------------------------------------------------------------------
    async def refresh(self) -> None:
        await asyncio.gather(*[self._probe(w) for w in self.prefills + self.decodes])
        live = [w for w in self.prefills + self.decodes if w.healthy and w.info]
        if live:
            self.context_window = min(w.info["context_window"] for w in live)
            self.pool_tokens = min(w.info["pool_tokens"] for w in live)

    def _worker(self, url: str, role: str) -> Worker:
        url = url.rstrip("/")
        decodes = tuple(d.url for d in self.decodes) if role == "prefill" else ()
        return Worker(url, role, WorkerHealth(url, role, self.FENCE_AFTER, self.busy_grace, decodes))

    async def _probe(self, w: Worker) -> None:
        """Feed the worker's health machine: a busy worker is not a dead one (``WorkerHealth``)."""
        try:
            r = await self.client.get(w.url + "/health", params={"quick": "true"}, timeout=self.probe_timeout)
            w.info = r.json()
            now = time.monotonic()
            acts = (w.health.probe_ok(now, w.info.get("incarnation")) if r.status_code == 200
                    else w.health.probe_unhealthy(now))
        except (httpx.HTTPError, ValueError) as e:
            acts = w.health.probe_failed(time.monotonic(), timed_out=isinstance(e, httpx.TimeoutException))
        for a in acts:
            if isinstance(a, rp.Fence):
                await self._fence(w, a.to)

    async def _fence(self, dead: Worker, to: tuple[str, ...]) -> None:
        """Every decode named, healthy or not: one that misses it (unreachable now) is asked again at each
        probe, and the prefill stays out of service until all have confirmed (``WorkerHealth.confirmed``)."""
        async def one(url: str) -> None:
            try:
                r = await self.client.post(url + "/kv/fence", content=P.encode(P.Fence(prefill_id=dead.url)),
                                           timeout=self.probe_timeout)
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                dead.health.confirmed(url)
        await asyncio.gather(*[one(url) for url in to])

    async def health_loop(self, period: float = 1.0) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(period)

    async def health(self, full: bool = False) -> dict:
        """``full``: every healthy worker's pool probed after this call began, with its conservation check
        (``integrity_ok``); otherwise the last quick probes, which carry load only."""
        ok = any(w.healthy for w in self.prefills) and any(w.healthy for w in self.decodes)
        live = [w for w in self.prefills + self.decodes if w.healthy]
        pools = await self._full_pools() if full else [w.info | {"url": w.url} for w in live]
        # open to anyone: what a worker tells signed callers only (what runs there, its start token) stays out
        pools = [{k: v for k, v in p.items() if k not in SIGNED_ONLY} for p in pools]
        return {"status": "ok" if ok else "degraded", "pools": pools,
                "workers": {w.url: w.healthy for w in self.prefills + self.decodes}}

    async def _full_pools(self) -> list[dict]:
        """One full round at a time, however many callers (the front door's /health is open: a flood of
        ``full=true`` must not become a flood of engine-thread integrity checks). A caller shares a round that
        began after it called, or waits for the one in flight to end and starts the next."""
        called = time.monotonic()
        while True:
            if self._full is not None and not self._full[1].done():
                started, fut = self._full
                if started >= called:
                    return await asyncio.shield(fut)
                await asyncio.wait({fut})
                continue
            self._full = (time.monotonic(), asyncio.ensure_future(self._probe_full()))
            return await asyncio.shield(self._full[1])

    async def _probe_full(self) -> list[dict]:
        async def now(w: Worker) -> dict:
            try:
                return (await self.client.get(w.url + "/health", timeout=15)).json() | {"url": w.url}
            except (httpx.HTTPError, ValueError) as e:
                return {"url": w.url, "error": str(e)[:200], "integrity_ok": False}

        return list(await asyncio.gather(*[now(w) for w in self.prefills + self.decodes if w.healthy]))

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
                w.health.down()
            raise Unanswered(f"{w.role} worker {w.url} unreachable: {type(e).__name__}") from None
        w.health.answered(time.monotonic())
        if r.status_code != 200:
            raise remote_error(r.status_code, r.content)
        return r.content

    async def generate(self, req: GenRequest) -> AsyncIterator[Event]:
        """The request's protocol is a ``RouterRequest`` machine whose actions ``RouterHost`` carries out through
        this backend's ports (``HttpPorts``: each step an asyncio task); this generator only relays. A client that
        leaves tells the machine (``left``), which decides what to undo."""
        d, p = self._pick(self.decodes), self._pick(self.prefills)
        p.inflight += 1
        d.inflight += 1
        f = Flight(RouterRequest(req.rid, guarded=self.prot.disconnect_guard), d, p, req)
        events = d.mux.register(req.rid)  # before the lease exists: no event of this request goes unclaimed
        self.host.carry(f, f.m.start())
        committed = finished = False
        try:
            got = await f.first.get()
            if isinstance(got, BaseException):
                raise got
            committed = True
            p.inflight -= 1
            yield Event(req.rid, (got.first_token,), logprobs=(got.first_logprob,) if got.first_logprob else (),
                        cached_tokens=got.cached_tokens, prompt_logprobs=tuple(got.prompt_logprobs or ()))
            async for ev in self._events(events, req.rid):
                finished = ev.finish_reason is not None
                if finished:
                    f.m.final()
                yield ev
        finally:
            d.inflight -= 1
            if not committed:
                p.inflight -= 1
            f.ended = True
            self.release(f)
            d.mux.unregister(req.rid)
            if not finished:  # client left or stream broke; carry only spawns tasks: safe while cancelled
                self.host.carry(f, f.m.left())

    def hold(self, f: Flight) -> None:
        """A choice or prompt of a request of several got its lease: it holds pages on its decode until its
        generator ends."""
        if f.req.batch is not None and not f.ended:
            self.holders[(f.req.batch, f.d.url)] += 1
            f.holding = True

    def release(self, f: Flight) -> None:
        if f.holding:
            f.holding = False
            key = (f.req.batch, f.d.url)
            self.holders[key] -= 1
            if self.holders[key] <= 0:
                del self.holders[key]

    def siblings_hold(self, f: Flight) -> bool:
        return f.req.batch is not None and self.holders.get((f.req.batch, f.d.url), 0) > 0

    def _spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
