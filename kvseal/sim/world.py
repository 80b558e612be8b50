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
   drains back to the free list;
6. a quarantined lease whose writer restarted is settled by the router's fence, not left to the TTL: once the
   router has seen a new process of a prefill it had not fenced (and stayed up), the leases born before are
   gone within ``FENCE_LATENCY`` (checked when decode's TTL comes for a lease). The dead process will never
   send their WriterDone; without the fence their pages wait for the TTL (120 s by default).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable

from kvseal.protocol.decode import Lease, LeaseState
from kvseal.protocol.machine import SAFE, Variants
from kvseal.sim.base import Knobs, Request, Violation
from kvseal.sim.decode import DecodeNode
from kvseal.sim.prefill import PrefillNode
from kvseal.sim.router import RouterNode

FENCE_LATENCY = 6.0  # a probe each time unit, messages up to 2 late, the fence resent until every decode confirms


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

    def check_ttl(self, leases: Iterable[Lease]) -> None:
        """Invariant 6, for decode's open leases when its TTL sweep runs."""
        r = self.router
        for lease in leases:
            seen = r.restart_seen.get(lease.writer)
            if (seen is not None and lease.state is LeaseState.QUARANTINED and self.now - lease.born >= self.k.ttl
                    and lease.born < seen and r.up and r.up_since <= seen and self.now - seen >= FENCE_LATENCY):
                self.violate(f"lease rid {lease.rid} ({lease.state.name}) waited for the TTL: its writer "
                             f"{lease.writer} restarted and the router saw it back at t={seen:.2f}, unfenced")

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
