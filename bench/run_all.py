"""All serving benchmarks in one run, on one machine: writes bench/out/summary.json (+ per-run JSON/PNG).

1. colocated vs disaggregated (shm) at 1, 8, 32 streams × (128 prompt, 128 output), with HF ``generate``.
2. disaggregated vs colocated, interleaved repetitions at 32 streams (the 0.9x figure).
3. hardened vs all protections off (disaggregated), interleaved repetitions at 8 and 32 streams.
4. signed vs unsigned internal requests (disaggregated), interleaved repetitions at 8 and 32 streams.
5. micro-costs of each protection on the hot path (bench/protections.py) and the transfer bandwidths.
Takes ~25 minutes on 2 cores (``--parts`` picks a subset).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

OUT = Path("bench/out")
ENV = {**os.environ, "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "4096", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "4096"}


class Serve:
    def __init__(self, port: int, *args: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen([sys.executable, "-m", "kvseal.cli", "serve", "--port", str(port), *args],
                                  env={**ENV, "KVSEAL_UNSAFE": "1"}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.url)

    def stop(self) -> None:
        """Stop the whole process group and wait until it is gone, so the ports are free for the next."""
        os.killpg(self.p.pid, 15)
        self.p.wait(30)
        for _ in range(300):
            try:
                os.killpg(self.p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(self.p.pid, 9)


def bench(url: str, streams: str, out: str, pid: int | None = None, hf: bool = False) -> dict:
    from kvseal.bench import add_args, run

    ap = argparse.ArgumentParser()
    add_args(ap)
    argv = ["--url", url, "--streams", streams, "--out", str(OUT / out)]
    if pid:
        argv += ["--server-pid", str(pid)]
    if hf:
        argv.append("--hf-baseline")
    return run(ap.parse_args(argv))


def ratio(a: dict, b: dict, key: str) -> dict:
    return {str(x["streams"]): x[key] / y[key] for x, y in zip(a["levels"], b["levels"])}


PARTS = ("serving", "disagg", "protections", "signing", "micro")


def serving(summary: dict) -> None:
    """Colocated (with the HF baseline) and disaggregated at 1, 8, 32 streams."""
    s = Serve(8100, "--colocated")
    colo = bench(s.url, "1,8,32", "colocated", s.p.pid, hf=True)
    s.stop()
    s = Serve(8110)
    dis = bench(s.url, "1,8,32", "disaggregated", s.p.pid)
    s.stop()
    summary["colocated"], summary["disaggregated"] = colo, dis
    summary["disagg_over_colocated_tok_s"] = ratio(dis, colo, "output_tok_s")
    summary["colocated_over_hf"] = colo["ratio_vs_hf"]


def interleaved(a: tuple[str, list[str]], b: tuple[str, list[str]], reps: int, streams: str) -> dict:
    """Two servers up at once, their benchmark runs interleaved (ABBA...) so this machine's drift hits both.

    Besides the ratio of means (a over b), each run of ``a`` is divided by the run of ``b`` next to it
    (paired): the median of those ratios is far less sensitive to slow drift than the means are.
    """
    (na, args_a), (nb, args_b) = a, b
    servers = {na: Serve(8120, *args_a), nb: Serve(8130, *args_b)}
    runs: dict = {na: [], nb: []}
    try:
        for rep in range(reps):
            order = (na, nb) if rep % 2 == 0 else (nb, na)
            for name in order:
                runs[name].append(bench(servers[name].url, streams, f"{na}_vs_{nb}_{name}_{rep}"))
    finally:
        for srv in servers.values():
            srv.stop()
    means = {k: _mean(v) for k, v in runs.items()}
    ma, mb = means[na], means[nb]
    return {"means": means, "runs_tok_s": {k: [[lv["output_tok_s"] for lv in r["levels"]] for r in v]
                                           for k, v in runs.items()},
            "ratio_of_means": {st: {k: ma[st][k] / mb[st][k] for k in KEYS} for st in ma},
            "paired": _paired(runs[na], runs[nb])}


def record(summary: dict, a: str, b: str, r: dict) -> None:
    summary[f"{a}_vs_{b}"] = r["means"]
    summary[f"{a}_vs_{b}_runs_tok_s"] = r["runs_tok_s"]
    summary[f"{a}_over_{b}"] = r["ratio_of_means"]
    summary[f"{a}_over_{b}_paired"] = r["paired"]


def protections(summary: dict, reps: int, streams: str) -> None:
    """Hardened vs every protection off, both disaggregated."""
    record(summary, "hardened", "unsafe", interleaved(("hardened", []), ("unsafe", ["--unsafe-no-all"]), reps, streams))


def signing(summary: dict, reps: int, streams: str) -> None:
    """Every internal request signed and checked vs none (both disaggregated): the issue's ≥ 0.99 figure."""
    record(summary, "signed", "unsigned", interleaved(("signed", []), ("unsigned", ["--insecure-no-auth"]), reps,
                                                      streams))


def disagg(summary: dict, reps: int, streams: str) -> None:
    """Disaggregated (router + prefill + decode, shm) vs colocated, the issue's 0.9x figure."""
    r = interleaved(("disaggregated", []), ("colocated", ["--colocated"]), reps, streams)
    record(summary, "disaggregated", "colocated", r)


def micro(summary: dict) -> None:
    """Each protection's hot-path cost, and KV transfer bandwidth beside raw, per transport."""
    for script in ("bench/protections.py", "bench/transfer.py"):
        subprocess.run([sys.executable, script], env=ENV, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    summary["protection_micro_costs"] = json.loads((OUT / "protections.json").read_text())
    summary["transfer"] = json.loads((OUT / "transfer.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--prot-streams", default="8,32", help="concurrency levels of the protections part")
    ap.add_argument("--disagg-streams", default="32", help="concurrency levels of the disagg part")
    a = ap.parse_args()
    parts = a.parts.split(",")
    summary: dict = {}
    if "serving" in parts:
        serving(summary)
    if "disagg" in parts:
        disagg(summary, a.reps, a.disagg_streams)
    if "protections" in parts:
        protections(summary, a.reps, a.prot_streams)
    if "signing" in parts:
        signing(summary, a.reps, a.prot_streams)
    if "micro" in parts:
        micro(summary)
    OUT.mkdir(parents=True, exist_ok=True)
    name = "summary.json" if set(parts) == set(PARTS) else f"summary-{'-'.join(parts)}.json"
    (OUT / name).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if "over" in k}, indent=2))


KEYS = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def _paired(a: list[dict], b: list[dict]) -> dict:
    out = {}
    for i, lv in enumerate(a[0]["levels"]):
        for key in KEYS:
            r = sorted(x["levels"][i][key] / y["levels"][i][key] for x, y in zip(a, b))
            out.setdefault(str(lv["streams"]), {})[key] = {"median": r[len(r) // 2], "min": r[0], "max": r[-1]}
    return out


def _mean(results: list[dict]) -> dict:
    out = {}
    for lv in zip(*[r["levels"] for r in results]):
        out[str(lv[0]["streams"])] = {k: sum(x[k] for x in lv) / len(lv) for k in KEYS}
    return out


if __name__ == "__main__":
    main()
