"""``kvseal probe`` against vLLM-CPU serving the same model (and against kvseal, for the same table).

    .venv/bin/python bench/probe_peers.py --vllm-venv ~/vllm --hf-dir ~/smollm2-hf   → bench/out/probe-peers.json

vLLM has one API key at most and no tenants: both of the probe's "tenants" use the same server unseparated,
as two customers behind one vLLM deployment would. vLLM is started alone, probed, stopped; then kvseal
(colocated, two tenants' keys). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from peers import ROOT, Proc, vllm_cmd, write_hf_dir

from kvseal.cli import parser
from kvseal.probe import run


def probe(url: str, keys: list[str], out: Path, samples: int) -> dict:
    args = ["probe", "--url", url, "--samples", str(samples), "--json", str(out), "--seed", "1"]
    for k in keys:
        args += ["--key", k]
    code = run(parser().parse_args(args))
    return {"exit": code, **json.loads(out.read_text())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--vllm-args", default="--enforce-eager --max-model-len 2048")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", default="bench/out/probe-peers.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {}
    if a.vllm_venv and (a.vllm_venv / "bin/python").exists() and a.hf_dir:
        if not Path(a.hf_dir).exists():
            write_hf_dir(Path(a.hf_dir))
        cmd = vllm_cmd(a.vllm_venv, a.hf_dir, 8620, [])
        cmd = [c for c in cmd if c not in ("--max-model-len", "8192")] + a.vllm_args.split()
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        p = Proc(cmd, env, 8620, out.parent / "probe-vllm.log")
        try:
            result["vllm"] = probe(p.url, ["none", "none"], out.with_suffix(".vllm.json"), a.samples)
        finally:
            p.stop()
    else:
        print("vLLM skipped: give --vllm-venv (a virtualenv with vllm-cpu) and --hf-dir", file=sys.stderr)
    cmd = [str(ROOT / ".venv/bin/kvseal"), "serve", "--colocated", "--port", "8621", "--context", "2048",
           "--api-key", "key-a=tenant-a", "--api-key", "key-b=tenant-b"]
    p = Proc(cmd, {}, 8621, out.parent / "probe-kvseal.log")
    try:
        result["kvseal"] = probe(p.url, ["key-a", "key-b"], out.with_suffix(".kvseal.json"), a.samples)
    finally:
        p.stop()
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {"exit": v["exit"], "findings": v["findings"]} for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
