"""Prefill's side of the transfer protocol: admit → compute → write the lease → commit → release.

    -          --prefill-->   COMPUTING   admitted (final: a request that can never fit is refused here, before
                                          any page is taken or byte moved; there is no placeholder path)
    COMPUTING  --prefilled--> WRITING     the prompt's KV and first token are ready: write the leased pages
    WRITING    --written-->   COMMITTING  the commit (with the checksum) is on its way to decode
    COMMITTING --acked-->     CLOSED      decode answered (or is unreachable): this worker's pages may go, and
                                          after a refusal WriterDone tells decode no write of ours can land
    COMPUTING  --forget-->    CLOSED      decode or the router withdrew the lease before a byte was written

A forgotten lease is refused for good (its nonce is remembered), so a prefill request that arrives after its
lease expired never writes. ``forget`` answers whether a write may still land: only a lease in WRITING or
COMMITTING says yes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvseal.errors import ContextLengthError, EngineError, Overloaded
from kvseal.protocol.machine import SAFE, Table, Transition, Variants
from kvseal.transfer import messages as P

FORGOTTEN_MAX = 100_000


class WriteState(Enum):
    COMPUTING = "computing"  # admitted: queued or prefilling, nothing written
    WRITING = "writing"  # page writes into the lease in progress
    COMMITTING = "committing"  # written; the commit is on its way, decode has not answered


class LeaseExpired(EngineError):
    status = 503
    code = "lease_expired"


@dataclass(frozen=True)
class Admit:  # start computing the prompt (``placeholder``: a 1-token stand-in, the 2026 bug)
    rid: int
    placeholder: bool = False


@dataclass(frozen=True)
class StopCompute:  # the request is withdrawn before any write: stop it, free this worker's pages
    rid: int


@dataclass(frozen=True)
class Write:  # write the prompt's pages into the lease
    rid: int


@dataclass(frozen=True)
class SendCommit:
    rid: int


@dataclass(frozen=True)
class ReleaseOwn:  # this worker's pages for the request go back to its pool
    rid: int


@dataclass(frozen=True)
class SendWriterDone:  # tell decode no write of ours can land in the lease any more
    rid: int
    nonce: int


@dataclass(frozen=True)
class Settle:  # the router's answer: an Ack, or an error
    rid: int
    result: object


TABLE = Table("prefill transfer", WriteState, [
    Transition("-", "prefill", "COMPUTING", "fits, lease not forgotten", "Admit"),
    Transition("COMPUTING", "prefill", "COMPUTING", "a duplicate: its answer is already coming", ""),
    Transition("WRITING", "prefill", "WRITING", "a duplicate: its answer is already coming", ""),
    Transition("COMMITTING", "prefill", "COMMITTING", "a duplicate: its answer is already coming", ""),
    Transition("COMPUTING", "prefilled", "WRITING", "", "Write"),
    Transition("WRITING", "written", "COMMITTING", "the write succeeded", "SendCommit"),
    Transition("WRITING", "written", "CLOSED", "the write failed", "ReleaseOwn, Settle 503"),
    Transition("COMMITTING", "acked", "CLOSED", "accepted", "ReleaseOwn, Settle ack"),
    Transition("COMMITTING", "acked", "CLOSED", "refused or undelivered", "ReleaseOwn, SendWriterDone, Settle"),
    Transition("COMPUTING", "forget", "CLOSED", "", "StopCompute, Settle 503"),
    Transition("WRITING", "forget", "WRITING", "a write may land", ""),
    Transition("COMMITTING", "forget", "COMMITTING", "a write may land", ""),
    Transition("COMPUTING", "failed", "CLOSED", "the engine failed it", "Settle error"),
])


@dataclass(eq=False)
class Transfer:
    rid: int
    nonce: int
    state: WriteState = WriteState.COMPUTING


class PrefillCore:
    def __init__(self, admission: bool = True, deferred_release: bool = True, variants: Variants = SAFE) -> None:
        self.admission = admission
        self.deferred_release = deferred_release
        self.variants = variants
        self.transfers: dict[int, Transfer] = {}
        # nonces of leases withdrawn or already done with: never written (again). Bounded, oldest dropped: a lease
        # that old is long gone on decode, which refuses its commit anyway.
        self.forgotten: dict[int, None] = {}

    def _move(self, t: Transfer, event: str, target: WriteState | None) -> None:
        TABLE.check(t.state.name, event, target.name if target else "CLOSED")
        if target is None:  # a lease is written at most once: a late copy of its Prefill is refused
            self.transfers.pop(t.rid, None)
            self._remember(t.nonce)
        else:
            t.state = target

    def _remember(self, nonce: int) -> None:
        self.forgotten[nonce] = None
        if len(self.forgotten) > FORGOTTEN_MAX:
            del self.forgotten[next(iter(self.forgotten))]

    def _get(self, rid: int, nonce: int | None = None) -> Transfer | None:
        t = self.transfers.get(rid)
        return t if t is not None and (nonce is None or t.nonce == nonce) else None

    def prefill(self, rid: int, nonce: int, n_prompt: int, max_new: int, admit_limit: int, context: int = 0,
                pool_tokens: int = 0, placeholder_fault: bool = False) -> list:
        """Admission comes first and is final. ``placeholder_fault``: the ``legacy_placeholder`` fault point
        brings the 2026 bug (the ``placeholder`` variant) to this one request."""
        if nonce in self.forgotten:
            raise LeaseExpired(f"request {rid}: its lease was withdrawn, or already written")
        old = self.transfers.get(rid)  # first: a copy must not be judged again
        if old is not None and old.nonce == nonce:  # the same message again: its answer is already coming
            self._move(old, "prefill", old.state)
            return []
        if old is not None:
            raise Overloaded(f"request {rid} is already being prefilled here, for another lease")  # retry later
        too_long = n_prompt + max_new > admit_limit
        placeholder = too_long and (self.variants.placeholder or placeholder_fault)
        if too_long and self.admission and not placeholder:
            self._remember(nonce)  # refused is final: a late copy of this Prefill is refused too, never written
            raise ContextLengthError(n_prompt, max_new, context, pool_tokens)
        TABLE.check("-", "prefill", "COMPUTING")
        self.transfers[rid] = Transfer(rid, nonce)
        return [Admit(rid, placeholder)]

    def computing(self, rid: int, nonce: int) -> bool:
        """Whether the engine should (still) compute ``rid``: a lease forgotten meanwhile never reaches it."""
        t = self._get(rid, nonce)
        return t is not None and t.state is WriteState.COMPUTING

    def prefilled(self, rid: int, nonce: int) -> list:
        """The engine has the prompt's KV and first token. Write, unless the lease was withdrawn meanwhile.
        Every event after ``prefill`` names the lease (``rid`` and ``nonce``): request ids may come back."""
        t = self._get(rid, nonce)
        if t is None or t.state is not WriteState.COMPUTING:
            return [ReleaseOwn(rid)]
        self._move(t, "prefilled", WriteState.WRITING)
        return [Write(rid)]

    def written(self, rid: int, nonce: int, error: EngineError | None = None) -> list:
        t = self._get(rid, nonce)
        if t is None:
            return [ReleaseOwn(rid)]
        if error is not None:
            self._move(t, "written", None)
            return [ReleaseOwn(rid), Settle(rid, error)]
        self._move(t, "written", WriteState.COMMITTING)
        early = [] if self.deferred_release else [ReleaseOwn(rid)]  # unsafe: free before decode has answered
        return early + [SendCommit(rid)]

    def acked(self, rid: int, nonce: int, ack: P.Ack) -> list:
        """Decode's answer to the commit, or the commit undelivered (``ok=False``). Deferred release: this
        worker's pages go only now."""
        t = self._get(rid, nonce)
        if t is None or t.state is not WriteState.COMMITTING:
            return []
        nonce = t.nonce
        self._move(t, "acked", None)
        acts: list = [ReleaseOwn(rid)] if self.deferred_release else []
        if not ack.ok:
            acts.append(SendWriterDone(rid, nonce))
        return acts + [Settle(rid, ack)]

    def failed(self, rid: int, nonce: int, error: EngineError) -> list:
        t = self._get(rid, nonce)
        if t is None or t.state is not WriteState.COMPUTING:
            return []
        self._move(t, "failed", None)
        return [Settle(rid, error)]

    def forget(self, rid: int, nonce: int) -> tuple[bool, list]:
        """Stop, or never start, writing into the lease ``(rid, nonce)``. Returns (a write may still land,
        actions)."""
        self._remember(nonce)
        t = self._get(rid, nonce)
        if t is None:
            return False, []
        if t.state is WriteState.COMPUTING:
            self._move(t, "forget", None)
            return False, [StopCompute(rid), Settle(rid, LeaseExpired(
                f"request {rid}: its lease was withdrawn before prefill wrote it"))]
        self._move(t, "forget", t.state)
        return True, []
