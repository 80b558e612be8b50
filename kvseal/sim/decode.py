"""The simulated decode worker: the shipped ``DecodeHost`` and its core over a simulated pool and network."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvseal.errors import EngineError, Overloaded
from kvseal.kv.pool import PageRun, PageState
from kvseal.kv.tags import tenant_tag
from kvseal.protocol import decode as dc
from kvseal.protocol.decode_host import DecodeHost, Held
from kvseal.sim.base import PAGE, Node, Request, new_pool, write_pattern
from kvseal.transfer import messages as P


@dataclass
class Ctx:
    """The simulated decode's own part of a lease's record (``decode_host.Held.ctx``)."""

    req: Request
    serial: int
    router_inc: int
    expires: float


class DecodeNode(Node):
    """The decode worker: the shipped ``DecodeHost`` (and its core), with this node as its ``DecodePorts``: a
    simulated pool, network and clock in place of the engine, Mooncake and asyncio."""

    def boot(self) -> None:
        w = self.w
        self.inc += 1
        self.up = True
        self.core = dc.DecodeCore(w.rng.randbytes(32), self.name, w.k.ttl, max_leases=64, variants=w.variants)
        self.host = DecodeHost(self.core, self, reserve_guard=not w.variants.duplicate_reserve)
        self.pool = new_pool(w.k.decode_pages, w.variants)
        self.quarantined: dict[int, PageRun] = {}
        self.running: dict[int, Held] = {}

    @property
    def admit_limit(self) -> int:
        return self.w.k.decode_pages * PAGE

    def reserve(self, req: Request, r: P.Reserve, router_inc: int, reply: Callable[[object], None]) -> None:
        """As the worker does: check, then take pages, waiting a while (other reserves may arrive meanwhile)
        for a pool that has none to spare now, then open the lease."""
        if not self.up:
            return
        try:
            self.host.begin_reserve(r, "router", self.admit_limit)
        except EngineError as e:
            self.w.log(f"{self.name} refuses reserve rid {r.rid}: {getattr(e, 'code', e)}")
            reply(e)
            return
        inc, need, deadline = self.inc, self.pool.cfg.pages_for(len(r.prompt)), self.w.now + 6.0

        def take() -> None:
            if not self.up or self.inc != inc:
                return
            if not self.pool.can_allocate(need) or self.w.rng.random() < 0.2:  # full, or queued behind others
                if self.w.now < deadline:
                    self.w.at(self.w.rng.uniform(0.2, 2.0), take)
                    return
                self.host.abandon_reserve(r.rid)
                reply(Overloaded("decode pool full"))
                return
            run = self.pool.allocate(r.rid, need, PageState.RESERVED, tenant_tag(r.tenant))
            serial = self.w.next_serial()
            try:
                ctx = Ctx(req, serial, router_inc, self.w.now + self.w.k.ttl)
                cap, acts = self.host.reserved(r, "router", run, ctx, self.w.rng.getrandbits(62), self.w.now)
            except EngineError as e:
                reply(e)
                return
            self.host.carry(acts)
            self.w.log(f"{self.name} leases rid {r.rid} serial {serial} pages {run.pages} gens {run.generations}")
            lease = P.Lease(rid=r.rid, nonce=cap.nonce, pages=list(run.pages), generations=list(run.generations),
                            n_prompt=len(r.prompt), decode_id=self.name, target=f"{self.name}#{self.inc}",
                            layout=list(self.pool.kv.shape), cap=cap)
            reply((lease, serial))

        take()

    def commit(self, c: P.Commit, reply: Callable[[object], None]) -> None:
        if not self.up:
            return
        try:
            acts = self.host.commit(c, self.w.now)
        except EngineError as e:
            self.w.log(f"{self.name} refuses commit rid {c.rid}: {e.code}")
            reply(P.Ack(ok=False, status=e.status, code=e.code))
            return
        self.log_acts(acts)
        for ack in self.host.carry(acts, c):
            self.w.log(f"{self.name} answers commit rid {c.rid}: {ack.ok} {ack.code}")
            reply(ack)

    def log_acts(self, acts: list) -> None:
        for a in acts:
            if not isinstance(a, (dc.Reply, dc.Verify, dc.Expose, dc.Conceal)):
                self.w.log(f"{self.name} {type(a).__name__} rid {a.rid}")

    def carry(self, acts: list) -> None:
        self.log_acts(acts)
        self.host.carry(acts)

    # -- DecodePorts: what the host asks of this node --------------------------------------------------------
    def conceal(self, rid: int) -> None:
        pass  # the simulated transport checks the lease at land(): a concealed lease is one no longer RESERVED

    def quarantine(self, rid: int, run: PageRun) -> None:
        self.quarantined[rid] = self.pool.quarantine(run)

    def free(self, run: PageRun) -> None:
        self.pool.free(run)

    give_back = free

    def release(self, rid: int) -> None:
        run = self.quarantined.pop(rid, None)
        if run is not None:
            self.pool.free(run)

    def verify(self, h: Held, c: P.Commit, tags: bool, checksum: bool) -> tuple[bool, bool]:
        tags_ok = not tags or self.pool.run_ok(h.run, c.rid, PageState.RESERVED, tenant_tag(h.ctx.req.tenant))
        sum_ok = not checksum or P.checksum(self.pool.kv, c.pages, c.n_tokens, c.rid, c.nonce, c.pages,
                                            c.generations, c.first_token) == c.checksum
        return tags_ok, sum_ok

    def expose(self, rid: int, pages: tuple[int, ...]) -> None:
        pass

    def end(self, h: Held, reason: str, error: EngineError | None) -> None:
        self.stream(h, reason, error)

    def start(self, h: Held, first_token: int) -> None:
        """The request reads its prompt's pages: every slot must hold its own lease's bytes."""
        x = h.ctx
        req, rid = x.req, x.req.rid
        self.pool.set_state(h.run, PageState.OWNED)
        kv = self.pool.kv
        for i in range(req.n_prompt):
            page, off = h.run.pages[i // PAGE], i % PAGE
            got = (float(kv[page, 0, 0, 0, off, 0]), float(kv[page, 0, 0, 0, off, 1]))
            if got != (float(x.serial), float(i)):
                self.w.violate(f"request {rid} (lease serial {x.serial}) read page {page} slot {off} holding "
                               f"{got}: not written for it under its lease")
        if req.over_long:
            self.w.violate(f"request {rid} is over-long and was served")
        if self.w.now > x.expires:
            self.w.violate(f"request {rid} started on a lease that expired at t={x.expires:.2f}: its writer's "
                           "capability was dead, the pages no longer promised to it")
        req.served = True
        self.w.log(f"{self.name} starts rid {rid}")
        self.running[rid] = h
        self.w.at(self.w.rng.uniform(0.5, 4.0), lambda: self.finish(rid, h))

    def stop(self, rid: int, reason: str = "abort") -> None:
        """The engine's part: a running request ends, its pages go back, its last event goes out."""
        h = self.running.pop(rid, None)
        if h is not None:
            self.pool.free(h.run)
            self.stream(h, reason, None)

    def finish(self, rid: int, h: Held) -> None:
        if self.up and self.running.get(rid) is h:
            self.stop(rid, "length")
            self.host.finished(rid)

    def stream(self, h: Held, reason: str, error: EngineError | None) -> None:
        """The request's last event, on its router's token stream."""
        router, x = self.w.router, h.ctx
        self.w.send(f"final rid {x.req.rid}", lambda: router.final(x.router_inc, x.req, reason, error))

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
            self.carry(self.host.abort(a))

    def writer_done(self, wd: P.WriterDone) -> None:
        if self.up:
            try:
                self.carry(self.host.writer_done(wd, self.w.now))
            except EngineError:
                pass

    def fence(self, writer: str) -> int | None:
        """Returns the writer's new epoch here (the fence's confirmation), or None if this node is down."""
        if not self.up:
            return None
        self.w.log(f"{self.name} fences {writer}")
        self.carry(self.host.fence(writer))
        return self.core.writer_epoch(writer)

    def tick(self) -> None:
        if self.up:
            self.w.check_ttl(self.core.leases.values())
            self.carry(self.host.expire(self.w.now))
        self.w.at(self.w.k.ttl / 4, self.tick)

    def ask_forget(self, a: dc.AskForget) -> None:
        pre = next(p for p in self.w.prefills if p.name == a.writer)
        inc = self.inc

        def answer(writing: bool) -> None:
            if self.up and self.inc == inc:
                self.carry(self.host.forget_answer(a.rid, a.nonce, writing))

        self.w.send(f"forget rid {a.rid}", lambda: pre.forget(a.rid, a.nonce, answer))

    def router_gone(self, subscriber: str, since: float) -> None:
        if self.up:
            self.carry(self.host.router_gone(subscriber, since))
