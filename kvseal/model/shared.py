"""One copy of the packed weights for every worker of one host.

On one host (``kvseal serve``) prefill and decode load the same model into two processes; each would hold its
own packed copy (2.5 GB apiece for a Llama-3.2-1B shape). Instead the first worker to load writes what its
kernels read (the GEMM's packed weights, norms, biases, the embedding) to one file, and every worker maps
that file read-only, shared: the page cache holds the weights once, whoever maps them.

- ``kvseal serve`` puts the file in its private (0700) directory and removes it when it stops; workers
  started by hand share a file with ``--shared-weights FILE``.
- The file's header names what it holds (checkpoint, its size and time, dtype, weight mode, kernel level,
  dummy or not); a worker whose own key differs loads its own copy and says so, never reads a stranger's.
- Writers and readers serialise on ``FILE.lock`` (``flock``); the file appears complete under its name in
  one rename, or not at all.
- Only the GEMM's bf16 layout is shared. Where a linear layer runs another kernel (int8/int4 modes, biases
  without the GEMM, the generic level) the worker keeps its own copy, as before.

Layout: 8 bytes of header length, a JSON header ``{"key", "tensors": {name: [offset, shape, dtype]}}``, then
each tensor at a 64-byte-aligned offset.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Self

import torch

ALIGN = 64
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
LAYER_TENSORS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "bqkv", "bo",
                 "b_gate_up", "b_down")
LINEARS = ("qkv", "o", "gate_up", "down")


def shareable(model: object) -> bool:
    """Every linear layer (the head too) runs the GEMM from its packed bf16 copy."""
    lins = [getattr(lin, n) for lin in model.lin for n in LINEARS]
    return (model.weights_mode == "bf16" and model.head.gemm is not None
            and all(x.gemm is not None and x.weight.is_meta for x in lins))


def tensors(model: object) -> dict[str, torch.Tensor]:
    """What the kernels read once the weights are packed and released."""
    out: dict[str, torch.Tensor] = {"embed": model.w.embed, "norm": model.w.norm, "head.packed": model.head.packed}
    for i, (x, lin) in enumerate(zip(model.w.layers, model.lin)):
        for f in LAYER_TENSORS:
            t = getattr(x, f)
            if t is not None:
                out[f"{i}.{f}"] = t
        for n in LINEARS:
            out[f"{i}.{n}.packed"] = getattr(lin, n).packed
    return out


def write(path: Path, key: dict, named: dict[str, torch.Tensor]) -> None:
    entries, offset = {}, 0
    for name, t in named.items():
        offset = -(-offset // ALIGN) * ALIGN
        entries[name] = [offset, list(t.shape), str(t.dtype).removeprefix("torch.")]
        offset += t.numel() * t.element_size()
    header = json.dumps({"key": key, "tensors": entries}).encode()
    base = -(-(8 + len(header)) // ALIGN) * ALIGN
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for name, t in named.items():
                f.seek(base + entries[name][0])
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            f.truncate(base + offset)
        tmp.rename(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # never a half-written file left behind
        raise


def read(path: Path, key: dict) -> dict[str, torch.Tensor] | None:
    """The file's tensors as views of one shared, read-only-by-convention mapping, or None if it holds
    another key (or is unreadable)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    stored = dict(header.get("key") or {})
    stored.pop("config", None)  # written beside the key, for the readers
    if stored != key:
        return None
    size = path.stat().st_size
    buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    base = -(-(8 + n) // ALIGN) * ALIGN
    out = {}
    for name, (offset, shape, dtype) in header["tensors"].items():
        dt = DTYPES[dtype]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        out[name] = buf[base + offset: base + offset + nbytes].view(dt).view(shape)
    return out


class Lock:
    def __init__(self, path: Path) -> None:
        self.path = path.with_name(path.name + ".lock")

    def __enter__(self) -> Self:
        self.f = open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()
