"""kvseal against vLLM-CPU on this machine, with the same streaming client, one server at a time, interleaved.

    .venv/bin/python bench/peers.py --vllm-venv /path/to/venv --hf-dir /path/to/hf-model [--reps 2]

Cases (streams × prompt tokens → output tokens): 1 × 128 → 128, 32 × 128 → 128, 32 × 850 → 64, and 1 × 850 → 1
for prefill speed (prompt tokens / TTFT). Each repetition starts each server alone (kvseal colocated,
kvseal disaggregated, vLLM), runs every case against it, and stops it, so the order alternates and no server
competes with another for the two cores. Writes bench/out/peers.json (every run, means, kvseal/vLLM ratios)
and a plot. vLLM comes from its own virtualenv (``--vllm-venv``; it is never a dependency of kvseal); without
one the script says so and measures kvseal alone. ``--hf-dir``: the model as a Hugging Face directory, which
vLLM needs; if the directory does not exist it is written from the GGUF first (same dequantized weights).
kvseal modes: ``colocated``, ``disaggregated``, either with ``-int4`` / ``-int8`` for ``--weights``, and with
``@LEVEL`` to serve at a forced kernel level (``colocated@avx2``: ``KVSEAL_ISA=avx2``, oneDNN held to AVX2
too, as on an AVX2-only CPU). ``--llama-server``: llama.cpp's own server binary, run on every case with
``--parallel 32`` (continuous batching) for each GGUF type in ``--llama-quants`` (Q4_1 is the shipped file;
others are requantized from it with ``llama-quantize`` beside the server, once). ``--llamacpp-venv``: a
virtualenv with ``llama-cpp-python[server]``, whose server takes one request at a time: single-stream cases
only. The JSON records the machine (``kvseal env``) and each kvseal server's start line (its kernel level), and
the ratio of each kvseal server to the best peer per case. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from kvseal.bench import level

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CASES = [(1, 128, 128), (32, 128, 128), (32, 850, 64), (1, 850, 1)]
ROOT = Path(__file__).resolve().parent.parent


def kvseal_cmd(mode: str, port: int) -> tuple[list[str], dict]:
    """``colocated-int4@avx2`` → the command and its environment."""
    mode, _, isa = mode.partition("@")
    layout, _, weights = mode.partition("-")
    extra = ["--colocated"] if layout == "colocated" else []
    if weights:
        extra += ["--weights", weights]
    env = {"KVSEAL_ISA": isa, "ONEDNN_MAX_CPU_ISA": "AVX2" if isa in ("avx2", "generic") else "ALL"} if isa else {}
    return [str(ROOT / ".venv/bin/kvseal"), "serve", *extra, "--port", str(port)], env


def llama_server_cmd(binary: Path, gguf: Path, port: int) -> list[str]:
    ctx = 32 * 1024  # split over the 32 slots: 1,024 tokens each, room for 850 + 64
    return [str(binary), "-m", str(gguf), "--alias", MODEL, "--port", str(port), "-t", str(os.cpu_count()),
            "-tb", str(os.cpu_count()), "--parallel", "32", "--cont-batching", "-c", str(ctx)]


def llama_gguf(binary: Path, quant: str, out: Path) -> Path:
    """The shipped GGUF for Q4_1; other types requantized from it once (``llama-quantize --allow-requantize``)."""
    from kvseal.model.loader import default_model_path

    src = default_model_path()
    if quant == "Q4_1":
        return src
    dst = out / f"SmolLM2-135M-Instruct.{quant}.gguf"
    if not dst.exists():
        subprocess.run([str(binary.parent / "llama-quantize"), "--allow-requantize", str(src), str(dst), quant],
                       check=True, capture_output=True)
    return dst


def llamacpp_cmd(venv: Path, port: int) -> list[str]:
    from kvseal.model.loader import default_model_path

    return [str(venv / "bin/python"), "-m", "llama_cpp.server", "--model", str(default_model_path()),
            "--model_alias", MODEL, "--n_threads", str(os.cpu_count()), "--n_ctx", "4096", "--port", str(port)]


def vllm_cmd(venv: Path, hf_dir: str, port: int, extra: list[str]) -> list[str]:
    return [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
            "--served-model-name", MODEL, "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "8192",
            *extra]


class Proc:
    def __init__(self, cmd: list[str], env: dict, port: int, log: Path, timeout: float = 600) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.p = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{cmd[:3]} exited {self.p.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"{cmd[:3]} did not start; see {log}")

    def stop(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            self.p.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.p.pid, signal.SIGKILL)
        time.sleep(2)


def write_hf_dir(path: Path) -> None:
    """The default model as a plain bf16 Hugging Face directory: the weights kvseal serves, for vLLM."""
    import torch
    from transformers import AutoTokenizer

    from kvseal.bench import hf_model
    from kvseal.model.loader import default_model_path

    gguf = default_model_path()
    hf_model(torch.bfloat16).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(path))


def as_text() -> Callable[[list[int]], str]:
    """Token ids to text of about as many tokens, for servers that take no token-id prompts (llama.cpp)."""
    from kvseal.model.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    return lambda ids: tok.decode(ids)


def measure(url: str, cases: list[tuple[int, int, int]], text: bool = False, requests: int = 1) -> dict:
    out = {}
    # llama.cpp's server has no ignore_eos: end-of-text tokens are banned instead, so every answer is full length
    kw = {"as_text": as_text(), "extra": {"logit_bias": {"0": -100, "1": -100, "2": -100}}} if text else {}
    for streams, prompt, output in cases:
        try:
            r = asyncio.run(level(url, MODEL, streams, prompt, output, requests, **kw))
        except (RuntimeError, httpx.HTTPError) as e:  # a failed request fails the case, recorded; the others run
            out[f"{streams}x{prompt}->{output}"] = {"error": str(e)[:300]}
            continue
        if output == 1:
            r["prefill_tok_s"] = prompt / r["ttft_p50"]
        out[f"{streams}x{prompt}->{output}"] = r
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    keys = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "prefill_tok_s")
    # over the runs that finished; a failed run (its error recorded in ``runs``) is counted in ``failed_runs``
    means = {name: {case: {k: float(np.mean([r[case][k] for r in rs if k in r[case]]))
                           for k in keys if any(k in r[case] for r in rs)}
                    for case in rs[0]} for name, rs in runs.items() if rs}
    failed = {name: {case: n for case in rs[0] if (n := sum("error" in r[case] for r in rs))}
              for name, rs in runs.items() if rs}
    peers = [n for n in means if not n.startswith("kvseal")]
    return {"means": means, "failed_runs": {n: f for n, f in failed.items() if f},
            "kvseal_over_vllm": ratios_to(means, "vllm"), "kvseal_over_llamacpp": ratios_to(means, "llamacpp"),
            **{f"kvseal_over_{n}": ratios_to(means, n) for n in peers if n.startswith("llama_server")},
            "kvseal_over_best_peer": over_best(means, peers)}


def over_best(means: dict, peers: list[str]) -> dict:
    """Each kvseal server's output tok/s over the best peer's in each case (the peer named)."""
    out: dict = {}
    for name, cases in means.items():
        if name.startswith("kvseal"):
            out[name] = {}
            for case, m in cases.items():
                best = max(((means[p][case]["output_tok_s"], p) for p in peers
                            if "output_tok_s" in means[p].get(case, {})), default=None)
                if best and "output_tok_s" in m:
                    out[name][case] = {"ratio": m["output_tok_s"] / best[0], "best_peer": best[1]}
    return out


def ratios_to(means: dict, base: str) -> dict:
    """Each kvseal server's means over ``base``'s, case by case (None where either run failed)."""
    ratios: dict = {}
    if base not in means:
        return ratios
    for name, cases in means.items():
        if not name.startswith("kvseal"):
            continue
        ratios[name] = {}
        for case, v in means[base].items():
            m = cases.get(case, {})
            if "output_tok_s" not in m or "output_tok_s" not in v:
                ratios[name][case] = None  # a failed run
                continue
            ratios[name][case] = {"tok_s_ratio": m["output_tok_s"] / v["output_tok_s"],
                                  "itl_p99_ratio": m["itl_p99"] / v["itl_p99"] if v["itl_p99"] else None,
                                  "ttft_p50_ratio": m["ttft_p50"] / v["ttft_p50"]}
            if "prefill_tok_s" in m:
                ratios[name][case]["prefill_ratio"] = m["prefill_tok_s"] / v["prefill_tok_s"]
    return ratios


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = summary["means"]
    cases = [c for c in next(iter(means.values())) if not c.endswith("->1")]
    means = {name: m for name, m in means.items() if all(c in m for c in cases)}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(means)
    for i, (name, m) in enumerate(means.items()):
        ax.bar(np.arange(len(cases)) + i * width, [m[c].get("output_tok_s", 0) for c in cases], width, label=name)
    ax.set_xticks(np.arange(len(cases)) + width * (len(means) - 1) / 2, cases)
    ax.set(ylabel="output tokens/s", title="kvseal vs vLLM-CPU, same client, same machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-venv", type=Path, default=None)
    ap.add_argument("--hf-dir", default=None)
    ap.add_argument("--vllm-args", default="--enforce-eager", help="extra vLLM server flags")
    ap.add_argument("--llamacpp-venv", type=Path, default=None,
                    help="a virtualenv with llama-cpp-python[server] (single-stream cases)")
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary (every case)")
    ap.add_argument("--llama-quants", default="Q4_1,Q8_0", help="GGUF types for --llama-server")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kvseal-modes", default="colocated,disaggregated")
    ap.add_argument("--cases", default="", help="a subset of the cases, e.g. '1x128->128,32x128->128'")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests per stream in each run (one 1-stream request is ~1.5 s: noisy alone)")
    ap.add_argument("--out", default="bench/out/peers")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.cases or f"{c[0]}x{c[1]}->{c[2]}" in a.cases.split(",")]
    if not cases:
        ap.error(f"--cases names none of {[f'{c[0]}x{c[1]}->{c[2]}' for c in CASES]}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    servers = {f"kvseal_{m}": (*kvseal_cmd(m, 8600), 8600, cases) for m in a.kvseal_modes.split(",")}
    if a.llama_server:
        for q in a.llama_quants.split(","):
            servers[f"llama_server_{q}"] = (llama_server_cmd(a.llama_server, llama_gguf(a.llama_server, q, out.parent),
                                                             8603), {}, 8603, cases)
    if a.vllm_venv and (a.vllm_venv / "bin/python").exists() and a.hf_dir:
        if not Path(a.hf_dir).exists():
            write_hf_dir(Path(a.hf_dir))
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
        servers["vllm"] = (vllm_cmd(a.vllm_venv, a.hf_dir, 8601, a.vllm_args.split()), env, 8601, cases)
    else:
        print("vLLM skipped: give --vllm-venv (a virtualenv with vllm-cpu) and --hf-dir", file=sys.stderr)
    if a.llamacpp_venv and (a.llamacpp_venv / "bin/python").exists():
        single = [c for c in cases if c[0] == 1]
        servers["llamacpp"] = (llamacpp_cmd(a.llamacpp_venv, 8602), {}, 8602, single)
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    start_lines: dict[str, str] = {}
    for rep in range(a.reps):
        order = list(servers) if rep % 2 == 0 else list(reversed(servers))
        for name in order:
            cmd, env, port, cases = servers[name]
            log = out.parent / f"peers-{name}.log"
            p = Proc(cmd, env, port, log)
            try:
                runs[name].append(measure(p.url, cases, text=name.startswith("llama"), requests=a.requests))
            finally:
                p.stop()
            if name.startswith("kvseal"):
                start_lines[name] = next((ln for ln in log.read_text().splitlines() if ln.startswith("kvseal: ")), "")
            out.with_suffix(".partial.json").write_text(json.dumps({"start_lines": start_lines, "runs": runs}))
            print(name, json.dumps({c: round(r.get("output_tok_s", -1), 1) for c, r in runs[name][-1].items()}),
                  flush=True)
    from kvseal.machine import facts

    result = {"machine": facts(), "start_lines": start_lines, "cases": cases, "reps": a.reps, "runs": runs,
              **summarize(runs)}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "cases")}, indent=2))


if __name__ == "__main__":
    main()
