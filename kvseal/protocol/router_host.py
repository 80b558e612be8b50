"""The one place a router request's actions are carried out: the router service and the simulator both run it.

``RouterRequest`` decides; ``RouterHost`` dispatches each action it emits to ``RouterPorts`` and feeds each
answer back to the machine, with one mapping from answers to events (a lease or a refusal; prefill's Ack, its
refusal, or no answer at all; Forget confirmed or not). The ports own the transport: the service sends HTTP
from asyncio tasks (``kvseal.server.router``), the simulator sends messages over its lossy network with its
own timeouts (``kvseal.sim``). A port answers by calling the ``answer`` it was given, at most once per step.

A flight is the adapter's record of one request; it carries the request's machine as ``flight.m``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvseal.errors import EngineError, Unanswered
from kvseal.protocol import router as rp
from kvseal.transfer import messages as P


class RouterPorts(Protocol):
    def reserve(self, flight: Any, answer: Callable[[object], None]) -> None:
        """Ask decode for a lease: ``answer(lease)``, or ``answer(error)``."""

    def prefill(self, flight: Any, lease: P.Lease, answer: Callable[[object], None]) -> None:
        """Hand the transfer to prefill: ``answer(ack)``; ``answer(Unanswered)`` if it never answered (then what
        it did is unknown); ``answer(error)`` if it refused (then it writes nothing more)."""

    def forget(self, flight: Any, rid: int, nonce: int, answer: Callable[[bool], None]) -> None:
        """Ask prefill to Forget the lease: ``answer(True)`` only if it confirmed it will never write into it."""

    def abort(self, flight: Any, rid: int, nonce: int, writer_done: bool) -> None:
        """Tell decode to abort the lease (``writer_done``: no write of prefill's can land any more)."""

    def first_token(self, flight: Any, ack: P.Ack) -> None:
        """Decode verified the commit: the client gets its first token; the rest streams from decode."""

    def fail(self, flight: Any, error: EngineError) -> None:
        """The request ends with this error."""

    def cancel(self, flight: Any) -> None:
        """Unsafe mode only (no disconnect guard): cut the step in flight, as a cancelled call would."""


class RouterHost:
    def __init__(self, ports: RouterPorts) -> None:
        self.ports = ports

    def carry(self, flight: Any, acts: list) -> None:
        m, ports = flight.m, self.ports
        for a in acts:
            if isinstance(a, rp.SendReserve):
                ports.reserve(flight, lambda x: self.carry(flight, m.reserve_failed(x) if isinstance(
                    x, BaseException) else m.lease(x)))
            elif isinstance(a, rp.SendPrefill):
                ports.prefill(flight, a.lease, lambda x: self.carry(flight, prefill_answer(m, x)))
            elif isinstance(a, rp.SendForget):
                ports.forget(flight, a.rid, a.nonce, lambda stopped: self.carry(flight, m.forget_answer(stopped)))
            elif isinstance(a, rp.SendAbort):
                ports.abort(flight, a.rid, a.nonce, a.writer_done)
            elif isinstance(a, rp.FirstToken):
                ports.first_token(flight, a.ack)
            elif isinstance(a, rp.Fail):
                ports.fail(flight, a.error)
            elif isinstance(a, rp.CancelStep):
                ports.cancel(flight)


def prefill_answer(m: rp.RouterRequest, x: object) -> list:
    """What prefill's answer means: none at all (unknown what it wrote), a refusal (it writes no more), or an
    Ack, which is a refusal unless ``ok``."""
    if isinstance(x, Unanswered):
        return m.unanswered(x)
    if isinstance(x, BaseException):
        return m.refused(x)
    if not x.ok:
        e = EngineError(x.message or x.code)
        e.status, e.code = x.status, x.code
        return m.refused(e)
    return m.acked(x)
