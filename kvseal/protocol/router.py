"""The router's side of the transfer protocol: one machine per request, one per worker's health.

A request:

    -            --start-->   RESERVING     ask decode for a lease
    RESERVING    --lease-->   TRANSFERRING  hand prefill the lease; it computes, writes, commits
    TRANSFERRING --acked-->   STREAMING     decode verified the commit: the first token goes to the client
    TRANSFERRING --unanswered--> FORGETTING prefill never answered: ask it to Forget the lease first
    STREAMING    --final-->   CLOSED

A client that leaves (``left``) never cuts a step in half: the reservation and the transfer run to their end,
then the machine hands back what they left on decode (guarded; ``disconnect_guard``). Unguarded (unsafe, the
2026 load balancer) a transfer is cancelled where it stands and decode is told at once that the writer is done,
while the prefill worker may still be writing.

Abort tells decode whether the writer is known to be done. It is, once prefill answered (success or refusal), or
once a Forget came back "not writing". Otherwise decode keeps the pages QUARANTINED until fencing or the TTL.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvseal.errors import EngineError, Overloaded
from kvseal.protocol.machine import SAFE, Table, Transition, Variants
from kvseal.transfer import messages as P


class RequestState(Enum):
    RESERVING = "reserving"
    TRANSFERRING = "transferring"
    FORGETTING = "forgetting"
    STREAMING = "streaming"


class HealthState(Enum):
    UP = "up"
    DOWN = "down"  # skipped for new requests
    FENCED = "fenced"  # a prefill declared dead on every decode


@dataclass(frozen=True)
class SendReserve:
    rid: int


@dataclass(frozen=True)
class SendPrefill:
    rid: int
    lease: P.Lease


@dataclass(frozen=True)
class SendForget:
    rid: int
    nonce: int


@dataclass(frozen=True)
class SendAbort:
    rid: int
    nonce: int
    writer_done: bool


@dataclass(frozen=True)
class FirstToken:  # decode verified the commit: the client gets its first token
    rid: int
    ack: P.Ack


@dataclass(frozen=True)
class Fail:  # the request ends with this error (a worker's original status and code)
    rid: int
    error: EngineError


@dataclass(frozen=True)
class CancelStep:  # unguarded only: cancel the step in flight
    rid: int


@dataclass(frozen=True)
class Fence:  # declare the prefill dead on these decodes (each answers with its new epoch for it: ``confirmed``)
    url: str
    to: tuple[str, ...] = ()


TABLE = Table("router request", RequestState, [
    Transition("-", "start", "RESERVING", "", "SendReserve"),
    Transition("RESERVING", "lease", "TRANSFERRING", "client still there", "SendPrefill"),
    Transition("RESERVING", "lease", "CLOSED", "client left", "SendAbort(writer done)"),
    Transition("RESERVING", "reserve_failed", "CLOSED", "", "Fail"),
    Transition("TRANSFERRING", "acked", "STREAMING", "client still there", "FirstToken"),
    Transition("TRANSFERRING", "acked", "CLOSED", "client left", "SendAbort(writer done)"),
    Transition("TRANSFERRING", "refused", "CLOSED", "prefill answered with an error", "SendAbort(writer done), Fail"),
    Transition("TRANSFERRING", "unanswered", "FORGETTING", "prefill never answered", "SendForget"),
    Transition("FORGETTING", "forget_answer", "CLOSED", "", "SendAbort(writer done iff not writing), Fail 503"),
    Transition("STREAMING", "final", "CLOSED", "", ""),
    Transition("STREAMING", "left", "CLOSED", "client gone or stream broken", "SendAbort(writer done)"),
    Transition("RESERVING", "left", "RESERVING", "guarded", ""),
    Transition("TRANSFERRING", "left", "TRANSFERRING", "guarded", ""),
    Transition("FORGETTING", "left", "FORGETTING", "guarded", ""),
    Transition("RESERVING", "left", "CLOSED", "unguarded (unsafe)", "CancelStep"),
    Transition("TRANSFERRING", "left", "CLOSED", "unguarded (unsafe)", "CancelStep, SendAbort(writer done)"),
    Transition("FORGETTING", "left", "CLOSED", "unguarded (unsafe)", "CancelStep, SendAbort(writer done)"),
])

HEALTH = Table("router worker health", HealthState, [
    Transition("DOWN", "probe_ok", "UP", "", ""),
    Transition("UP", "probe_ok", "UP", "", ""),
    Transition("FENCED", "probe_ok", "UP", "it came back, and every decode confirmed the fence (a new epoch on each)",
               ""),
    Transition("FENCED", "probe_ok", "FENCED", "a decode has not confirmed the fence", "Fence (to those)"),
    *[Transition(s, "probe_ok", "FENCED", "a prefill answering as a new process: the one that held its leases "
                 "crashed, whatever the misses", "Fence") for s in ("UP", "DOWN")],
    Transition("UP", "probe_failed", "UP", "a timeout, and it answered real work within the busy grace", ""),
    Transition("UP", "probe_failed", "DOWN", "", ""),
    Transition("DOWN", "probe_failed", "DOWN", "fewer than FENCE_AFTER misses, or a decode", ""),
    Transition("DOWN", "probe_failed", "FENCED", "a prefill's FENCE_AFTER-th miss in a row", "Fence"),
    Transition("FENCED", "probe_failed", "FENCED", "", "Fence (to decodes that have not confirmed it)"),
    *[Transition(s, "probe_unhealthy", "DOWN", "it answered, not 200: alive, out of service", "")
      for s in ("UP", "DOWN", "FENCED")],
    Transition("FENCED", "probe_unhealthy", "FENCED", "a decode has not confirmed the fence", "Fence (to those)"),
    Transition("UP", "down", "DOWN", "a request could not reach it", ""),
])


class RouterRequest:
    """One request's protocol state on the router. ``left`` may come at any time; the rest answer the actions."""

    def __init__(self, rid: int, guarded: bool = True) -> None:
        self.rid = rid
        self.guarded = guarded
        self.state: RequestState | None = None
        self.gone = False  # the client left (or its stream broke)
        self.nonce = 0
        self.error: EngineError | None = None  # why prefill's answer never came

    def _move(self, event: str, target: RequestState | None) -> None:
        TABLE.check(self.state.name if self.state else "-", event, target.name if target else "CLOSED")
        self.state = target

    def start(self) -> list:
        self._move("start", RequestState.RESERVING)
        return [SendReserve(self.rid)]

    def lease(self, lease: P.Lease) -> list:
        if self.state is not RequestState.RESERVING:
            return []
        self.nonce = lease.nonce
        if self.gone:  # granted after the client left: nothing was written into it, hand it back
            self._move("lease", None)
            return [SendAbort(self.rid, lease.nonce, True)]
        self._move("lease", RequestState.TRANSFERRING)
        return [SendPrefill(self.rid, lease)]

    def reserve_failed(self, error: EngineError) -> list:
        if self.state is not RequestState.RESERVING:
            return []
        self._move("reserve_failed", None)
        return [Fail(self.rid, error)]

    def acked(self, ack: P.Ack) -> list:
        if self.state is not RequestState.TRANSFERRING:
            return []
        if self.gone:  # committed after the client left: decode started for nobody, stop it
            self._move("acked", None)
            return [SendAbort(self.rid, self.nonce, True)]
        self._move("acked", RequestState.STREAMING)
        return [FirstToken(self.rid, ack)]

    def refused(self, error: EngineError) -> list:
        """Prefill answered with an error: it wrote nothing more."""
        if self.state is not RequestState.TRANSFERRING:
            return []
        self._move("refused", None)
        return [SendAbort(self.rid, self.nonce, True), Fail(self.rid, error)]

    def unanswered(self, error: EngineError | None = None) -> list:
        if self.state is not RequestState.TRANSFERRING:
            return []
        self.error = error
        self._move("unanswered", RequestState.FORGETTING)
        return [SendForget(self.rid, self.nonce)]

    def forget_answer(self, stopped: bool) -> list:
        """Prefill confirmed (``stopped``) that it will never write into the lease, or could not say."""
        if self.state is not RequestState.FORGETTING:
            return []
        self._move("forget_answer", None)
        return [SendAbort(self.rid, self.nonce, stopped),
                Fail(self.rid, self.error or Overloaded(f"prefill never answered request {self.rid}"))]

    def final(self) -> list:
        if self.state is RequestState.STREAMING:
            self._move("final", None)
        return []

    def left(self) -> list:
        """The client is gone, or its token stream broke, before the request's final event."""
        if self.state is None or self.gone:
            return []
        self.gone = True
        if self.state is RequestState.STREAMING:
            self._move("left", None)
            return [SendAbort(self.rid, self.nonce, True)]
        if self.guarded:
            self._move("left", self.state)
            return []
        was = self.state
        self._move("left", None)  # unsafe: as if the cancelled call had stopped the writer
        return [CancelStep(self.rid)] + ([] if was is RequestState.RESERVING else
                                         [SendAbort(self.rid, self.nonce, True)])


