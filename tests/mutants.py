"""``make mutants``: protocol mutations, each applied alone to a copy of the tree, each to be killed by the tests.

A mutant is a one-place change to the shipped code that breaks a safety rule: a dropped check, a swapped order,
an early free, a skipped tag, a stale epoch accepted. For each, the copy gets the change, then its checks run
(fastest first; the first to fail kills it): the deterministic simulator on the safe protocol (2,000 seeds, it
stops at the first violation) and the test files that should catch it. The working tree is never touched.

    .venv/bin/python tests/mutants.py [--only NAME,...] [--seeds N] [--json OUT]

Prints one line per mutant and "N of M killed"; exits 1 if any survived that is not explained (``survives``:
why a survivor is not a hole, e.g. the same rule is enforced a second time elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_TESTS = "copy_of_a_prefill or name_the_lease or another_lease_of or not_declare or reported_done_only"
FAST = [f"tests/test_protocol_models.py -k '{CORE_TESTS}'",
        "tests/test_hosts.py", "tests/test_auth.py", "tests/test_protections.py"]


@dataclass
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: list[str] = field(default_factory=lambda: list(FAST))
    sim: bool = True
    survives: str = ""  # if it is expected to survive: why that is not a hole


MUTANTS = [
    # -- decode: capabilities ---------------------------------------------------------------------------------
    Mutant("cap: MAC not checked", "kvseal/protocol/decode.py",
           "if c is None or not hmac.compare_digest(self._mac(c), c.mac):", "if c is None:"),
    Mutant("cap: another lease's capability accepted", "kvseal/protocol/decode.py",
           "if c.rid != rid or c.nonce != nonce or c.decode_id != self.decode_id:",
           "if c.decode_id != self.decode_id:"),
    Mutant("cap: pages outside the lease accepted", "kvseal/protocol/decode.py",
           "if not set(pages) <= set(c.pages):", "if False:"),
    Mutant("cap: stale epoch accepted", "kvseal/protocol/decode.py",
           "if c.epoch != self.epochs.get(c.writer, 0):", "if False:"),
    Mutant("cap: expired capability accepted", "kvseal/protocol/decode.py",
           "if c.expires and now > c.expires and not self.variants.commit_after_expiry:", "if False:"),
    Mutant("writer_done: no capability needed", "kvseal/protocol/decode.py",
           "        self.check_cap(w.cap, w.rid, w.nonce, [], now)\n", ""),
    # -- decode: the lease ---------------------------------------------------------------------------------------
    Mutant("commit: coverage skipped", "kvseal/protocol/decode.py",
           "if self.coverage and not covered:", "if False:"),
    Mutant("verify: tags ignored", "kvseal/protocol/decode.py", "        if not tags_ok:", "        if False:"),
    Mutant("verify: checksum ignored", "kvseal/protocol/decode.py", "        if not checksum_ok:", "        if False:"),
    Mutant("abort: pages freed at once, writer or not", "kvseal/protocol/decode.py",
           "        if not self.deferred_release:  # unsafe", "        if True:  # unsafe"),
    Mutant("fence: epoch not moved on", "kvseal/protocol/decode.py",
           "            self.epochs[writer] = self.epochs.get(writer, 0) + 1", "            pass"),
    Mutant("forget: pages freed while the writer is writing", "kvseal/protocol/decode.py",
           "if writing or lease is None or lease.nonce != nonce or lease.state is not LeaseState.QUARANTINED:",
           "if lease is None or lease.nonce != nonce or lease.state is not LeaseState.QUARANTINED:"),
    Mutant("reserve: the nonce is the request id", "kvseal/protocol/decode.py",
           "        if self.variants.lease_reuse:\n            nonce = rid", "        if True:\n            nonce = rid"),
    Mutant("abort: an older lease's abort hits the new one", "kvseal/protocol/decode.py",
           "if lease is not None and nonce and lease.nonce != nonce:", "if False:"),
    # -- decode host and ports ------------------------------------------------------------------------------------
    Mutant("host: no one-reserve-per-request guard", "kvseal/protocol/decode_host.py",
           "reserve_guard: bool = True", "reserve_guard: bool = False"),
    Mutant("host: quarantine frees instead", "kvseal/protocol/decode_host.py",
           "                    ports.quarantine(a.rid, h.run)", "                    ports.free(h.run)"),
    Mutant("host: verification skipped", "kvseal/protocol/decode_host.py",
           "tags_ok, sum_ok = self.ports.verify(h, c, *checks) if checks else (False, False)",
           "tags_ok, sum_ok = True, True"),
    Mutant("server: tag check skipped", "kvseal/server/decode.py",
           "tags_ok = not tags or pool.run_ok(", "tags_ok = True or pool.run_ok("),
    Mutant("server: checksum check skipped", "kvseal/server/decode.py",
           "sum_ok = not checksum or P.checksum(", "sum_ok = True or P.checksum("),
    # -- prefill --------------------------------------------------------------------------------------------------
    Mutant("prefill: admission skipped (the 2026 placeholder path)", "kvseal/protocol/prefill.py",
           "if too_long and self.admission and not placeholder:", "if False:"),
    Mutant("prefill: own pages freed before decode answered", "kvseal/protocol/prefill.py",
           "early = [] if self.deferred_release else [ReleaseOwn(rid)]", "early = [ReleaseOwn(rid)]"),
    Mutant("prefill: forget while writing answers 'not writing'", "kvseal/protocol/prefill.py",
           "        self._move(t, \"forget\", t.state)\n        return True, []",
           "        self._move(t, \"forget\", t.state)\n        return False, []"),
    Mutant("prefill: no WriterDone after a refused commit", "kvseal/protocol/prefill.py",
           "        if not ack.ok:\n            acts.append(SendWriterDone(rid, nonce))",
           "        if False:\n            acts.append(SendWriterDone(rid, nonce))",
           survives="liveness only, and covered twice over: the router's Abort after the refusal says the "
                    "writer is done, and decode's TTL asks the writer to Forget; the pages stay quarantined "
                    "(never freed early) until one of them arrives"),
    # -- router ---------------------------------------------------------------------------------------------------
    Mutant("router: an unconfirmed Forget reported as done", "kvseal/protocol/router.py",
           "return [SendAbort(self.rid, self.nonce, stopped),", "return [SendAbort(self.rid, self.nonce, True),"),
    Mutant("router: a client that leaves cuts the transfer in half", "kvseal/protocol/router.py",
           "        if self.guarded:\n            self._move(\"left\", self.state)",
           "        if False:\n            self._move(\"left\", self.state)"),
    Mutant("router: fenced prefill back without confirmation", "kvseal/protocol/router.py",
           "if not self.unconfirmed or self.variants.unconfirmed_fence:", "if True:"),
    Mutant("router: a prefill restarted between probes not fenced", "kvseal/protocol/router.py",
           "if restarted and self.role == \"prefill\" and self.state is not HealthState.FENCED:",
           "if False:", tests=[*FAST, "tests/test_faults.py -k back_before"]),
    # -- pool, messages, engine -------------------------------------------------------------------------------------
    Mutant("pool: a page's generation not compared", "kvseal/kv/pool.py",
           "ok = (self.owner[idx] == owner) & (self.generation[idx] == gens) & (self.state[idx] == int(state))",
           "ok = (self.owner[idx] == owner) & (self.state[idx] == int(state))",
           tests=[*FAST, "tests/test_pool.py"]),
    Mutant("checksum: first token and nonce not covered", "kvseal/transfer/messages.py",
           "h.update(msgspec.msgpack.encode([rid, nonce, dest_pages, generations, n_tokens, first_token]))",
           "h.update(msgspec.msgpack.encode([rid, dest_pages, generations, n_tokens]))",
           tests=[*FAST, "tests/test_faults.py -k 'corrupt_commit and not unsafe'"]),
    Mutant("engine: the tag check before a step skipped", "kvseal/engine/runner.py",
           "        if self.check_tags:\n            ok = self.tag_check(", "        if False:\n            ok = self.tag_check(",
           tests=[*FAST, "tests/test_prefix_cache.py"], sim=False),
    # -- a GPU pool's staged transfer (run on host pools with KVSEAL_KV_STAGING=1) ------------------------------------
    Mutant("staging: decode never copies the landing area into its pool", "kvseal/server/decode.py",
           "            pool.take_in(h.run.pages)", "            pass",
           tests=["tests/test_staging.py"], sim=False),
    Mutant("staging: the landing copy runs before the lease's tags hold", "kvseal/server/decode.py",
           "        if tags_ok:  # a staged pool", "        if True:  # a staged pool",
           tests=["tests/test_protections.py -k staged_commit"], sim=False),
    Mutant("staging: the landing copy takes every page rather than the lease's", "kvseal/kv/pool.py",
           "        idx = torch.tensor(pages, dtype=torch.int64)\n        dev = self.kv.device",
           "        idx = torch.arange(self.cfg.num_pages)\n        dev = self.kv.device",
           tests=["tests/test_staging.py"], sim=False),
]


def apply(root: Path, m: Mutant) -> str:
    f = root / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name!r}: the original text occurs {text.count(m.old)} times in {m.path}")
    f.write_text(text.replace(m.old, m.new))
    return text


def check(root: Path, m: Mutant, seeds: int) -> tuple[bool, str]:
    """(killed, by what)."""
    env = {**os.environ, "PYTHONPATH": str(root), "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "4096",
           "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "4096"}
    runs = [("sim", [sys.executable, "-m", "kvseal.sim", "--seeds", str(seeds), "--jobs", "2"])] if m.sim else []
    runs += [(t, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *shlex.split(t)])
             for t in m.tests]
    for name, argv in runs:
        r = subprocess.run(argv, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            return True, name
    return False, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant names (substring match)")
    ap.add_argument("--seeds", type=int, default=2000)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.only or any(s in m.name for s in a.only.split(","))]
    work = Path(tempfile.mkdtemp(prefix="kvseal-mutants-"))
    root = work / "tree"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns(".venv", ".git", "build", "__pycache__",
                                                              ".ruff_cache", ".hypothesis", "*.egg-info"))
    results, t0 = [], time.time()
    try:
        # the unmutated copy must pass every check, or a kill would mean nothing
        every = Mutant("baseline", "", "", "", tests=sorted({t for m in chosen for t in m.tests}))
        failed, by = check(root, every, a.seeds)
        if failed:
            raise SystemExit(f"the unmutated tree fails {by}: fix that first")
        print(f"baseline: every check passes on the unmutated copy ({time.time() - t0:.0f} s)", flush=True)
        for m in chosen:
            original = apply(root, m)
            t = time.time()
            try:
                killed, by = check(root, m, a.seeds)
            finally:
                (root / m.path).write_text(original)
            results.append({"name": m.name, "killed": killed, "by": by, "seconds": round(time.time() - t, 1),
                            "survives": m.survives})
            verdict = f"killed by {by}" if killed else ("survived (explained)" if m.survives else "SURVIVED")
            print(f"{m.name:60s} {verdict} ({time.time() - t:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    killed = sum(r["killed"] for r in results)
    print(f"{killed} of {len(results)} killed ({time.time() - t0:.0f} s)")
    for r in results:
        if not r["killed"]:
            print(f"  survivor: {r['name']}: {r['survives'] or 'NOT EXPLAINED'}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"killed": killed, "total": len(results), "mutants": results}, indent=1))
    sys.exit(0 if all(r["killed"] or r["survives"] for r in results) else 1)


if __name__ == "__main__":
    main()
