"""The ``mooncake`` transport: one-sided writes with Mooncake's TransferEngine (TCP here, RDMA on clusters).

Prefill registers its pool with its engine (``P2PHANDSHAKE`` metadata, no etcd). Decode does *not* register
its pool: it registers each open lease's pages (``expose``) and withdraws them when the lease stops taking
writes (``conceal``: committed, rejected or aborted), so Mooncake's own address check refuses any write
outside an open lease, late writes into a running request's pages included. The decode lease names
``host:rpc_port|pool_address``; prefill writes each page straight into the leased decode page. The
pool is page-major (``[page, L, 2, KVH, slot, D]``), so a page is one contiguous block and a run of pages
consecutive on both sides is one chunk: the allocator's habit of handing out consecutive pages turns a
lease into one or a few large transfers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvseal.transfer.runs import chunks

PIECE = 1 << 20  # bench/transfer.py: 1 MiB pieces move 1.3-2x faster over loopback TCP than one whole run


@dataclass(frozen=True)
class MooncakeConfig:
    """``protocol``: ``tcp`` or ``rdma``; ``devices``: RDMA NICs to use, comma-separated (``mlx5_0,mlx5_1``),
    empty for Mooncake's own choice."""

    protocol: str = "tcp"
    devices: str = ""

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, not {self.protocol!r}")


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _engine(host: str, cfg: MooncakeConfig = MooncakeConfig()) -> object:
    """A started TransferEngine. RDMA without a device on this host is refused here, by name, rather than
    left to fail somewhere inside the first transfer."""
    if cfg.protocol == "rdma":
        found = rdma_devices()
        wanted = [d for d in cfg.devices.split(",") if d]
        missing = [d for d in wanted if d not in found]
        if not found or missing:
            raise RuntimeError(f"--mooncake-protocol rdma: no RDMA device {'named ' + ','.join(missing) if missing else ''}"
                               f" on this host (found: {', '.join(found) or 'none in /sys/class/infiniband'}); "
                               "use --mooncake-protocol tcp, or name a device with --mooncake-devices")
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize(host, "P2PHANDSHAKE", cfg.protocol, cfg.devices)
    if rc != 0:
        raise RuntimeError(f"mooncake TransferEngine.initialize({host!r}, {cfg.protocol}) failed: {rc}")
    return e


class MooncakePool:
    """Decode side: registers the pool and says where it is."""

    def __init__(self, host: str, cfg: MooncakeConfig = MooncakeConfig()) -> None:
        self.host = host
        self.engine = _engine(host, cfg)
        self.kv: torch.Tensor | None = None
        self.exposed: dict[int, list[int]] = {}  # lease rid → addresses of its registered page runs

    def create(self, cfg: object, m: object, dtype: torch.dtype) -> torch.Tensor:
        from kvseal.transfer.shm import pool_shape

        self.kv = torch.empty(pool_shape(cfg, m), dtype=dtype)
        return self.kv

    def expose(self, rid: int, pages: list[int]) -> None:
        """Register the lease's pages (one region per run of consecutive pages): writable by peers until
        ``conceal``. Measured: ~2 µs per register + unregister on TCP."""
        page = self.kv[0].nbytes
        addrs = []
        for _, first, n in chunks(sorted(pages), sorted(pages)):
            addr = self.kv.data_ptr() + first * page
            if self.engine.register_memory(addr, n * page) != 0:
                for a in addrs:
                    self.engine.unregister_memory(a)
                raise RuntimeError("mooncake register_memory failed for a lease")
            addrs.append(addr)
        self.exposed[rid] = addrs

    def conceal(self, rid: int) -> None:
        for addr in self.exposed.pop(rid, ()):
            self.engine.unregister_memory(addr)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.engine.get_rpc_port()}|{self.kv.data_ptr()}"

    def close(self) -> None:
        for rid in list(self.exposed):
            self.conceal(rid)


class MooncakeWriter:
    """Prefill side: registers its own pool once, then writes pages with one batched transfer."""

    name = "mooncake"

    def __init__(self, host: str, cfg: MooncakeConfig = MooncakeConfig()) -> None:
        self.engine = _engine(host, cfg)
        self._registered: set[int] = set()
        self._scratch = torch.full((4096,), 3.0)
        self._register(self._scratch)

    def _register(self, t: torch.Tensor) -> None:
        if t.data_ptr() not in self._registered:
            if self.engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError("mooncake register_memory failed")
            self._registered.add(t.data_ptr())

    def plan(self, src: torch.Tensor, src_pages: list[int], layout: list[int], base: int,
             dst_pages: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Source addresses, destination addresses and lengths: each run of consecutive pages, cut into
        pieces of at most ``PIECE`` bytes, which Mooncake's TCP transport moves in parallel."""
        page_bytes = math.prod(layout[1:]) * src.element_size()
        runs = np.array(chunks(src_pages, dst_pages), dtype=np.int64).reshape(-1, 3) * page_bytes
        s, d, n = [], [], []
        for s0, d0, length in runs.tolist():
            for off in range(0, length, PIECE):
                s.append(src.data_ptr() + s0 + off)
                d.append(base + d0 + off)
                n.append(min(PIECE, length - off))
        return s, d, n

    def write(self, src: torch.Tensor, src_pages: list[int], target: str, layout: list[int],
              dst_pages: list[int], transient: bool = False) -> None:
        """``transient``: ``src`` is a staged copy of a GPU pool's pages (kvseal.transfer.staging), registered for
        this write only; the pool itself is registered once and stays."""
        if transient:
            if self.engine.register_memory(src.data_ptr(), src.nbytes) != 0:
                raise RuntimeError("mooncake register_memory failed for a staged transfer")
        else:
            self._register(src)
        try:
            session, base = target.rsplit("|", 1)
            s, d, n = self.plan(src, src_pages, layout, int(base), dst_pages)
            rc = self.engine.batch_transfer_sync_write(session, s, d, n)
            if rc != 0:
                raise RuntimeError(f"mooncake batch write to {session} failed: {rc}")
        finally:
            if transient:
                self.engine.unregister_memory(src.data_ptr())

    def corrupt(self, target: str, layout: list[int], dtype: torch.dtype, dst_pages: list[int]) -> None:
        """Fault injection only: overwrite the start of the first written page with garbage."""
        session, base = target.rsplit("|", 1)
        elem = torch.empty((), dtype=dtype).element_size()
        page_bytes = math.prod(layout[1:]) * elem
        self.engine.transfer_sync_write(session, self._scratch.data_ptr(), int(base) + dst_pages[0] * page_bytes, 64)
