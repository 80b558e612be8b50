"""Models users bring, measured with dummy weights of real shapes (``bench/shapes.py``): memory and speed.

1. **Memory** of ``kvseal serve`` (disaggregated, one host) with a Llama-3.2-1B-shaped dummy bf16 model: the
   proportional set size (PSS: a page mapped by both workers counts half in each) and the RSS of every
   process after one request, against the target 1.3 × (one copy of the weights + both pools + 1 GiB). RSS
   sums count the shared weights file once per worker; PSS counts it once.
2. **Speed**, one server at a time (the machine has room for one 8B model): kvseal colocated and vLLM-CPU,
   both ``--load-format dummy`` on the same config directory, the same streaming client (``kvseal.bench``):
   Llama-3.2-1B shape at 1 stream and 32 streams (128 → 128 tokens), Llama-3.1-8B shape at 1 stream
   (128 → 32).

    .venv/bin/python bench/models.py [--vllm-venv ~/vllm] [--skip-8b]

Writes bench/out/models.json. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Proc
from shapes import params, write

from kvseal.bench import level

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


def tree(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
    return [pid] + [q for k in kids for q in tree(int(k))]


def memory(pid: int) -> dict:
    out = {}
    for p in tree(pid):
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_text().split("\0")
        except OSError:
            continue
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in rollup.splitlines()[1:] if ln.split()[-1] == "kB"}
        role = next((c for c in cmd if c in ("prefill", "decode", "router", "serve")), cmd[0])
        if "python" not in cmd[0] and "kvseal" not in " ".join(cmd):
            continue
        out[f"{role}:{p}"] = {"rss_gib": kb["Rss"] / 2**20, "pss_gib": kb["Pss"] / 2**20}
    return out


def measure_memory(model: Path, log: Path) -> dict:
    pool_gib = 1.5
    p = Proc([str(ROOT / ".venv/bin/kvseal"), "serve", "--model", str(model), "--load-format", "dummy",
              "--context", "4096", "--kv-memory", str(pool_gib), "--port", "8610"], {}, 8610, log)
    try:
        r = httpx.post(p.url + "/v1/completions", timeout=120,
                       json={"model": model.name, "prompt": "Hello there", "max_tokens": 8})
        assert r.status_code == 200, r.text
        procs = memory(p.p.pid)
    finally:
        p.stop()
    weights_gib = params(model.name) * 2 / GiB
    budget = 1.3 * (weights_gib + 2 * pool_gib + 1)
    pss = sum(v["pss_gib"] for v in procs.values())
    rss = sum(v["rss_gib"] for v in procs.values())
    return {"processes": procs, "pss_total_gib": pss, "rss_total_gib": rss, "weights_gib": weights_gib,
            "pools_gib": 2 * pool_gib, "target_gib": budget, "pss_within_target": pss <= budget}


def kvseal_cmd(model: Path, port: int) -> list[str]:
    return [str(ROOT / ".venv/bin/kvseal"), "serve", "--colocated", "--model", str(model), "--load-format", "dummy",
            "--context", "4096", "--kv-memory", "2", "--port", str(port)]


def vllm_cmd(venv: Path, model: Path, port: int) -> list[str]:
    return [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", model.name, "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
            "--load-format", "dummy", "--enforce-eager"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default="bench/out/models.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shapes = out.parent / "shapes"
    m1, m8 = write(shapes, "llama-3.2-1b"), write(shapes, "llama-3.1-8b")
    from kvseal.machine import facts

    result: dict = {"machine": facts()}
    if not a.skip_memory:
        result["memory_1b_disaggregated"] = measure_memory(m1, out.parent / "models-memory.log")
        print(json.dumps(result["memory_1b_disaggregated"], indent=1), flush=True)
    plan = [(m1, [(1, 128, 128), (32, 128, 128)])] + ([] if a.skip_8b else [(m8, [(1, 128, 32)])])
    servers = {"kvseal": lambda m, port: (kvseal_cmd(m, port), {})}
    if a.vllm_venv and (a.vllm_venv / "bin/python").exists():
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        servers["vllm"] = lambda m, port: (vllm_cmd(a.vllm_venv, m, port), env)
    speed: dict = {}
    for model, cases in plan:
        for name, make in servers.items():
            cmd, env = make(model, 8611)
            t0 = time.time()
            try:
                p = Proc(cmd, env, 8611, out.parent / f"models-{name}-{model.name}.log", timeout=1200)
            except (RuntimeError, TimeoutError) as e:
                speed[f"{name} {model.name}"] = {"error": str(e)}
                continue
            started = time.time() - t0
            try:
                for streams, prompt, output in cases:
                    r = asyncio.run(level(p.url, model.name, streams, prompt, output, 1))
                    speed[f"{name} {model.name} {streams}x{prompt}->{output}"] = {**r, "start_s": started}
                    print(name, model.name, streams, round(r["output_tok_s"], 2), flush=True)
            finally:
                p.stop()
            out.write_text(json.dumps({**result, "speed": speed}, indent=2))
    ratios = {k.removeprefix("kvseal "): v["output_tok_s"] / speed[k.replace("kvseal", "vllm", 1)]["output_tok_s"]
              for k, v in speed.items() if k.startswith("kvseal ") and "output_tok_s" in v
              and "output_tok_s" in speed.get(k.replace("kvseal", "vllm", 1), {})}
    result.update(speed=speed, kvseal_over_vllm=ratios)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"kvseal_over_vllm": ratios}, indent=1))


if __name__ == "__main__":
    main()
