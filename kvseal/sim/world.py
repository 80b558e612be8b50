"""One simulated cluster: a router, two prefill workers and a decode worker, made of the real protocol machines
(``kvseal.protocol``) and real ``PagePool``s, driven by one seeded scheduler.

Everything that happens is an event on one heap ordered by simulated time, and every random choice comes from
one ``random.Random(seed)``: a seed replays exactly. The network loses, duplicates, delays (so reorders) and
corrupts messages; page writes can be corrupted; any node can crash (losing all its state) and restart; clients
leave at any time. Page bytes are written as patterns, ``(lease serial, token index)`` in every slot, so a read
of bytes not written for the request under its current lease is seen directly, without a model.

What the simulation assumes of the world (docs/protocol.md says why each is real):
- a page write either lands whole when the writer performs it or not at all, and a crashed writer's writes die
  with it (a memcpy or an in-process transfer; Mooncake's connection resets);
- the decode transport refuses a write whose capability names a fenced epoch (fencing cuts the writer off);
- a restarted decode is a new target: writes addressed to the old one go nowhere.

Checked after every step (``Violation`` names the first one broken):
1. no request reads a slot not written for it under its current lease (the leak check, at ``Start``);
2. no write lands in a page that is not its lease's (reserved or quarantined, same owner and generation);
3. every request ends exactly once, with a status its history allows (200 only if served, 400 only if it can
   never fit, 500 only after an injected corruption);
4. an over-long request is never served;
5. every pool is conserved (``check_integrity``), and once traffic stops every request ends and every page
   drains back to the free list.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvseal.config import PoolConfig
from kvseal.engine.errors import EngineError, Overloaded
from kvseal.kv.pool import PagePool, PageRun, PageState, tenant_tag
from kvseal.protocol import decode as dc
from kvseal.protocol import prefill as pc
from kvseal.protocol import router as rc
from kvseal.protocol.machine import SAFE, Variants
from kvseal.transfer import protocol as P

PAGE = 4  # token slots per page
NEVER = -1.0  # the pattern of a slot nobody wrote since the node booted
LENGTHS = (2, 5, 8, 13, 21, 30, 37)  # prompt lengths: some fill a page exactly, some fit no pool


class Violation(AssertionError):
    pass


@dataclass
class Knobs:
    requests: int = 8
    drop: float = 0.04
    dup: float = 0.06
    corrupt: float = 0.03
    max_delay: float = 2.0
    crash: float = 0.03  # per chaos tick (1 time unit), some node crashes
    slow: float = 0.08  # a live prefill's health probe times out
    leave: float = 0.25  # a client leaves at some random moment
    decode_pages: int = 10
    prefill_pages: int = 7
    ttl: float = 12.0
    horizon: float = 40.0  # new requests and faults stop here; then the cluster must drain
    drain: float = 400.0


class NoBumpPool(PagePool):
    """The ``lease_reuse`` variant's pool: a freed page keeps its generation."""

    def free(self, run: PageRun) -> None:
        pages = [p for p in run.pages if self.state[p] != PageState.SHARED]
        super().free(run)
        if pages:
            self.generation[torch.tensor(pages)] -= 1


def new_pool(pages: int, variants: Variants) -> PagePool:
    cls = NoBumpPool if variants.lease_reuse else PagePool
    pool = cls(PoolConfig(num_pages=pages, page_size=PAGE), 1, 1, 2, torch.float32)
    pool.kv.fill_(NEVER)
    return pool


@dataclass
class Request:
    rid: int
    tenant: str
    n_prompt: int
    max_new: int
    over_long: bool  # for some pool on its path: it can never be served
    corrupted: bool = False  # a fault changed its bytes or its commit on the way
    ended: str = ""  # "" while open; else the status it ended with
    served: bool = False


