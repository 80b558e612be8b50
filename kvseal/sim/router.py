"""The simulated router: the shipped request and health machines, carried out over the simulated network."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvseal.errors import EngineError, Overloaded, Unanswered
from kvseal.protocol import router as rc
from kvseal.protocol.router_host import RouterHost
from kvseal.sim.base import LENGTHS, PAGE, Request, error_status
from kvseal.sim.decode import DecodeNode
from kvseal.sim.prefill import PrefillNode
from kvseal.transfer import messages as P

if TYPE_CHECKING:
    from kvseal.sim.world import World


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
        self.health = {p.name: rc.WorkerHealth(p.name, "prefill", busy_grace=3.0, decodes=(world.decode.name,),
                                               variants=world.variants) for p in world.prefills}
        self.fenced_at: dict[str, tuple[int, int]] = {}  # prefill → (decode incarnation, its epoch) when fenced
        self.seen_inc: dict[str, int] = {}  # prefill → the incarnation its last answered probe showed
        self.restart_seen: dict[str, float] = {}  # prefill → when a probe showed a new process of an unfenced one
        self.host = RouterHost(self)
        self.boot()

    def boot(self) -> None:
        self.inc += 1
        self.up = True
        self.up_since = self.w.now
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

    def expect(self, call: Call, timeout: float, on_timeout: Callable[[], None]) -> Callable[[Callable], Callable]:
        """Arm a timeout for the call's next answer; returns a wrapper that lets only that answer through."""
        call.step += 1
        step, inc = call.step, self.inc

        def fire() -> None:
            if self.up and self.inc == inc and call.step == step:
                call.step += 1
                on_timeout()
                self.done(call)

        self.w.at(timeout, fire)

        def wrap(fn: Callable) -> Callable:
            def answer(x: object) -> None:
                if self.up and self.inc == inc and call.step == step:
                    call.step += 1
                    fn(x)
                    self.done(call)
            return answer
        return wrap

    def carry(self, call: Call, acts: list) -> None:
        self.host.carry(call, acts)
        self.done(call)

    # -- RouterPorts: what the shipped host asks of this node -------------------------------------------------
    def reserve(self, call: Call, answer: Callable[[object], None]) -> None:
        w, req = self.w, call.req
        r = P.Reserve(rid=req.rid, tenant=req.tenant, prompt=[1] * req.n_prompt, max_new=req.max_new,
                      sampling={}, prefill_id=call.prefill.name, subscriber=self.subscriber)
        wrap = self.expect(call, 10.0, lambda: answer(Unanswered("decode unanswered")))

        def on_lease(x: object) -> None:
            if not isinstance(x, BaseException):
                lease, serial = x
                call.nonce, call.serial = lease.nonce, serial
                x = lease
            answer(x)
        reply = wrap(on_lease)
        inc, dec = self.inc, w.decode
        w.send(f"reserve rid {req.rid}", lambda: dec.reserve(
            req, r, inc, lambda x: w.send(f"lease rid {req.rid}", lambda: reply(x))))

    def prefill(self, call: Call, lease: P.Lease, answer: Callable[[object], None]) -> None:
        w, req = self.w, call.req
        msg = P.Prefill(rid=req.rid, tenant=req.tenant, prompt=[1] * req.n_prompt, max_new=req.max_new,
                        sampling={}, lease=lease, decode_url="decode")
        wrap = self.expect(call, 16.0, lambda: answer(Unanswered("prefill unanswered")))
        pre, serial = call.prefill, call.serial

        def on_answer(x: object) -> None:
            if not isinstance(x, BaseException) and x.ok:
                self.health[pre.name].answered(w.now)
            answer(x)
        reply = wrap(on_answer)
        w.send(f"prefill rid {req.rid}", lambda: pre.prefill(
            msg, serial, req, lambda x: w.send(f"prefill answer rid {req.rid}", lambda: reply(x))))

    def forget(self, call: Call, rid: int, nonce: int, answer: Callable[[bool], None]) -> None:
        wrap = self.expect(call, 4.0, lambda: answer(False))
        reply = wrap(lambda writing: answer(not writing))
        pre = call.prefill
        self.w.send(f"router forget rid {rid}", lambda: pre.forget(rid, nonce, reply))

    def abort(self, call: Call, rid: int, nonce: int, writer_done: bool) -> None:
        ab, dec = P.Abort(rid=rid, nonce=nonce, writer_done=writer_done), self.w.decode
        self.w.send(f"abort rid {rid} writer_done={writer_done}", lambda: dec.abort(ab))

    def first_token(self, call: Call, ack: P.Ack) -> None:
        call.first = True
        self.watch(call)

    def fail(self, call: Call, error: EngineError) -> None:
        if not call.req.ended:
            self.w.ended(call.req, error_status(error))

    def cancel(self, call: Call) -> None:
        pass  # the simulated router always guards its steps

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
                was = h.state
                acts = h.probe_ok(w.now, str(p.inc)) if p.up and not slow else h.probe_failed(w.now, timed_out=p.up)
                if p.up and not slow:  # a new process seen while the old one was not fenced: its leases are due
                    if self.seen_inc.get(p.name, p.inc) != p.inc and was is not rc.HealthState.FENCED:
                        self.restart_seen[p.name] = w.now
                    self.seen_inc[p.name] = p.inc
                if was is not rc.HealthState.FENCED and h.state is rc.HealthState.FENCED:
                    self.fenced_at[p.name] = (w.decode.inc, w.decode.core.writer_epoch(p.name))
                if was is rc.HealthState.FENCED and h.state is rc.HealthState.UP:
                    self.check_fenced(p.name)
                for a in acts:
                    if isinstance(a, rc.Fence):
                        self.fence(a)
        w.at(1.0, self.probe)

    def fence(self, a: rc.Fence) -> None:
        """To each decode named; its answer (the new epoch) confirms it, if it comes back."""
        w, inc = self.w, self.inc
        health = self.health[a.url]
        for name in a.to:
            dec = w.decode
            w.log(f"router fences {a.url} on {name}")

            def at_decode(dec: DecodeNode = dec, name: str = name) -> None:
                if dec.fence(a.url) is not None:
                    w.send(f"fence answer {a.url}", lambda: self.up and self.inc == inc and health.confirmed(name))
            w.send(f"fence {a.url}", at_decode)

    def check_fenced(self, prefill: str) -> None:
        """HEALTH's FENCED → UP promises a new epoch for the prefill on every decode: its old capabilities dead."""
        d = self.w.decode
        inc, epoch = self.fenced_at.get(prefill, (0, 0))
        if d.up and d.inc == inc and d.core.writer_epoch(prefill) == epoch:
            self.w.violate(f"router put {prefill} back in service, but {d.name} never moved its epoch after the "
                           "fence: its old capabilities still write there")
