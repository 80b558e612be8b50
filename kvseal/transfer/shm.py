"""The ``shm`` transport: the decode pool lives in a shared-memory file; prefill maps it and copies pages in.

The pool is page-major (``[page, L, 2, KVH, slot, D]``), so a run of pages consecutive on both sides is
one contiguous copy. The file name carries the decode worker's port and pid and 64 random bits, so two
decode workers never share a pool and nobody guesses it; it is created 0600 (only this user's processes, the
prefill among them, may map it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from kvseal.config import ModelConfig, PoolConfig
from kvseal.kv.pool import kv_shape
from kvseal.transfer.runs import chunks


def pool_shape(cfg: PoolConfig, m: ModelConfig) -> tuple[int, ...]:
    return kv_shape(cfg, m.num_layers, m.num_kv_heads, m.head_dim)


def sweep_orphans(root: Path = Path("/dev/shm")) -> list[Path]:
    """Remove the pool files of decode workers that died without closing them (a killed process leaves its
    whole pool in RAM-backed /dev/shm). The name carries the owner's pid; only this user's files are touched."""
    gone = []
    for p in root.glob("kvseal-decode-*"):
        parts = p.name.split("-")
        if len(parts) < 4 or not parts[3].isdigit():
            continue
        try:
            if p.stat().st_uid != os.getuid():
                continue
            os.kill(int(parts[3]), 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            gone.append(p)
        except (PermissionError, FileNotFoundError):
            continue
    return gone


class ShmPool:
    """Owner side (decode): creates the file and removes it at close; first sweeps dead workers' files."""

    def __init__(self, name: str) -> None:
        self.path = Path("/dev/shm") / name
        sweep_orphans(self.path.parent)

    def create(self, cfg: PoolConfig, m: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
        shape = pool_shape(cfg, m)
        n = math.prod(shape)
        self.path.unlink(missing_ok=True)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        t = torch.from_file(str(self.path), shared=True, size=n, dtype=dtype)
        return t.view(shape)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class ShmWriter:
    """Writer side (prefill): maps decode pools by path, once each."""

    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def target(self, path: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = self._maps.get(path)
        if t is None:
            if not os.path.exists(path):
                raise FileNotFoundError(f"decode pool {path} not found (is decode on this host?)")
            t = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
            self._maps[path] = t
        return t

    def write(self, src: torch.Tensor, src_pages: list[int], path: str, shape: list[int],
              dst_pages: list[int], transient: bool = False) -> None:
        """``transient``: ``src`` is a staged copy (kvseal.transfer.staging); plain memory to this transport."""
        dst = self.target(path, shape, src.dtype)
        for s, d, n in chunks(src_pages, dst_pages):  # one contiguous copy per run
            dst[d : d + n].copy_(src[s : s + n])

    def corrupt(self, path: str, shape: list[int], dtype: torch.dtype, dst_pages: list[int]) -> None:
        """Fault injection only: overwrite one slot of the first written page."""
        self.target(path, shape, dtype)[dst_pages[0], 0, 0, 0, 0].fill_(3.0)
