"""Decode's side of the transfer protocol: one state machine per lease, and the capabilities that bind them.

A lease is the pages of one request's prompt, RESERVED in decode's pool for one writer (a prefill worker) to
fill. Its life:

    -        --reserve-->   RESERVED     pages tagged for the request; writes may land
    RESERVED --commit-->    VERIFYING    capability, nonce and coverage passed; tags and checksum next
    VERIFYING --verified--> RUNNING      the pages are OWNED and the request decodes
    any open --abort/expire/bad commit--> QUARANTINED   nobody reads them, nobody reuses them
    QUARANTINED --writer_done / forget_answer(not writing) / fence--> CLOSED   the pages are freed

The rule that keeps a late write out of another request's pages: pages a writer may still target are never
freed until that writer has said it stopped (WriterDone, or a Forget answered "not writing") or has been fenced,
which moves its epoch on so that its capability, on the data plane as on the control plane, is dead.

Every method is an event: plain values in (the time included), a list of actions out. A refusal (a message that
changes nothing) raises the ``EngineError`` to answer with. The machine holds no pool, no engine, no clock.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum

import msgspec

from kvseal.errors import (
    ContextLengthError,
    EngineError,
    KVIntegrityError,
    Overloaded,
    TooManyRequests,
)
from kvseal.protocol.machine import SAFE, Table, Transition, Variants
from kvseal.transfer import messages as P
from kvseal.transfer.auth import Forbidden


class LeaseState(Enum):
    RESERVED = "reserved"  # pages tagged for the request; its writer may write them
    VERIFYING = "verifying"  # a commit passed the message checks; tags and checksum against the pool next
    RUNNING = "running"  # verified: pages OWNED, the request decodes
    QUARANTINED = "quarantined"  # revoked while a write may still land: nobody reads or reuses the pages


class GrantedBeforeRestart(Overloaded):
    """A capability this decode's address granted before the worker restarted: the lease, its pages and the key
    that signed it died with that process. A fault (503), not a forgery (403): the client may retry."""

    code = "decode_restarted"


class WriterFenced(EngineError):
    """A capability from before its writer was fenced, or past its expiry: that writer is dead to this decode."""

    status = 410
    code = "writer_fenced"


class LeaseRevoked(Overloaded):
    """A commit for a lease that was aborted or fenced: refused, nothing read. A fault, not corruption."""

    code = "lease_revoked"


# -- actions: what the adapter carries out ------------------------------------------------------------------
@dataclass(frozen=True)
class Expose:  # let the writer's transport reach these pages (Mooncake registers them)
    rid: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Conceal:  # the transport stops taking writes into the lease's pages
    rid: int


@dataclass(frozen=True)
class Verify:  # check the pages' tags and the checksum of the bytes now in the pool; answer with verified()
    rid: int
    nonce: int


@dataclass(frozen=True)
class Start:  # pages OWNED; the request joins the decode batch with its first token
    rid: int
    first_token: int


@dataclass(frozen=True)
class Stop:  # stop a running request (its pages are freed as it ends)
    rid: int


@dataclass(frozen=True)
class Quarantine:  # pages out of every page table, not back on the free list
    rid: int


@dataclass(frozen=True)
class Free:  # pages straight back to the free list
    rid: int


@dataclass(frozen=True)
class Release:  # quarantined pages back to the free list: no write can land any more
    rid: int


@dataclass(frozen=True)
class End:  # the request's last event on its router's stream
    rid: int
    reason: str
    error: EngineError | None = None


@dataclass(frozen=True)
class Reply:  # the answer to the commit being handled
    ack: P.Ack


@dataclass(frozen=True)
class AskForget:  # ask the writer to stop (or never start) writing this lease; answer with forget_answer()
    rid: int
    nonce: int
    writer: str


# -- the table ------------------------------------------------------------------------------------------------
_OPEN = ("RESERVED", "VERIFYING")
TABLE = Table("decode lease", LeaseState, [
    Transition("-", "reserve", "RESERVED", "admitted, pages taken", "Expose"),
    Transition("RESERVED", "commit", "VERIFYING", "capability, nonce and coverage hold", "Conceal, Verify"),
    Transition("RESERVED", "commit", "QUARANTINED", "coverage fails", "Conceal, Quarantine, End 500, Reply"),
    Transition("VERIFYING", "verified", "RUNNING", "tags and checksum hold", "Start, Reply ok"),
    Transition("VERIFYING", "verified", "QUARANTINED", "tags or checksum fail", "Quarantine, End 500, Reply"),
    Transition("RUNNING", "commit", "RUNNING", "a duplicate", "Reply 409"),
    Transition("QUARANTINED", "verified", "QUARANTINED", "aborted while verifying", "Reply 503"),
    *[Transition(s, "abort", "QUARANTINED", "", "Conceal, Quarantine, End abort") for s in _OPEN],
    *[Transition(s, "abort", "CLOSED", "the writer is known done", "Conceal, Quarantine, End abort, Release")
      for s in _OPEN],
    Transition("RUNNING", "abort", "CLOSED", "", "Stop"),
    Transition("QUARANTINED", "abort", "CLOSED", "the writer is known done", "Release"),
    Transition("QUARANTINED", "writer_done", "CLOSED", "", "Release"),
    *[Transition(s, "fence", "CLOSED", "its writer", "Conceal, Quarantine, End abort, Release") for s in _OPEN],
    Transition("QUARANTINED", "fence", "CLOSED", "its writer", "Release"),
    *[Transition(s, "expire", "QUARANTINED", "older than the TTL", "Conceal, Quarantine, End abort, AskForget")
      for s in _OPEN],
    Transition("QUARANTINED", "expire", "QUARANTINED", "older than the TTL", "AskForget"),
    Transition("QUARANTINED", "forget_answer", "CLOSED", "the writer is not writing", "Release"),
    *[Transition(s, "router_gone", "QUARANTINED", "reserved before it left", "Conceal, Quarantine, End abort")
      for s in _OPEN],
    Transition("RUNNING", "router_gone", "CLOSED", "reserved before it left", "Stop"),
    Transition("RUNNING", "finished", "CLOSED", "", ""),
    *[Transition(s, e, "CLOSED", "deferred release off (unsafe)", "Conceal, Free, End abort")
      for s in _OPEN for e in ("abort", "expire", "router_gone")],
])


@dataclass(eq=False)
class Lease:
    rid: int
    nonce: int
    writer: str  # the prefill that writes it
    router: str  # the node that reserved it
    subscriber: str  # the router stream its tokens go to
    n_prompt: int
    pages: tuple[int, ...]  # the prompt's pages, as reserved
    generations: tuple[int, ...]
    born: float
    expires: float  # 0: never
    state: LeaseState = LeaseState.RESERVED
    checksum: str = ""  # the accepted commit's


class DecodeCore:
    """Every open lease of one decode worker, and the rules that move them."""

    def __init__(self, key: bytes, decode_id: str, lease_ttl: float = 0.0, max_leases: int = 2048,
                 coverage: bool = True, deferred_release: bool = True, page_tags: bool = True,
                 checksum: bool = True, variants: Variants = SAFE) -> None:
        self.key = key  # MACs capabilities; never leaves the decode worker
        self.decode_id = decode_id
        self.lease_ttl = lease_ttl
        self.max_leases = max_leases
        self.coverage = coverage and not variants.no_coverage
        self.deferred_release = deferred_release and not variants.free_on_abort
        self.page_tags, self.checksum = page_tags, checksum  # what Verify checks (both off only in unsafe mode)
        self.variants = variants
        self.leases: dict[int, Lease] = {}
        self.epochs: dict[str, int] = {}  # writer → epoch; fencing moves it on
        # leases that ended without a verified transfer, by reason (coverage, tag, checksum, fence, timeout):
        # counts for /metrics, no decision reads them
        self.refused: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[str, int]] = collections.deque(maxlen=20)  # (reason, rid), newest last

    def _move(self, lease: Lease, event: str, target: LeaseState | None) -> None:
        TABLE.check(lease.state.name, event, target.name if target else "CLOSED")
        if target is None:
            self.leases.pop(lease.rid, None)
        else:
            lease.state = target

    # -- capabilities ---------------------------------------------------------------------------------------
    def _mac(self, c: P.Capability) -> str:
        body = msgspec.msgpack.encode([c.rid, c.nonce, c.decode_id, c.writer, c.epoch, c.pages, c.generations,
                                       c.expires])
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def capability(self, lease: Lease) -> P.Capability:
        c = P.Capability(rid=lease.rid, nonce=lease.nonce, decode_id=self.decode_id, writer=lease.writer,
                         epoch=self.epochs.get(lease.writer, 0), pages=list(lease.pages),
                         generations=list(lease.generations), expires=lease.expires)
        c.mac = self._mac(c)
        return c

    def check_cap(self, c: P.Capability | None, rid: int, nonce: int, pages: list[int], now: float) -> None:
        """403 unless ``c`` is a capability this decode granted for this very lease and covers ``pages``; 410 if
        its writer was fenced since or it expired. Stateless but for the epochs: a forged or foreign capability
        never reaches a lease. A decode id is ``address#incarnation`` where the worker names its incarnation: a
        capability of this address's earlier incarnation is refused as a restart (503), before its MAC (signed
        with a key that died with that process) could call it a forgery."""
        if c is not None and c.decode_id != self.decode_id and "#" in self.decode_id \
                and c.decode_id.partition("#")[0] == self.decode_id.partition("#")[0]:
            raise GrantedBeforeRestart(f"request {rid}: the lease was granted by {c.decode_id}, "
                                       f"which has restarted as {self.decode_id}")
        if c is None or not hmac.compare_digest(self._mac(c), c.mac):
            raise Forbidden(f"request {rid}: no valid lease capability")
        if c.rid != rid or c.nonce != nonce or c.decode_id != self.decode_id:
            raise Forbidden(f"request {rid}: the capability is for another lease")
        if not set(pages) <= set(c.pages):
            raise Forbidden(f"request {rid}: pages outside the lease")
        if c.epoch != self.epochs.get(c.writer, 0):
            raise WriterFenced(f"request {rid}: writer {c.writer} was fenced")
        if c.expires and now > c.expires and not self.variants.commit_after_expiry:
            raise WriterFenced(f"request {rid}: the lease expired")

    def writer_epoch(self, writer: str) -> int:
        """What the data plane checks a write's capability against (a fenced writer's writes are refused)."""
        return self.epochs.get(writer, 0)

    # -- reserve --------------------------------------------------------------------------------------------
    def check_reserve(self, rid: int, writer: str, router: str, n_prompt: int, max_new: int, admit_limit: int,
                      admission: bool = True, pool_tokens: int = 0, context: int = 0) -> None:
        """Before any page is taken: one lease per request id, the open-lease bounds, then admission (a request
        that can never fit)."""
        old = self.leases.get(rid)
        if old is not None and old.state is LeaseState.QUARANTINED:  # a reused id whose old lease still waits
            raise Overloaded(f"request {rid}: its previous lease is still quarantined")
        if old is not None:
            raise Forbidden(f"request {rid} already holds a lease on this decode")
        n = len(self.leases)
        if n >= self.max_leases:
            if n >= 4 * self.max_leases:
                raise TooManyRequests(f"{n} leases open on this decode")
            if sum(s.writer == writer for s in self.leases.values()) >= self.max_leases:
                raise TooManyRequests(f"{self.max_leases} leases open for writer {writer}")
            if sum(s.router == router for s in self.leases.values()) >= self.max_leases:
                raise TooManyRequests(f"{self.max_leases} leases open for router {router}")
        if admission and n_prompt + max_new > admit_limit:
            raise ContextLengthError(n_prompt, max_new, context, pool_tokens)

    def reserve(self, rid: int, nonce: int, writer: str, router: str, subscriber: str, n_prompt: int,
                pages: tuple[int, ...], generations: tuple[int, ...], now: float) -> tuple[P.Capability, list]:
        """Pages were taken for ``rid``: open its lease. ``nonce`` is fresh (the caller draws it)."""
        if self.variants.lease_reuse:
            nonce = rid
        if rid in self.leases:
            raise Forbidden(f"request {rid} already holds a lease on this decode")
        lease = Lease(rid, nonce, writer, router, subscriber, n_prompt, tuple(pages), tuple(generations), now,
                      now + self.lease_ttl if self.lease_ttl else 0.0)
        TABLE.check("-", "reserve", "RESERVED")
        self.leases[rid] = lease
        return self.capability(lease), [Expose(rid, lease.pages)]

    # -- commit ---------------------------------------------------------------------------------------------
    def commit(self, c: P.Commit, now: float) -> list:
        self.check_cap(c.cap, c.rid, c.nonce, c.pages, now)
        lease = self.leases.get(c.rid)
        if lease is None or lease.nonce != c.nonce or lease.state is not LeaseState.RESERVED:
            if lease is not None and lease.nonce == c.nonce and lease.state is LeaseState.RUNNING:
                return [Reply(P.Ack(ok=lease.checksum == c.checksum, status=409, code="duplicate_commit",
                                    message="commit already accepted", first_token=c.first_token))]
            why = "no lease" if lease is None else ("wrong nonce" if lease.nonce != c.nonce else "lease revoked")
            raise LeaseRevoked(f"commit for request {c.rid} refused: {why}; its pages were never readable")
        k = len(lease.pages)
        covered = (c.n_tokens == lease.n_prompt and c.pages == list(lease.pages[:k])
                   and c.generations == list(lease.generations[:k]))
        if self.coverage and not covered:
            e = KVIntegrityError(f"commit for request {c.rid} covers {c.n_tokens} tokens / {len(c.pages)} pages, "
                                 f"lease reserved {lease.n_prompt} tokens / {k} pages")
            return self._reject(lease, "commit", e, "coverage")
        self._move(lease, "commit", LeaseState.VERIFYING)
        lease.checksum = c.checksum
        return [Conceal(c.rid), Verify(c.rid, c.nonce)]

    def to_verify(self, rid: int, nonce: int) -> tuple[bool, bool] | None:
        """What ``Verify`` must check now (page tags, checksum), or None if the lease is no longer verifying
        (aborted meanwhile): then ``verified`` is answered with both checks failed, and refuses."""
        lease = self.leases.get(rid)
        if lease is None or lease.nonce != nonce or lease.state is not LeaseState.VERIFYING:
            return None
        return self.page_tags, self.checksum

    def verified(self, rid: int, nonce: int, tags_ok: bool, checksum_ok: bool, first_token: int) -> list:
        """The adapter's answer to ``Verify``: tags and checksum against the bytes now in the pool."""
        lease = self.leases.get(rid)
        if lease is None or lease.nonce != nonce or lease.state is not LeaseState.VERIFYING:
            if lease is not None and lease.nonce == nonce:
                self._move(lease, "verified", lease.state)
            return [Reply(P.Ack(ok=False, status=503, code=LeaseRevoked.code,
                                message=f"request {rid}: lease aborted"))]
        if not tags_ok:
            return self._reject(lease, "verified", KVIntegrityError(
                f"request {rid}: leased pages no longer reserved for it"), "tag")
        if not checksum_ok:
            return self._reject(lease, "verified", KVIntegrityError(f"request {rid}: KV checksum mismatch"),
                                "checksum")
        self._move(lease, "verified", LeaseState.RUNNING)
        return [Start(rid, first_token), Reply(P.Ack(ok=True, first_token=first_token))]

    def _reject(self, lease: Lease, event: str, e: EngineError, reason: str) -> list:
        self.refused[reason] += 1
        self.recent.append((reason, lease.rid))
        acts = [] if lease.state is LeaseState.VERIFYING else [Conceal(lease.rid)]
        self._move(lease, event, LeaseState.QUARANTINED)
        return acts + [Quarantine(lease.rid), End(lease.rid, "error", e),
                       Reply(P.Ack(ok=False, status=e.status, code=e.code, message=str(e)))]

    # -- endings --------------------------------------------------------------------------------------------
    def abort(self, rid: int, nonce: int = 0, writer_done: bool = False, event: str = "abort") -> list:
        """Stop the request; pages a writer may still target stay QUARANTINED until it is known done. An
        unknown ``rid`` may still run on the engine (its bookkeeping went first): stop it anyway."""
        lease = self.leases.get(rid)
        if lease is not None and nonce and lease.nonce != nonce:  # for an older lease of a reused request id
            return []
        if lease is None:
            return [Stop(rid)] if event == "abort" else []
        if lease.state is LeaseState.RUNNING:
            self._move(lease, event, None)
            return [Stop(rid)]
        if lease.state is LeaseState.QUARANTINED:
            if writer_done:
                self._move(lease, event, None)
                return [Release(rid)]
            return []
        acts: list = [Conceal(rid)]
        if not self.deferred_release:  # unsafe: straight back to the free list, a writer or not
            TABLE.check(lease.state.name, event, "CLOSED")
            self.leases.pop(rid, None)
            return acts + [Free(rid), End(rid, "abort")]
        acts += [Quarantine(rid), End(rid, "abort")]
        if writer_done:
            self._move(lease, event, None)
            return acts + [Release(rid)]
        self._move(lease, event, LeaseState.QUARANTINED)
        return acts

    def writer_done(self, w: P.WriterDone, now: float) -> list:
        """The writer's own word that it stopped writing (it must present the lease's capability)."""
        self.check_cap(w.cap, w.rid, w.nonce, [], now)
        return self.writer_stopped(w.rid, w.nonce)

    def writer_stopped(self, rid: int, nonce: int) -> list:
        lease = self.leases.get(rid)
        if lease is None or lease.nonce != nonce or lease.state is not LeaseState.QUARANTINED:
            return []
        self._move(lease, "writer_done", None)
        return [Release(rid)]

    def fence(self, writer: str) -> list:
        """The writer is dead: its epoch moves on (its capability is refused from now on, for commits and page
        writes alike), its open leases are revoked and their pages freed."""
        if not self.variants.fence_without_epoch:
            self.epochs[writer] = self.epochs.get(writer, 0) + 1
        acts: list = []
        for lease in [s for s in self.leases.values() if s.writer == writer and s.state is not LeaseState.RUNNING]:
            self.refused["fence"] += lease.state is not LeaseState.QUARANTINED
            acts += self.abort(lease.rid, lease.nonce, writer_done=True, event="fence")
        return acts

    def expire(self, now: float) -> list:
        """Leases older than the TTL and never committed: abort (pages QUARANTINED), and ask their writer to
        Forget them; its answer (``forget_answer``) frees them once it is not writing."""
        acts: list = []
        if not self.lease_ttl:
            return acts
        for lease in [s for s in self.leases.values() if s.state is not LeaseState.RUNNING]:
            if now - lease.born < self.lease_ttl:
                continue
            if lease.state is LeaseState.QUARANTINED:
                self._move(lease, "expire", LeaseState.QUARANTINED)
            else:
                self.refused["timeout"] += 1
                acts += self.abort(lease.rid, lease.nonce, event="expire")
                if lease.rid not in self.leases:  # unsafe release freed it already
                    continue
            acts.append(AskForget(lease.rid, lease.nonce, lease.writer))
        return acts

    def forget_answer(self, rid: int, nonce: int, writing: bool) -> list:
        lease = self.leases.get(rid)
        if writing or lease is None or lease.nonce != nonce or lease.state is not LeaseState.QUARANTINED:
            return []
        self._move(lease, "forget_answer", None)
        return [Release(rid)]

    def router_gone(self, subscriber: str, since: float) -> list:
        """A router's stream closed at ``since`` and did not come back: stop what it reserved before then."""
        acts: list = []
        for lease in [s for s in self.leases.values() if s.subscriber == subscriber and s.born < since]:
            if lease.state is not LeaseState.QUARANTINED:
                acts += self.abort(lease.rid, lease.nonce, event="router_gone")
        return acts

    def finished(self, rid: int) -> list:
        """A running request's last event: its lease is done (the engine freed its pages)."""
        lease = self.leases.get(rid)
        if lease is not None and lease.state is LeaseState.RUNNING:
            self._move(lease, "finished", None)
        return []

    def holds(self, subscriber: str) -> bool:
        return any(s.subscriber == subscriber for s in self.leases.values())
