"""The one place decode's lease actions are carried out: the server and the simulator both run this code.

``DecodeCore`` decides; ``DecodeHost`` feeds it (under one lock: the server feeds it from its event loop and its
engine thread) and carries out every action it emits through a small interface, ``DecodePorts``, which is all
that differs between the worker that ships (``kvseal.server.decode``: asyncio, the engine thread, Mooncake) and
the simulated one (``kvseal.sim``: a simulated pool, network and clock). So every action dispatch, every
page record and every lease-state decision exists once, and the simulator exercises the shipped code.

Actions split in two by where they run: ``ENGINE_SIDE`` ones change the pool or the batch and run on the thread
that owns the pool (``on_engine``); the rest (stream events, exposure, Forget requests, replies) run on the
I/O side (``on_loop``). ``carry`` runs both halves in that order; a caller that must hop threads calls them
separately. A lease's record (``Held``) is looked up before either half runs, so an ``End`` whose pages were
released in the same breath still reaches its stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.errors import EngineError
from kvseal.kv.pool import PageRun
from kvseal.protocol import decode as dc
from kvseal.protocol.decode import DecodeCore
from kvseal.transfer import messages as P
from kvseal.transfer.auth import Forbidden


@dataclass(eq=False)
class Held:
    """What the host keeps for a lease the core tracks: the reserve message, its pages, and the adapter's own
    context (where the request's events go)."""

    reserve: P.Reserve
    run: PageRun
    ctx: Any = None


class DecodePorts(Protocol):
    """What a decode host needs from its world. Engine side (the thread that owns the pool):"""

    def conceal(self, rid: int) -> None:
        """The transport stops taking writes into the lease's pages."""

    def quarantine(self, rid: int, run: PageRun) -> None:
        """Pages out of every page table, held (not free) until ``release``."""

    def free(self, run: PageRun) -> None:
        """Pages straight back to the free list (unsafe mode's abort only)."""

    def release(self, rid: int) -> None:
        """Quarantined pages back to the free list: no write can land any more."""

    def stop(self, rid: int) -> None:
        """Stop a running request; its pages are freed as it ends."""

    def verify(self, held: Held, commit: P.Commit, tags: bool, checksum: bool) -> tuple[bool, bool]:
        """Check the pages' tags and the checksum of the bytes now in the pool (each only if asked)."""

    def start(self, held: Held, first_token: int) -> None:
        """Pages OWNED; the request joins the decode batch with its first token."""

    # I/O side
    def give_back(self, run: PageRun) -> None:
        """Pages taken for a reserve that opened no lease go back to the free list."""

    def expose(self, rid: int, pages: tuple[int, ...]) -> None:
        """Let the writer's transport reach these pages."""

    def end(self, held: Held, reason: str, error: EngineError | None) -> None:
        """The request's last event, on its router's stream."""

    def ask_forget(self, a: dc.AskForget) -> None:
        """Ask the writer to Forget the lease; its answer is fed back with ``forget_answer``."""


ENGINE_SIDE = (dc.Conceal, dc.Quarantine, dc.Free, dc.Release, dc.Start, dc.Stop, dc.Verify)


class DecodeHost:
    def __init__(self, core: DecodeCore, ports: DecodePorts, reserve_guard: bool = True) -> None:
        self.core, self.ports = core, ports
        self.lock = threading.Lock()
        self.held: dict[int, Held] = {}
        self.reserving: set[int] = set()  # rids between the reserve's check and its lease: one reserve per rid
        self.reserve_guard = reserve_guard  # off only in the simulator's duplicate_reserve variant (the old code)

    def feed(self, event: Callable[[], Any]) -> Any:
        with self.lock:
            return event()

    # -- reserve: check, (the adapter takes pages, perhaps waiting), lease --------------------------------
    def begin_reserve(self, r: P.Reserve, router: str, admit_limit: int, admission: bool = True,
                      pool_tokens: int = 0, context: int = 0) -> None:
        """Before any page is taken. A second reserve for a rid whose first is still taking pages would take
        pages of its own and overwrite the first's record, leaving that lease with no pages record: refused."""
        with self.lock:
            self.core.check_reserve(r.rid, r.prefill_id, router, len(r.prompt), r.max_new, admit_limit, admission,
                                    pool_tokens, context)
            if self.reserve_guard and (r.rid in self.reserving or r.rid in self.held):
                raise Forbidden(f"request {r.rid} already holds or is taking a lease on this decode")
            self.reserving.add(r.rid)

    def abandon_reserve(self, rid: int) -> None:
        """No pages came (the pool stayed full): nothing was taken."""
        with self.lock:
            self.reserving.discard(rid)

    def reserved(self, r: P.Reserve, router: str, run: PageRun, ctx: Any, nonce: int,
                 now: float) -> tuple[P.Capability, list]:
        """Pages were taken for the reserve: open its lease. If the core refuses, the pages go back
        (``give_back``) and the refusal is raised."""
        held = Held(r, run, ctx)
        with self.lock:
            self.reserving.discard(r.rid)
            if not self.reserve_guard:  # the bug as it shipped once: a duplicate overwrites the first's record
                self.held[r.rid] = held
            try:
                cap, acts = self.core.reserve(r.rid, nonce, r.prefill_id, router, r.subscriber, len(r.prompt),
                                              run.pages, run.generations, now)
            except EngineError:
                if self.held.get(r.rid) is held:
                    self.held.pop(r.rid)
                self.ports.give_back(run)
                raise
            self.held[r.rid] = held
        return cap, acts

    # -- carrying out ----------------------------------------------------------------------------------------
    def records(self, acts: list) -> dict[int, Held]:
        return {a.rid: h for a in acts if (h := self.held.get(getattr(a, "rid", None))) is not None}

    def on_engine(self, acts: list, commit: P.Commit | None = None) -> list:
        """Engine side: the actions that touch the pool or the batch. Returns the rest, in order (a Verify's
        answer included)."""
        out: list = []
        ports = self.ports
        for a in acts:
            h = self.held.get(getattr(a, "rid", None))
            if isinstance(a, dc.Conceal):
                ports.conceal(a.rid)
            elif isinstance(a, dc.Quarantine):
                if h is not None:
                    ports.quarantine(a.rid, h.run)
            elif isinstance(a, dc.Free):
                if h is not None:
                    ports.free(h.run)
                    self.held.pop(a.rid, None)
            elif isinstance(a, dc.Release):
                ports.release(a.rid)
                self.held.pop(a.rid, None)
            elif isinstance(a, dc.Stop):
                ports.stop(a.rid)
                self.held.pop(a.rid, None)
            elif isinstance(a, dc.Verify):
                if commit is not None:
                    out += self.verify(h, commit)
            elif isinstance(a, dc.Start):
                if h is not None:
                    ports.start(h, a.first_token)
            else:
                out.append(a)
        return out

    def verify(self, h: Held | None, c: P.Commit) -> list:
        """Engine side, the lease concealed (no write lands between the check and the first read): the checks
        the core asks for, against the bytes in this pool; its answer is carried out in the same breath. A
        lease aborted meanwhile (its record perhaps gone) is answered as the core says, unread."""
        with self.lock:
            checks = self.core.to_verify(c.rid, c.nonce) if h is not None else None
            tags_ok, sum_ok = self.ports.verify(h, c, *checks) if checks else (False, False)
            acts = self.core.verified(c.rid, c.nonce, tags_ok, sum_ok, c.first_token)
        return self.on_engine(acts)

    def on_loop(self, acts: list, records: dict[int, Held] | None = None) -> list[P.Ack]:
        """I/O side: stream events, exposure, Forget requests. Returns the replies. ``records``: the leases'
        records as they were before ``on_engine`` ran."""
        replies = []
        for a in acts:
            rid = getattr(a, "rid", None)
            h = (records or {}).get(rid) or self.held.get(rid)
            if isinstance(a, dc.End):
                if h is not None:
                    self.ports.end(h, a.reason, a.error)
            elif isinstance(a, dc.Expose):
                self.ports.expose(a.rid, a.pages)
            elif isinstance(a, dc.AskForget):
                self.ports.ask_forget(a)
            elif isinstance(a, dc.Reply):
                replies.append(a.ack)
        return replies

    def carry(self, acts: list, commit: P.Commit | None = None) -> list[P.Ack]:
        """Both halves, in order, on one thread (the simulator; the server's engine-thread callers)."""
        records = self.records(acts)
        return self.on_loop(self.on_engine(acts, commit), records)

    # -- events --------------------------------------------------------------------------------------------
    def commit(self, c: P.Commit, now: float) -> list:
        return self.feed(lambda: self.core.commit(c, now))

    def abort(self, a: P.Abort) -> list:
        return self.feed(lambda: self.core.abort(a.rid, a.nonce, a.writer_done))

    def writer_done(self, w: P.WriterDone, now: float) -> list:
        return self.feed(lambda: self.core.writer_done(w, now))

    def fence(self, writer: str) -> list:
        return self.feed(lambda: self.core.fence(writer))

    def expire(self, now: float) -> list:
        return self.feed(lambda: self.core.expire(now))

    def forget_answer(self, rid: int, nonce: int, writing: bool) -> list:
        return self.feed(lambda: self.core.forget_answer(rid, nonce, writing))

    def router_gone(self, subscriber: str, since: float) -> list:
        return self.feed(lambda: self.core.router_gone(subscriber, since))

    def finished(self, rid: int) -> None:
        """A running request's last event (the engine freed its pages): its lease and record are done."""
        with self.lock:
            self.core.finished(rid)
            self.held.pop(rid, None)

    def holds(self, subscriber: str) -> bool:
        return self.feed(lambda: self.core.holds(subscriber))
