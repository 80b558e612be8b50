"""Fault in the KV pool's memory at startup.

A page of a fresh mapping costs a page fault at its first write: the kernel allocates and zeroes it (and in a
VM the host may have to back it too). Left to the first requests, those faults land inside the forward's K/V
stores: measured here, a fresh server's first 32 prompts of ~850 tokens spent 3.7 s of a 28 s run in them,
and steps varied 2x from run to run with the host's state. ``populate`` takes them all at startup
(``MADV_POPULATE_WRITE``, Linux 5.14+), leaving the contents as they are. 1.5 GiB took 1.3 s here. A
prefill worker's mapping of a decode pool (the shm transport) is left to fault lazily: its pages exist
already, so each fault is cheap, and populating all of them at the first transfer cost that request 0.4 s.

Transparent huge pages were tried and dropped: decode attention over scattered pages read no faster with them
in an A/B run (10.1-10.4 GB/s with 2 MB pages, 9.9-11.0 with 4 KB ones), and faulting 2 MB pages in cost 5x
more (7.3 s for 1.5 GiB: the kernel compacts memory to find them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14+
PAGE = 4096


def populate(t: torch.Tensor) -> bool:
    """Fault in (writable) every page of ``t``'s memory now, leaving its contents as they are. True if the
    kernel did; False (nothing changed) on kernels before 5.14 or off Linux."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return False
    libc = _libc()
    if libc is None:
        return False
    a = t.data_ptr()
    start, end = a & ~(PAGE - 1), a + t.numel() * t.element_size()
    return libc.madvise(start, end - start, MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """Found once: ``find_library`` runs a subprocess (ldconfig) at every call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc
