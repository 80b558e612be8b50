"""What this machine is and what kvseal runs on it: ``kvseal env``, every server's start line, and the signed
``/health`` of a worker carry the same facts (CPU, its features, the kernel level and why, dtype and weight
mode and why, threads, torch and compiler versions), so a report of a slow or failing server says which
code ran. As ``python -m torch.utils.collect_env`` and ``vllm collect-env`` do for theirs."""

from __future__ import annotations

import argparse
import json
import os
import platform

from kvseal.model import cpu

# the features that decide a level or a dtype, as /proc/cpuinfo names them
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
            "amx_bf16", "amx_tile", "avx_ne_convert", "asimd", "bf16", "sve", "i8mm")


def facts(dtype: str = "auto", weights: str = "auto", threads: int = 0, device: str = "cpu") -> dict:
    """Raises ``kvseal.model.cpu.LevelError`` when ``KVSEAL_ISA`` names a level this machine cannot run."""
    import torch  # here, not at the top: the CLI's parser imports this module, and the router never loads PyTorch

    from kvseal.model.kernels import library_info, library_path

    c = cpu.choice()
    path = library_path()
    level, compiler = library_info(path) if path else (None, None)
    dtype_name, dtype_why = cpu.resolve_dtype(dtype)
    out = {
        "cpu": cpu.cpu_model(), "arch": cpu.arch(), "cores": os.cpu_count(),
        "features": [f for f in FEATURES if f in cpu.cpu_flags()],
        "amx": cpu.amx(), "levels_runnable": cpu.runnable(cpu.usable_flags()), "levels_built": cpu.built(),
        "kernels": level, "kernels_why": c.reason, "forced": os.environ.get("KVSEAL_ISA"),
        "dtype": dtype_name, "dtype_why": dtype_why, "weights": cpu.resolve_weights(weights, dtype),
        "threads": threads or torch.get_num_threads(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "onednn_bf16": c.onednn_bf16,
        "compiler": compiler, "python": platform.python_version(),
        # what --device cuda would find: this PyTorch's CUDA (None: a CPU build), the GPUs it sees, Triton
        "torch_cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "triton": _installed("triton"),
    }
    if device != "cpu":  # the model runs on a GPU: the CPU's kernels above serve nothing of it
        out["device"] = f"{device} ({torch.cuda.get_device_name()})"
        if dtype == "auto":
            out["dtype"], out["dtype_why"] = "bf16", "auto: a GPU"
    return out


def _installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def one_line(f: dict) -> str:
    kernels = f"kernels {f['kernels']} ({f['kernels_why']})" if f["kernels"] else f"kernels none ({f['kernels_why']})"
    return (f"kvseal: {f['cpu']} [{' '.join(f['features']) or 'no listed features'}]; {kernels}; "
            f"dtype {f['dtype']} ({f['dtype_why']}); weights {f['weights']}; {f['threads']} threads; "
            f"torch {f['torch']}" + (f"; device {f['device']}" if "device" in f else "")
            + (f"; steps of {f['step_tokens']} tokens" if "step_tokens" in f else "")
            + ("; KV pages staged through host memory" if f.get("kv_staged") else ""))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"])
    p.add_argument("--json", action="store_true", help="one JSON object")


def run(a: argparse.Namespace) -> None:
    f = facts(a.dtype, a.weights)
    if a.json:
        print(json.dumps(f, indent=2))
        return
    width = max(len(k) for k in f)
    for k, v in f.items():
        print(f"{k:<{width}}  {(' '.join(map(str, v)) or 'none') if isinstance(v, list) else v}")
