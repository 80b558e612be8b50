"""The one place prefill's transfer actions are carried out: the server and the simulator both run this code.

``PrefillCore`` decides; ``PrefillHost`` feeds it (under one lock: the server feeds it from its event loop and
its engine thread) and carries out what it emits through ``PrefillPorts``: the engine's side (stop computing,
release this worker's pages) and the I/O side (send the commit, tell decode the writer is done, answer the
router). ``kvseal.server.prefill`` implements the ports over the engine thread and httpx, ``kvseal.sim``
over a simulated pool and network. ``Write`` and ``Admit`` are not dispatched: each is the next step of the
caller that fed the event (compute the prompt; write its pages), and the caller reads them from the list.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from kvseal.protocol import prefill as pc
from kvseal.protocol.prefill import PrefillCore


class PrefillPorts(Protocol):
    """Engine side (the thread that owns this worker's pool):"""

    def stop(self, rid: int, nonce: int) -> None:
        """Stop computing the request; its pages go back."""

    def release(self, rid: int, nonce: int) -> None:
        """This worker's pages for the request go back to its pool."""

    # I/O side
    def send_commit(self, rid: int, nonce: int) -> None:
        """Send the prepared commit to decode; its answer is fed back with ``acked``."""

    def writer_done(self, rid: int, nonce: int) -> None:
        """Tell decode no write of ours can land in the lease any more."""

    def settle(self, rid: int, nonce: int, result: object) -> None:
        """The router's answer: an Ack, or an error."""


ENGINE_SIDE = (pc.StopCompute, pc.ReleaseOwn)


class PrefillHost:
    def __init__(self, core: PrefillCore, ports: PrefillPorts) -> None:
        self.core, self.ports = core, ports
        self.lock = threading.Lock()

    def feed(self, event: Callable[[], Any]) -> Any:
        with self.lock:
            return event()

    @staticmethod
    def split(acts: list) -> tuple[list, list]:
        """(engine side, I/O side), each in order."""
        return [a for a in acts if isinstance(a, ENGINE_SIDE)], [a for a in acts if not isinstance(a, ENGINE_SIDE)]

    def on_engine(self, acts: list, nonce: int) -> None:
        for a in acts:
            if isinstance(a, pc.StopCompute):
                self.ports.stop(a.rid, nonce)
            elif isinstance(a, pc.ReleaseOwn):
                self.ports.release(a.rid, nonce)

    def on_loop(self, acts: list, nonce: int) -> None:
        for a in acts:
            if isinstance(a, pc.SendCommit):
                self.ports.send_commit(a.rid, nonce)
            elif isinstance(a, pc.SendWriterDone):
                self.ports.writer_done(a.rid, a.nonce)
            elif isinstance(a, pc.Settle):
                self.ports.settle(a.rid, nonce, a.result)

    def carry(self, acts: list, nonce: int) -> None:
        """Both sides, engine first, on one thread (the simulator; the server's engine thread)."""
        engine, loop = self.split(acts)
        self.on_engine(engine, nonce)
        self.on_loop(loop, nonce)
