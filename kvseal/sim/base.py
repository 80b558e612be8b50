"""What every part of the simulated cluster shares: its knobs, its requests, page patterns, the node base class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvseal.config import PoolConfig
from kvseal.kv.pool import PagePool, PageRun, PageState
from kvseal.protocol.machine import Variants

if TYPE_CHECKING:
    from kvseal.sim.world import World

PAGE = 4  # token slots per page
NEVER = -1.0  # the pattern of a slot nobody wrote since the node booted
LENGTHS = (2, 5, 8, 13, 21, 30, 37)  # prompt lengths: some fill a page exactly, some fit no pool


class Violation(AssertionError):
    pass


@dataclass
class Knobs:
    requests: int = 8
    drop: float = 0.04
    dup: float = 0.06
    corrupt: float = 0.03
    max_delay: float = 2.0
    crash: float = 0.03  # per chaos tick (1 time unit), some node crashes
    slow: float = 0.08  # a live prefill's health probe times out
    leave: float = 0.25  # a client leaves at some random moment
    decode_pages: int = 10
    prefill_pages: int = 7
    ttl: float = 12.0
    horizon: float = 40.0  # new requests and faults stop here; then the cluster must drain
    drain: float = 400.0


class NoBumpPool(PagePool):
    """The ``lease_reuse`` variant's pool: a freed page keeps its generation."""

    def free(self, run: PageRun) -> None:
        pages = [p for p in run.pages if self.state[p] != PageState.SHARED]
        super().free(run)
        if pages:
            self.generation[torch.tensor(pages)] -= 1


def new_pool(pages: int, variants: Variants) -> PagePool:
    cls = NoBumpPool if variants.lease_reuse else PagePool
    pool = cls(PoolConfig(num_pages=pages, page_size=PAGE), 1, 1, 2, torch.float32)
    pool.kv.fill_(NEVER)
    return pool


@dataclass
class Request:
    rid: int
    tenant: str
    n_prompt: int
    max_new: int
    over_long: bool  # for some pool on its path: it can never be served
    corrupted: bool = False  # a fault changed its bytes or its commit on the way
    ended: str = ""  # "" while open; else the status it ended with
    served: bool = False


def error_status(e: BaseException) -> str:
    return str(getattr(e, "status", 503))



class Node:
    """A worker process: ``boot`` builds its state from nothing; a crash loses all of it."""

    def __init__(self, world: World, name: str) -> None:
        self.w, self.name = world, name
        self.inc = 0
        self.boot()

    def crash(self) -> None:
        self.w.log(f"{self.name} crashes")
        self.up = False

    def restart(self) -> None:
        if not self.up:
            self.w.log(f"{self.name} restarts")
            self.boot()

    def boot(self) -> None:
        raise NotImplementedError


def write_pattern(kv: torch.Tensor, pages: list[int], n: int, serial: int) -> None:
    for i in range(n):
        page, off = pages[i // PAGE], i % PAGE
        kv[page, :, :, :, off, 0] = float(serial)
        kv[page, :, :, :, off, 1] = float(i)
