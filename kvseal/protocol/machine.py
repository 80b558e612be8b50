"""What every protocol machine shares: declared transitions, the actions they emit, and the known-bad switches.

A machine is sans-IO: an event goes in (a method call with plain values, the time included), a list of actions
comes out, and nothing else happens. The adapters in ``kvseal.server`` parse messages, feed the machine and
carry out its actions; the simulator (``kvseal.sim``) does the same with a simulated network.

Each machine declares its transitions as data (``Transition`` rows). A move that is not declared raises, so the
table is what the code does: ``docs/protocol.md`` is generated from it, and the formal models are checked
against it (``tests/test_protocol_models.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum


class ProtocolBug(AssertionError):
    """A machine was asked for a move its table does not declare: a bug in the machine or its adapter."""


@dataclass(frozen=True)
class Transition:
    source: str  # a state name; "-" for a record that does not exist yet
    event: str
    target: str  # a state name; "CLOSED" for a record the machine forgets
    guard: str = ""  # when this row applies (words, for the docs)
    actions: str = ""  # what it emits (words, for the docs)


class Table:
    """One machine's declared transitions, and the check that a move is one of them."""

    def __init__(self, name: str, states: type[Enum], rows: list[Transition]) -> None:
        self.name, self.states, self.rows = name, states, rows
        self._moves = {(r.source, r.event, r.target) for r in rows}
        names = {s.name for s in states} | {"-", "CLOSED"}
        for r in rows:
            if r.source not in names or r.target not in names:
                raise ValueError(f"{name}: {r} names an unknown state")

    @property
    def events(self) -> list[str]:
        return sorted({r.event for r in self.rows})

    def check(self, source: str, event: str, target: str) -> None:
        if (source, event, target) not in self._moves:
            raise ProtocolBug(f"{self.name}: {source} --{event}--> {target} is not a declared transition")

    def markdown(self) -> str:
        out = ["| state | event | guard | next state | actions |", "|---|---|---|---|---|"]
        out += [f"| {r.source} | {r.event} | {r.guard} | {r.target} | {r.actions} |" for r in self.rows]
        return "\n".join(out)


@dataclass(frozen=True)
class Variants:
    """Known-bad protocol variants, each a bug the simulator and the formal models must find. Used only by the
    simulator, the models and their tests; the services never set one (the ``Protections`` switches are the
    operator-facing, unsafe-mode equivalents of some of these)."""

    placeholder: bool = False  # prefill swaps a prompt it cannot hold for a 1-token placeholder, commits it (2026)
    free_on_abort: bool = False  # decode frees an aborted lease's pages at once, without WriterDone
    no_coverage: bool = False  # decode accepts a commit that covers less than the lease
    lease_reuse: bool = False  # a lease's nonce is its request id and freed pages keep their generation
    fence_without_epoch: bool = False  # fencing frees the writer's pages but does not move its epoch on
    commit_after_expiry: bool = False  # decode accepts a commit whose lease has expired
    # bugs of the hosts (the code that carries the machines' actions out), which only the simulator runs:
    duplicate_reserve: bool = False  # decode records a reserve before its lease opens, with no one-per-rid guard
    unconfirmed_fence: bool = False  # the router fences once, and a prefill fenced on no decode may come back
    restart_unfenced: bool = False  # the router ignores a prefill's new start token: back within 3 probes, unfenced

    NAMES = ("placeholder", "free_on_abort", "no_coverage", "lease_reuse", "fence_without_epoch",
             "commit_after_expiry")  # each found by the simulator and by both formal models
    SIM_NAMES = ("duplicate_reserve", "unconfirmed_fence", "restart_unfenced")  # found by the simulator

    @classmethod
    def only(cls, name: str) -> Variants:
        if name not in cls.NAMES + cls.SIM_NAMES:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(cls.NAMES + cls.SIM_NAMES)}")
        return cls(**{name: True})

    def on(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


SAFE = Variants()
