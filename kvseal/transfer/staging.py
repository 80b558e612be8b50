"""Pools a transport cannot reach (a GPU's): the pages move through host memory, checked where they end up.

Both transports write into host memory: the shm file, or memory registered with Mooncake. A pool on a GPU is
neither, so for such a pool the page bytes take one more hop on each side:

- **Prefill** copies the pages it is about to send into a host tensor (pinned when the pool is on a GPU) with
  one gather (``stage_out``). It hashes that copy and sends that copy, so the checksum covers the bytes that
  left.
- **Decode** gives the transport a *landing* area: host memory of the pool's shape, at the same page ids
  (``PagePool.landing``). Prefill writes a lease's pages there, and the transport's own protections (exposure
  of open leases only, on Mooncake) apply to it as they do to a host pool. When the commit arrives and the
  lease's tags hold, decode copies the lease's own pages (and no other) from the landing area into its pool
  (``PagePool.take_in``), then computes the checksum over the bytes now *in the pool*. A transfer
  that skipped pages or a copy that went wrong fails the checksum like any other bad transfer.

A host pool needs none of this: the transport writes the pool itself. ``KVSEAL_KV_STAGING=1`` forces the staged
path on a host pool too, so the tests run the code a GPU runs on a machine with no GPU.
"""

from __future__ import annotations

import os

import torch

ENV = "KVSEAL_KV_STAGING"


def forced() -> bool:
    return os.environ.get(ENV, "") == "1"


def staged(device: str | torch.device) -> bool:
    """Whether a pool on ``device`` moves its pages through host memory."""
    return torch.device(device).type != "cpu" or forced()


def stage_out(kv: torch.Tensor, pages: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The pages to send and where they are: the pool itself for a host pool, else a host copy of just these
    pages (one gather, one device-to-host copy), numbered from 0."""
    if not staged(kv.device):
        return kv, pages
    idx = torch.tensor(pages, dtype=torch.int64, device=kv.device)
    out = torch.empty((len(pages), *kv.shape[1:]), dtype=kv.dtype, pin_memory=kv.is_cuda)
    out.copy_(kv.index_select(0, idx))
    return out, list(range(len(pages)))