class WorkerHealth:
    """A busy worker is not a dead one. A refused connection is death; a probe that times out while the worker
    answered real work within ``busy_grace`` seconds is a busy worker, left in service. Otherwise it is skipped
    at its first miss, and a prefill is fenced only after ``fence_after`` misses in a row, since fencing revokes
    every lease it is writing."""

    def __init__(self, url: str, role: str, fence_after: int = 3, busy_grace: float = 10.0,
                 decodes: tuple[str, ...] = (), variants: Variants = SAFE) -> None:
        self.url, self.role = url, role
        self.fence_after, self.busy_grace = fence_after, busy_grace
        self.state = HealthState.DOWN
        self.misses = 0
        self.last_ok = 0.0  # the time of its last answer: evidence of life that a slow probe cannot erase
        self.decodes = tuple(decodes)  # prefill role: the decodes a fence must reach
        self.unconfirmed: set[str] = set()  # decodes that have not confirmed this prefill's fence
        self.incarnation: str | None = None  # the worker process's start token, from its last answer
        self.variants = variants

    @property
    def healthy(self) -> bool:
        return self.state is HealthState.UP

    def _move(self, event: str, target: HealthState) -> None:
        HEALTH.check(self.state.name, event, target.name)
        self.state = target

    def answered(self, now: float) -> None:
        """Real work answered: evidence of life (not a state change)."""
        self.last_ok = now

    def probe_ok(self, now: float, incarnation: str | None = None) -> list:
        """A fenced prefill comes back only once every decode has moved its epoch on: a decode that missed the
        fence (unreachable, or the message lost) would still take its old capabilities.

        ``incarnation``: the token the worker drew when its process started. A prefill that answers with a new
        one crashed and restarted, perhaps between two probes or in fewer than ``fence_after`` misses; its
        leases the router could not settle (a Forget that found nobody) wait in QUARANTINED for a WriterDone
        the dead process will never send. They are fenced now, not at the TTL."""
        restarted = (self.incarnation is not None and incarnation is not None and incarnation != self.incarnation
                     and not self.variants.restart_unfenced)
        self.incarnation = incarnation or self.incarnation
        self.misses, self.last_ok = 0, now
        if restarted and self.role == "prefill" and self.state is not HealthState.FENCED:
            self._move("probe_ok", HealthState.FENCED)
            self.unconfirmed = set(self.decodes)
            return [Fence(self.url, self.decodes)]
        if self.state is HealthState.FENCED and (owed := self._owed()):
            self._move("probe_ok", HealthState.FENCED)
            return owed
        self._move("probe_ok", HealthState.UP)
        return []

    def _owed(self) -> list:
        """The fence again, to the decodes that have not confirmed it."""
        if not self.unconfirmed or self.variants.unconfirmed_fence:
            return []
        return [Fence(self.url, tuple(sorted(self.unconfirmed)))]

    def confirmed(self, decode: str) -> None:
        """``decode`` answered this prefill's fence: its epoch for it moved on."""
        self.unconfirmed.discard(decode)

    def probe_failed(self, now: float, timed_out: bool) -> list:
        if timed_out and now - self.last_ok < self.busy_grace:  # busy, not dead: no miss
            self._move("probe_failed", self.state)
            return []
        self.misses += 1
        if self.state is HealthState.UP:
            self._move("probe_failed", HealthState.DOWN)
        if self.role == "prefill" and self.misses == self.fence_after and self.state is HealthState.DOWN:
            self._move("probe_failed", HealthState.FENCED)
            self.unconfirmed = set(self.decodes)
            return [Fence(self.url, self.decodes)]
        self._move("probe_failed", self.state)
        return self._owed() if self.state is HealthState.FENCED else []

    def probe_unhealthy(self, now: float) -> list:
        self.misses, self.last_ok = 0, now
        if self.state is HealthState.FENCED and (owed := self._owed()):
            self._move("probe_unhealthy", HealthState.FENCED)
            return owed
        self._move("probe_unhealthy", HealthState.DOWN)
        return []

    def down(self) -> None:
        """A request could not reach it (refused, reset): skip it until a probe says otherwise."""
        if self.state is HealthState.UP:
            self._move("down", HealthState.DOWN)