class World:
    def __init__(self, seed: int, variants: Variants = SAFE, knobs: Knobs | None = None) -> None:
        self.seed, self.variants = seed, variants
        self.k = knobs or Knobs()
        self.rng = random.Random(seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.serials = 0
        self.trace: list[str] = []
        self.requests: dict[tuple[int, int], Request] = {}  # (router incarnation, request number) → request
        self.faults_on = True
        self.decode = DecodeNode(self, "decode")
        self.prefills = [PrefillNode(self, f"prefill{i}") for i in range(2)]
        self.router = RouterNode(self)

    # -- scheduling -------------------------------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, self._seq, fn))

    def log(self, line: str) -> None:
        self.trace.append(f"{self.now:7.2f} {line}")

    def send(self, what: str, fn: Callable[[], None], corruptible: Callable[[], None] | None = None) -> None:
        """A message on the network: maybe lost, maybe twice, after a random delay (so reordered)."""
        if self.faults_on and self.rng.random() < self.k.drop:
            self.log(f"net drop {what}")
            return
        copies = 2 if self.faults_on and self.rng.random() < self.k.dup else 1
        for _ in range(copies):
            self.at(self.rng.uniform(0.01, self.k.max_delay if self.faults_on else 0.2), fn)
        if copies == 2:
            self.log(f"net dup {what}")

    def next_serial(self) -> int:
        self.serials += 1
        return self.serials

    # -- the run ----------------------------------------------------------------------------------------
    def run(self) -> None:
        for i in range(self.k.requests):
            self.at(self.rng.uniform(0, self.k.horizon * 0.7), self.router.submit)
        self.at(1.0, self._chaos)
        self.at(0.5, self.decode.tick)
        self.at(0.3, self.router.probe)
        self.at(self.k.horizon, self._calm)
        end = self.k.horizon + self.k.drain
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > end:
                break
            self.now = t
            fn()
            self.check()
            if not self.faults_on and self.drained():
                return
        raise Violation(f"did not drain by t={end:g}: {self.describe()}")

    def _chaos(self) -> None:
        if not self.faults_on:
            return
        if self.rng.random() < self.k.crash:
            node = self.rng.choice([self.decode, *self.prefills, self.router])
            if node.up:
                node.crash()
                self.at(self.rng.uniform(2.0, 8.0), node.restart)
        self.at(1.0, self._chaos)

    def _calm(self) -> None:
        """Traffic and faults stop; crashed nodes come back; everything must now end and drain."""
        self.log("calm: no more faults")
        self.faults_on = False
        for node in [self.decode, *self.prefills, self.router]:
            if not node.up:
                node.restart()

    def drained(self) -> bool:
        return (all(r.ended for r in self.requests.values()) and self.decode.pool.num_free == self.k.decode_pages
                and all(p.pool.num_free == self.k.prefill_pages for p in self.prefills)
                and not self.decode.core.leases)

    def describe(self) -> str:
        open_ = [r for r in self.requests.values() if not r.ended]
        return (f"open requests {[(r.rid, r.n_prompt) for r in open_]}, decode pool {self.decode.pool.counts()}, "
                f"leases {[(s.rid, s.state.name) for s in self.decode.core.leases.values()]}, prefill pools "
                f"{[p.pool.counts() for p in self.prefills]}")

    # -- invariants -------------------------------------------------------------------------------------
    def check(self) -> None:
        for node in [self.decode, *self.prefills]:
            try:
                node.pool.check_integrity()
            except AssertionError as e:
                raise Violation(f"{node.name} pool not conserved: {e}") from None

    def violate(self, what: str) -> None:
        self.log(f"VIOLATION {what}")
        raise Violation(what)

    def ended(self, req: Request, status: str) -> None:
        if req.ended:
            self.violate(f"request {req.rid} ended twice: {req.ended}, then {status}")
        req.ended = status
        self.log(f"request {req.rid} ends {status}")
        if status == "200" and (req.over_long or not req.served):
            self.violate(f"request {req.rid} answered 200 but it was {'over-long' if req.over_long else 'not served'}")
        if status == "400" and not req.over_long:
            self.violate(f"request {req.rid} answered 400 but it fits")
        if status == "500" and not req.corrupted:
            self.violate(f"request {req.rid} answered 500 without any corruption on its way")


def error_status(e: BaseException) -> str:
    return str(getattr(e, "status", 503))


# -- decode ----------------------------------------------------------------------------------------------------
@dataclass
class Held:
    req: Request
    run: PageRun
    serial: int
    router_inc: int
    expires: float


class Node:
    """A worker process: ``boot`` builds its state from nothing; a crash loses all of it."""

    def __init__(self, world: World, name: str) -> None:
        self.w, self.name = world, name
        self.inc = 0
        self.boot()

    def crash(self) -> None:
        self.w.log(f"{self.name} crashes")
        self.up = False

    def restart(self) -> None:
        if not self.up:
            self.w.log(f"{self.name} restarts")
            self.boot()

    def boot(self) -> None:
        raise NotImplementedError


class DecodeNode(Node):
    def boot(self) -> None:
        w = self.w
        self.inc += 1
        self.up = True
        self.core = dc.DecodeCore(w.rng.randbytes(32), self.name, w.k.ttl, max_leases=64, variants=w.variants)
        self.pool = new_pool(w.k.decode_pages, w.variants)
        self.held: dict[int, Held] = {}
        self.quarantined: dict[int, PageRun] = {}
        self.running: dict[int, Held] = {}

    @property
    def admit_limit(self) -> int:
        return self.w.k.decode_pages * PAGE

    def reserve(self, req: Request, r: P.Reserve, router_inc: int, reply: Callable[[object], None]) -> None:
        if not self.up:
            return
        try:
            self.core.check_reserve(r.rid, r.prefill_id, "router", len(r.prompt), r.max_new, self.admit_limit)
            need = self.pool.cfg.pages_for(len(r.prompt))
            if not self.pool.can_allocate(need):
                raise Overloaded("decode pool full")
        except EngineError as e:
            reply(e)
            return
        run = self.pool.allocate(r.rid, need, PageState.RESERVED, tenant_tag(r.tenant))
        serial = self.w.next_serial()
        cap, _ = self.core.reserve(r.rid, self.w.rng.getrandbits(62), r.prefill_id, "router", r.subscriber,
                                   len(r.prompt), run.pages, run.generations, self.w.now)
        self.held[r.rid] = Held(req, run, serial, router_inc, self.w.now + self.w.k.ttl)
        self.w.log(f"{self.name} leases rid {r.rid} serial {serial} pages {run.pages} gens {run.generations}")
        lease = P.Lease(rid=r.rid, nonce=cap.nonce, pages=list(run.pages), generations=list(run.generations),
                        n_prompt=len(r.prompt), decode_id=self.name, target=f"{self.name}#{self.inc}",
                        layout=list(self.pool.kv.shape), cap=cap)
        reply((lease, serial))

    def commit(self, c: P.Commit, reply: Callable[[object], None]) -> None:
        if not self.up:
            return
        try:
            acts = self.core.commit(c, self.w.now)
        except EngineError as e:
            self.w.log(f"{self.name} refuses commit rid {c.rid}: {e.code}")
            reply(P.Ack(ok=False, status=e.status, code=e.code))
            return
        for a in self.carry(acts, c):
            if isinstance(a, dc.Reply):
                self.w.log(f"{self.name} answers commit rid {c.rid}: {a.ack.ok} {a.ack.code}")
                reply(a.ack)

    def carry(self, acts: list, commit: P.Commit | None = None) -> list:
        out: list = []
        for a in acts:
            if not isinstance(a, (dc.Reply, dc.Verify, dc.Expose, dc.Conceal)):
                self.w.log(f"{self.name} {type(a).__name__} rid {a.rid}")
            h = self.held.get(getattr(a, "rid", None))
            if isinstance(a, dc.Quarantine) and h is not None:
                self.quarantined[a.rid] = self.pool.quarantine(h.run)
            elif isinstance(a, dc.Free) and h is not None:
                self.pool.free(h.run)
                self.held.pop(a.rid, None)
            elif isinstance(a, dc.Release):
                run = self.quarantined.pop(a.rid, None)
                if run is not None:
                    self.pool.free(run)
                self.held.pop(a.rid, None)
            elif isinstance(a, dc.Verify) and h is not None and commit is not None:
                tags = self.pool.run_ok(h.run, a.rid, PageState.RESERVED, tenant_tag(h.req.tenant))
                digest = P.checksum(self.pool.kv, commit.pages, commit.n_tokens, a.rid, commit.nonce, commit.pages,
                                    commit.generations, commit.first_token)
                out += self.carry(self.core.verified(a.rid, a.nonce, tags, digest == commit.checksum,
                                                     commit.first_token))
            elif isinstance(a, dc.Start) and h is not None:
                self.start(h)
            elif isinstance(a, dc.Stop):
                self.stop(a.rid, "abort")
            elif isinstance(a, dc.End) and h is not None:
                self.stream(h, a.reason, a.error)
            elif isinstance(a, dc.AskForget):
                self.ask_forget(a)
            else:
                out.append(a)
        return out

    def start(self, h: Held) -> None:
        """The request reads its prompt's pages: every slot must hold its own lease's bytes."""
        req, rid = h.req, h.req.rid
        self.pool.set_state(h.run, PageState.OWNED)
        kv = self.pool.kv
        for i in range(req.n_prompt):
            page, off = h.run.pages[i // PAGE], i % PAGE
            got = (float(kv[page, 0, 0, 0, off, 0]), float(kv[page, 0, 0, 0, off, 1]))
            if got != (float(h.serial), float(i)):
                self.w.violate(f"request {rid} (lease serial {h.serial}) read page {page} slot {off} holding "
                               f"{got}: not written for it under its lease")
        if req.over_long:
            self.w.violate(f"request {rid} is over-long and was served")
        if self.w.now > h.expires:
            self.w.violate(f"request {rid} started on a lease that expired at t={h.expires:.2f}: its writer's "
                           "capability was dead, the pages no longer promised to it")
        req.served = True
        self.w.log(f"{self.name} starts rid {rid}")
        self.running[rid] = h
        self.w.at(self.w.rng.uniform(0.5, 4.0), lambda: self.finish(rid, h))

    def finish(self, rid: int, h: Held) -> None:
        if self.up and self.running.get(rid) is h:
            self.stop(rid, "length")
            self.core.finished(rid)

    def stop(self, rid: int, reason: str) -> None:
        h = self.running.pop(rid, None)
        self.held.pop(rid, None)
        if h is not None:
            self.pool.free(h.run)
            self.stream(h, reason, None)

    def stream(self, h: Held, reason: str, error: EngineError | None) -> None:
        """The request's last event, on its router's token stream."""
        router = self.w.router
        self.w.send(f"final rid {h.req.rid}", lambda: router.final(h.router_inc, h.req, reason, error))

    def land(self, cap: P.Capability, target: str, serial: int, pages: list[int], n: int, corrupt: bool) -> bool:
        """A page write arrives: refused from a fenced writer or for an old incarnation, else it lands."""
        if not self.up or target != f"{self.name}#{self.inc}":
            return False
        if cap.epoch != self.core.writer_epoch(cap.writer):
            self.w.log(f"{self.name} refuses a write from fenced {cap.writer}")
            return False
        idx = torch.tensor(pages, dtype=torch.int64)
        gens = torch.tensor(cap.generations[:len(pages)], dtype=torch.int64)
        state = self.pool.state[idx]
        ours = ((self.pool.owner[idx] == cap.rid) & (self.pool.generation[idx] == gens)
                & ((state == PageState.RESERVED) | (state == PageState.QUARANTINED)))
        if not bool(ours.all()):
            self.w.violate(f"a write for rid {cap.rid} (serial {serial}) landed in pages {pages} that are no "
                           f"longer its lease's (states {state.tolist()}, owners {self.pool.owner[idx].tolist()})")
        write_pattern(self.pool.kv, pages, n, serial)
        if corrupt:
            self.pool.kv[pages[0], 0, 0, 0, 0, 0] += 0.5
        return True

    def abort(self, a: P.Abort) -> None:
        self.w.log(f"{self.name} gets abort rid {a.rid} writer_done={a.writer_done}")
        if self.up:
            self.carry(self.core.abort(a.rid, a.nonce, a.writer_done))

    def writer_done(self, wd: P.WriterDone) -> None:
        if self.up:
            try:
                self.carry(self.core.writer_done(wd, self.w.now))
            except EngineError:
                pass

    def fence(self, writer: str) -> None:
        if self.up:
            self.w.log(f"{self.name} fences {writer}")
            self.carry(self.core.fence(writer))

    def tick(self) -> None:
        if self.up:
            self.carry(self.core.expire(self.w.now))
        self.w.at(self.w.k.ttl / 4, self.tick)

    def ask_forget(self, a: dc.AskForget) -> None:
        pre = next(p for p in self.w.prefills if p.name == a.writer)
        inc = self.inc

        def answer(writing: bool) -> None:
            if self.up and self.inc == inc:
                self.carry(self.core.forget_answer(a.rid, a.nonce, writing))

        self.w.send(f"forget rid {a.rid}", lambda: pre.forget(a.rid, a.nonce, answer))

    def router_gone(self, subscriber: str, since: float) -> None:
        if self.up:
            self.carry(self.core.router_gone(subscriber, since))


def write_pattern(kv: torch.Tensor, pages: list[int], n: int, serial: int) -> None:
    for i in range(n):
        page, off = pages[i // PAGE], i % PAGE
        kv[page, :, :, :, off, 0] = float(serial)
        kv[page, :, :, :, off, 1] = float(i)


# -- prefill ---------------------------------------------------------------------------------------------------
@dataclass
class Job:
    msg: P.Prefill
    serial: int
    req: Request
    reply: Callable[[object], None]
    run: PageRun | None = None
    n: int = 0  # tokens computed (a placeholder computes one)
    answered: bool = False


class PrefillNode(Node):
    def boot(self) -> None:
        self.inc += 1
        self.up = True
        self.core = pc.PrefillCore(variants=self.w.variants)
        self.pool = new_pool(self.w.k.prefill_pages, self.w.variants)
        self.jobs: dict[tuple[int, int], Job] = {}

    def prefill(self, msg: P.Prefill, serial: int, req: Request, reply: Callable[[object], None]) -> None:
        if not self.up:
            return
        limit = self.w.k.prefill_pages * PAGE
        fault = self.w.faults_on and self.w.rng.random() < self.w.k.corrupt  # the legacy_placeholder fault
        if fault and len(msg.prompt) + msg.max_new > limit:
            req.corrupted = True
        try:
            acts = self.core.prefill(msg.rid, msg.lease.nonce, len(msg.prompt), msg.max_new, limit,
                                     placeholder_fault=fault)
        except EngineError as e:
            reply(e)
            return
        self.w.log(f"{self.name} admits rid {msg.rid} serial {serial}{' as a placeholder' if acts and acts[0].placeholder else ''}")
        if not acts:  # a duplicate of a transfer in progress: the original answers
            return
        job = Job(msg, serial, req, reply)
        self.jobs[(msg.rid, msg.lease.nonce)] = job
        admit = acts[0]
        job.n = 1 if admit.placeholder else len(msg.prompt)
        need = self.pool.cfg.pages_for(job.n)
        if not self.pool.can_allocate(need):
            self.carry(job, self.core.failed(msg.rid, msg.lease.nonce, Overloaded("prefill pool full")))
            return
        job.run = self.pool.allocate(msg.rid, need, PageState.OWNED)
        write_pattern(self.pool.kv, list(job.run.pages), job.n, serial)
        inc, rng = self.inc, self.w.rng
        busy = rng.random() < 0.15  # queued behind other prompts: past the lease's TTL, perhaps the router's wait
        self.w.at(rng.uniform(4.0, 14.0) if busy else rng.uniform(0.1, 3.0), lambda: self.prefilled(inc, job))

    def prefilled(self, inc: int, job: Job) -> None:
        if not self.up or self.inc != inc:
            return
        acts = self.core.prefilled(job.msg.rid, job.msg.lease.nonce)
        if not any(isinstance(a, pc.Write) for a in acts):
            self.release(job)
            return
        self.w.at(self.w.rng.uniform(0.0, 2.0), lambda: self.write(inc, job))  # a slow link

    def write(self, inc: int, job: Job) -> None:
        if not self.up or self.inc != inc:
            return
        lease = job.msg.lease
        k = self.pool.cfg.pages_for(job.n)
        corrupt = self.w.faults_on and self.w.rng.random() < self.w.k.corrupt
        if corrupt:
            job.req.corrupted = True
        landed = self.w.decode.land(lease.cap, lease.target, job.serial, lease.pages[:k], job.n, corrupt)
        self.w.log(f"{self.name} writes rid {job.msg.rid} serial {job.serial}: {'landed' if landed else 'refused'}")
        if not landed:
            self.carry(job, self.core.written(job.msg.rid, lease.nonce, Overloaded("KV transfer failed")))
            return
        self.carry(job, self.core.written(job.msg.rid, lease.nonce))

    def carry(self, job: Job, acts: list) -> None:
        for a in acts:
            if isinstance(a, (pc.ReleaseOwn, pc.StopCompute)):
                self.release(job)
            elif isinstance(a, pc.SendCommit):
                self.send_commit(job)
            elif isinstance(a, pc.SendWriterDone):
                lease = job.msg.lease
                wd = P.WriterDone(rid=a.rid, nonce=a.nonce, cap=lease.cap)
                dec = self.w.decode
                self.w.send(f"writer_done rid {a.rid}", lambda dec=dec, wd=wd: dec.writer_done(wd))
            elif isinstance(a, pc.Settle):
                job.answered = True
                job.reply(a.result)
                self.jobs.pop((job.msg.rid, job.msg.lease.nonce), None)

    def release(self, job: Job) -> None:
        if job.run is not None:
            self.pool.free(job.run)
            job.run = None

    def send_commit(self, job: Job) -> None:
        lease, n = job.msg.lease, job.n
        k = self.pool.cfg.pages_for(n)
        first = 7
        digest = P.checksum(self.pool.kv, list(job.run.pages[:k]), n, job.msg.rid, lease.nonce, lease.pages[:k],
                            lease.generations[:k], first)
        c = P.Commit(rid=job.msg.rid, nonce=lease.nonce, n_tokens=n, first_token=first, pages=lease.pages[:k],
                     generations=lease.generations[:k], checksum=digest, cap=lease.cap)
        if self.w.faults_on and self.w.rng.random() < self.w.k.corrupt:
            c.first_token = 8  # the message changed on the way; the checksum covers it
            job.req.corrupted = True
        inc, done = self.inc, [False]

        def answer(ack: P.Ack) -> None:
            if self.up and self.inc == inc and not done[0]:
                done[0] = True
                self.carry(job, self.core.acked(job.msg.rid, lease.nonce, ack))

        dec = self.w.decode
        self.w.send(f"commit rid {c.rid}", lambda: dec.commit(c, lambda ack: self.w.send(
            f"ack rid {c.rid}", lambda: answer(ack))))
        self.w.at(8.0, lambda: answer(P.Ack(ok=False, status=503, code="decode_unreachable")))

    def forget(self, rid: int, nonce: int, answer: Callable[[bool], None]) -> None:
        if not self.up:
            return
        writing, acts = self.core.forget(rid, nonce)
        job = self.jobs.get((rid, nonce))
        if job is not None:
            self.carry(job, acts)
        self.w.send(f"forget answer rid {rid}", lambda: answer(writing))


# -- router -----------------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One request on the router: its machine, and the one answer each of its steps may still take."""

    req: Request
    m: rc.RouterRequest
    prefill: PrefillNode
    step: int = 0  # the step whose answer is awaited; answers to older steps are dropped
    first: bool = False
    nonce: int = 0
    serial: int = 0
    silence: int = 0


class RouterNode:
    def __init__(self, world: World) -> None:
        self.w = world
        self.inc = 0
        self.health = {p.name: rc.WorkerHealth(p.name, "prefill", busy_grace=3.0) for p in world.prefills}
        self.boot()

    def boot(self) -> None:
        self.inc += 1
        self.up = True
        self.calls: dict[int, Call] = {}
        self.count = 0

    @property
    def subscriber(self) -> str:
        return f"router#{self.inc}"

    def crash(self) -> None:
        w = self.w
        w.log("router crashes")
        self.up = False
        for call in self.calls.values():  # the clients' connections reset
            if not call.req.ended:
                w.ended(call.req, "reset")
        self.calls = {}
        sub, since, dec = self.subscriber, w.now, w.decode
        w.at(5.0, lambda: dec.router_gone(sub, since))  # decode's grace period for a stream that closed

    def restart(self) -> None:
        if not self.up:
            self.w.log("router restarts")
            self.boot()

    def submit(self) -> None:
        """A client sends a request. Request ids are small and reused (a restarted router counts from 1 again):
        the protocol must not need them unique over time."""
        w = self.w
        if not self.up or not w.faults_on:
            return
        rid = self.count % 3 + 1
        if rid in self.calls:  # that id is still in use here: the client comes back later
            w.at(1.0, self.submit)
            return
        self.count += 1
        n, max_new = w.rng.choice(LENGTHS), w.rng.randint(1, 4)
        over = n + max_new > min(w.k.decode_pages, w.k.prefill_pages) * PAGE
        req = Request(rid, w.rng.choice(["alice", "bob"]), n, max_new, over)
        w.requests[(self.inc, self.count)] = req
        live = [p for p in w.prefills if self.health[p.name].healthy] or w.prefills
        call = Call(req, rc.RouterRequest(rid, guarded=True), w.rng.choice(live))
        self.calls[rid] = call
        w.log(f"client submits rid {rid}: {n} tokens + {max_new}, tenant {req.tenant}, over-long {over}")
        self.carry(call, call.m.start())
        if w.rng.random() < w.k.leave:
            w.at(w.rng.uniform(0.0, 10.0), lambda: self.leave(call))

    def leave(self, call: Call) -> None:
        if self.up and self.calls.get(call.req.rid) is call and not call.req.ended:
            self.w.log(f"client of rid {call.req.rid} leaves")
            self.w.ended(call.req, "gone")
            self.carry(call, call.m.left())
            self.done(call)

    def done(self, call: Call) -> None:
        if call.m.state is None and self.calls.get(call.req.rid) is call:
            del self.calls[call.req.rid]

    def expect(self, call: Call, timeout: float, on_timeout: Callable[[], list]) -> Callable[[Callable], Callable]:
        """Arm a timeout for the call's next answer; returns a wrapper that lets only that answer through."""
        call.step += 1
        step, inc = call.step, self.inc

        def fire() -> None:
            if self.up and self.inc == inc and call.step == step:
                call.step += 1
                self.carry(call, on_timeout())

        self.w.at(timeout, fire)

        def wrap(fn: Callable) -> Callable:
            def answer(x: object) -> None:
                if self.up and self.inc == inc and call.step == step:
                    call.step += 1
                    self.carry(call, fn(x))
            return answer
        return wrap

    def carry(self, call: Call, acts: list) -> None:
        w, m, req = self.w, call.m, call.req
        for a in acts:
            if isinstance(a, rc.SendReserve):
                r = P.Reserve(rid=req.rid, tenant=req.tenant, prompt=[1] * req.n_prompt, max_new=req.max_new,
                              sampling={}, prefill_id=call.prefill.name, subscriber=self.subscriber)
                wrap = self.expect(call, 10.0, lambda: m.reserve_failed(Overloaded("decode unanswered")))
                inc, dec = self.inc, w.decode

                def on_lease(x: object) -> list:
                    if isinstance(x, BaseException):
                        return m.reserve_failed(x)
                    lease, serial = x
                    call.nonce, call.serial = lease.nonce, serial
                    return m.lease(lease)
                reply = wrap(on_lease)
                w.send(f"reserve rid {req.rid}", lambda dec=dec, r=r, inc=inc, reply=reply: dec.reserve(
                    req, r, inc, lambda x: w.send(f"lease rid {req.rid}", lambda: reply(x))))
            elif isinstance(a, rc.SendPrefill):
                msg = P.Prefill(rid=req.rid, tenant=req.tenant, prompt=[1] * req.n_prompt, max_new=req.max_new,
                                sampling={}, lease=a.lease, decode_url="decode")
                wrap = self.expect(call, 16.0, lambda: m.unanswered(Overloaded("prefill unanswered")))
                pre, serial = call.prefill, call.serial

                def on_answer(x: object) -> list:
                    if isinstance(x, BaseException):
                        return m.refused(x)
                    if not x.ok:
                        e = EngineError(x.message or x.code)
                        e.status, e.code = x.status, x.code
                        return m.refused(e)
                    self.health[call.prefill.name].answered(w.now)
                    return m.acked(x)
                reply = wrap(on_answer)
                w.send(f"prefill rid {req.rid}", lambda pre=pre, msg=msg, serial=serial, reply=reply: pre.prefill(
                    msg, serial, req, lambda x: w.send(f"prefill answer rid {req.rid}", lambda: reply(x))))
            elif isinstance(a, rc.SendForget):
                wrap = self.expect(call, 4.0, lambda: m.forget_answer(False))
                reply = wrap(lambda writing: m.forget_answer(not writing))
                pre = call.prefill
                w.send(f"router forget rid {req.rid}", lambda pre=pre, a=a, reply=reply: pre.forget(a.rid, a.nonce, reply))
            elif isinstance(a, rc.SendAbort):
                ab, dec = P.Abort(rid=a.rid, nonce=a.nonce, writer_done=a.writer_done), w.decode
                w.send(f"abort rid {a.rid} writer_done={a.writer_done}", lambda dec=dec, ab=ab: dec.abort(ab))
            elif isinstance(a, rc.FirstToken):
                call.first = True
                self.watch(call)
            elif isinstance(a, rc.Fail) and not req.ended:
                w.ended(req, error_status(a.error))
        self.done(call)

    def watch(self, call: Call) -> None:
        """The token stream's silence limit: a request that hears nothing for a while fails, never hangs."""
        inc, silence = self.inc, call.silence

        def check() -> None:
            if self.up and self.inc == inc and self.calls.get(call.req.rid) is call and call.silence == silence:
                if not call.req.ended:
                    self.w.ended(call.req, "503")
                self.carry(call, call.m.left())
        self.w.at(20.0, check)

    def final(self, router_inc: int, req: Request, reason: str, error: EngineError | None) -> None:
        call = self.calls.get(req.rid)
        if not self.up or self.inc != router_inc or call is None or call.req is not req:
            return
        call.silence += 1
        if not call.first:  # an event before the first token: the lease was revoked (its End) — wait for prefill
            return
        if not req.ended:
            self.w.ended(req, "200" if error is None and reason != "abort" else error_status(error or Overloaded()))
        self.carry(call, call.m.final() if reason != "abort" else call.m.left())

    def probe(self) -> None:
        w = self.w
        if self.up:
            for p in w.prefills:
                h = self.health[p.name]
                slow = w.faults_on and w.rng.random() < w.k.slow
                acts = h.probe_ok(w.now) if p.up and not slow else h.probe_failed(w.now, timed_out=p.up)
                for a in acts:
                    if isinstance(a, rc.Fence):
                        w.log(f"router fences {p.name}")
                        w.send(f"fence {p.name}", lambda n=p.name: w.decode.fence(n))
        w.at(1.0, self.probe)


# -- running seeds -------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    seed: int
    violation: str = ""
    trace: list[str] = field(default_factory=list)
    requests: int = 0
    served: int = 0


def run_seed(seed: int, variants: Variants = SAFE, knobs: Knobs | None = None) -> Outcome:
    w = World(seed, variants, knobs)
    try:
        w.run()
    except Violation as v:
        return Outcome(seed, str(v), w.trace, len(w.requests), sum(r.served for r in w.requests.values()))
    return Outcome(seed, "", [], len(w.requests), sum(r.served for r in w.requests.values()))


def run_seeds(seeds: range, variants: Variants = SAFE, knobs: Knobs | None = None,
              stop_at_first: bool = True) -> list[Outcome]:
    bad = []
    for s in seeds:
        o = run_seed(s, variants, knobs)
        if o.violation:
            bad.append(o)
            if stop_at_first:
                break
    return bad


def shrink(seed: int, variants: Variants = SAFE, knobs: Knobs | None = None) -> tuple[Knobs, Outcome]:
    """The same seed with as few requests as still fail: the smallest replay, and its trace."""
    k = knobs or Knobs()
    best = run_seed(seed, variants, k)
    for n in range(1, k.requests):
        smaller = Knobs(**{**k.__dict__, "requests": n})
        o = run_seed(seed, variants, smaller)
        if o.violation:
            return smaller, o
    return k, best
