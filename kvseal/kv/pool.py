"""The node's paged KV pool: one preallocated tensor, integer page ids, a tag on every page.

Layout: ``kv[page, layer, 0|1, kv_head, offset, head_dim]``, identical on every node and page-major, so a
page is one contiguous block and a transfer of consecutive pages is one contiguous copy (one Mooncake chunk,
one memcpy). ``slot = page * page_size + offset``. Within a page, one layer's keys (or values) of one head
are a contiguous ``[offset, head_dim]`` row, which the model gathers straight into attention's layout.

Every page carries a tag ``(owner, tenant, generation, state)``. Freeing bumps the generation, so a page table entry
``(page, generation)`` taken at allocation goes stale the moment the page is freed. ``check_tables`` compares a
whole batch's page tables with the tags in one vectorized operation before every forward pass that reads the
pool. Freed pages are not zeroed (unless ``scrub_on_free``): safety comes from ownership, not from luck.

A SHARED page is read-only and reference counted: its owner is a *group* (the choices of one request, which
share their prompt's pages), every holder's table names it, and only the last holder's free returns it
(bumping its generation). The read-side check accepts a SHARED page only for a request of that group.

The prefix cache (``kvseal.kv.prefix``) keeps SHARED pages owned by a tenant's cache namespace, holding one
reference of its own (``cached``). Such a page with no other holder is *evictable*: ``can_allocate`` counts it
as available and ``allocate`` evicts (least recently used first) through the cache before it gives up.

Invariants (``check_integrity``): free + reserved + owned + quarantined + shared == total; a FREE page has no
owner and sits in the free list exactly once; a non-FREE page has exactly one owner; a page has references
if and only if it is SHARED; a cached page is SHARED.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike

from kvseal.config import PoolConfig
from kvseal.kv.tags import PageState
from kvseal.memory import populate

_STATE_NAMES = tuple(s.name.lower() for s in PageState)
_FREE, _SHARED = int(PageState.FREE), int(PageState.SHARED)


class PoolExhausted(RuntimeError):
    """allocate() was called without can_allocate(): a scheduler bug, never a client error."""


@dataclass(frozen=True)
class PageRun:
    """A request's pages and the generations they carried when allocated."""

    pages: tuple[int, ...]
    generations: tuple[int, ...]


class Reclaimer(Protocol):
    """What the pool asks of a cache that holds pages it could give back (kvseal.kv.prefix.PrefixCache)."""

    def evictable(self) -> int: ...

    def evict(self, n_pages: int) -> int: ...


def kv_shape(cfg: PoolConfig, num_layers: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The one definition of the pool layout, for the pool and for every transport's storage."""
    return (cfg.num_pages, num_layers, 2, kv_heads, cfg.page_size, head_dim)


class PagePool:
    def __init__(self, cfg: PoolConfig, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, storage: torch.Tensor | None = None, device: str | torch.device = "cpu",
                 landing: torch.Tensor | None = None) -> None:
        """``device``: where the pages live (a GPU's pool: ``LlamaModel.to_device``); tags stay in host memory,
        beside the page tables they are checked against. ``landing``: host memory of the pool's shape that a
        transport writes into when it cannot write the pool itself (``take_in``, kvseal.transfer.staging)."""
        self.cfg = cfg
        shape = kv_shape(cfg, num_layers, kv_heads, head_dim)
        if storage is None:
            # zeros, not empty: attention multiplies a masked slot's value by a zero weight, and a never-written
            # slot holding a NaN bit pattern (malloc'd memory) would turn that product into NaN
            storage = torch.zeros(shape, dtype=dtype, device=device)
        if storage.device.type == "cpu":
            populate(storage)  # page faults now, not in the first requests' forwards (kvseal.memory)
        for t in (storage, landing):
            if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
                raise ValueError(f"pool storage {tuple(t.shape)}/{t.dtype} != {shape}/{dtype}")
        if landing is not None:
            populate(landing)
        self.kv = storage
        self.landing = landing
        n = cfg.num_pages
        self.owner = torch.full((n,), -1, dtype=torch.int64)
        self.generation = torch.zeros(n, dtype=torch.int64)
        self.tenant = torch.zeros(n, dtype=torch.int32)  # tenant_tag of the request that took the page
        self.state = torch.zeros(n, dtype=torch.int8)
        self.refs = torch.zeros(n, dtype=torch.int32)  # holders of a SHARED page
        self.cached = torch.zeros(n, dtype=torch.bool)  # the prefix cache holds one of the page's references
        self.reclaimer: Reclaimer | None = None
        self._free: deque[int] = deque(range(n))
        self.integrity_failures = 0
        self._views_of: tuple | None = None
        self._checked: tuple | None = None  # the tags and free list the last check passed on

    # -- allocation: check, then commit ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages plus the cache's pages that nobody else holds: what allocation can have now."""
        return len(self._free) + (self.reclaimer.evictable() if self.reclaimer else 0)

    def can_allocate(self, n_pages: int) -> bool:
        return n_pages <= len(self._free) or (self.reclaimer is not None and n_pages <= self.num_available)

    def allocate(self, owner: int, n_pages: int, state: PageState = PageState.OWNED, tenant: int = 0) -> PageRun:
        if n_pages > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n_pages - len(self._free))
        if n_pages > len(self._free):
            raise PoolExhausted(f"need {n_pages} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n_pages)]
        idx = torch.tensor(pages, dtype=torch.int64)
        self.owner[idx] = owner
        self.tenant[idx] = tenant
        self.state[idx] = int(state)
        return PageRun(tuple(pages), tuple(self.generation[idx].tolist()))

    def set_state(self, run: PageRun, state: PageState) -> None:
        self.state[torch.tensor(run.pages, dtype=torch.int64)] = int(state)

    def share(self, pages: tuple[int, ...], group: int, holders: int) -> None:
        """Make ``pages`` read-only pages of ``group`` with ``holders`` references. An OWNED page (its owner is
        one of the holders) becomes SHARED; an already SHARED page (one holder has it) keeps its owner and gains
        ``holders - 1`` references. Generations stay, so every holder's ``(page, generation)`` stays valid."""
        idx = torch.tensor(pages, dtype=torch.int64)
        state = self.state[idx]
        if not bool(((state == PageState.OWNED) | (state == PageState.SHARED)).all()):
            raise RuntimeError(f"only owned or shared pages can be shared: {pages}")
        owned = idx[state == PageState.OWNED]
        self.owner[owned] = group
        self.state[owned] = int(PageState.SHARED)
        self.refs[owned] = holders
        self.refs[idx[state == PageState.SHARED]] += holders - 1

    def acquire(self, pages: tuple[int, ...]) -> None:
        """One more holder for SHARED pages (a prefix-cache hit)."""
        self.refs[torch.tensor(pages, dtype=torch.int64)] += 1

    def _split(self, run: PageRun) -> PageRun:
        """Drop this holder's references to the run's SHARED pages (the last one frees them); the rest.
        One vectorized look at the states: every free passes here."""
        if not run.pages:
            return run
        shared = (self.state[torch.tensor(run.pages, dtype=torch.int64)] == PageState.SHARED).tolist()
        if not any(shared):
            return run
        idx = torch.tensor([p for p, sh in zip(run.pages, shared) if sh], dtype=torch.int64)
        self.refs[idx] -= 1
        last = idx[self.refs[idx] == 0].tolist()
        if last:
            self.state[torch.tensor(last)] = int(PageState.OWNED)
            self.free(PageRun(tuple(last), ()))
        keep = [i for i, sh in enumerate(shared) if not sh]
        return PageRun(tuple(run.pages[i] for i in keep), tuple(run.generations[i] for i in keep))

    def quarantine(self, run: PageRun) -> PageRun:
        """Take pages out of every page table (tags say so) without returning them to the free list. Shared
        pages are only let go (no writer targets them); returns the pages now quarantined."""
        run = self._split(run)
        self.set_state(run, PageState.QUARANTINED)
        return run

    def free(self, run: PageRun) -> None:
        if not run.pages:
            return
        run = self._split(run)
        if not run.pages:
            return
        idx = torch.tensor(run.pages, dtype=torch.int64)
        if (self.state[idx] == PageState.FREE).any():
            raise RuntimeError(f"double free in {run.pages}")
        self.owner[idx] = -1
        self.generation[idx] += 1
        self.state[idx] = int(PageState.FREE)
        if self.cfg.scrub_on_free:
            self.kv.index_fill_(0, idx.to(self.kv.device), 0)
            if self.landing is not None:
                self.landing.index_fill_(0, idx, 0)
        self._free.extend(run.pages)

    def take_in(self, pages: tuple[int, ...] | list[int]) -> None:
        """Copy these pages, and no others, from the landing area into the pool: a staged transfer has arrived
        (kvseal.transfer.staging). Nothing to do for a pool the transport writes itself."""
        if self.landing is None or not pages:
            return
        idx = torch.tensor(pages, dtype=torch.int64)
        dev = self.kv.device
        self.kv.index_copy_(0, idx.to(dev), self.landing.index_select(0, idx).to(dev))

    # -- the read-side check --------------------------------------------------------------------------
    def check_tables(self, table: ArrayLike, gens: ArrayLike, owners: ArrayLike, valid: ArrayLike,
                     groups: ArrayLike | None = None, spaces: ArrayLike | None = None,
                     tenants: ArrayLike | None = None) -> np.ndarray:
        """One vectorized comparison of a batch's page tables [B, P] with the tags: ok per request [B]. A page
        passes if the request owns it, or if it is SHARED and owned by the request's group or by its tenant's
        cache namespace; and, given ``tenants``, only if it is tagged with the request's tenant. NumPy over
        views of the tag tensors (the same memory): in a one-stream step, right after the weights have
        streamed through the caches, it takes 0.20 ms where PyTorch's per-op overhead made it 0.31 ms."""
        table, valid = np.asarray(table), np.asarray(valid)
        owner, state = self.owner.numpy()[table], self.state.numpy()[table]
        mine = (owner == np.asarray(owners)[:, None]) & (state == PageState.OWNED)
        shared = state == PageState.SHARED
        if groups is not None:
            mine |= (owner == np.asarray(groups)[:, None]) & shared
        if spaces is not None:
            mine |= (owner == np.asarray(spaces)[:, None]) & shared
        ok = mine & (self.generation.numpy()[table] == np.asarray(gens))
        if tenants is not None:
            ok &= self.tenant.numpy()[table] == np.asarray(tenants)[:, None]
        return (ok | ~valid).all(axis=1)

    def run_ok(self, run: PageRun, owner: int, state: PageState, tenant: int | None = None) -> bool:
        idx = torch.tensor(run.pages, dtype=torch.int64)
        gens = torch.tensor(run.generations, dtype=torch.int64)
        ok = (self.owner[idx] == owner) & (self.generation[idx] == gens) & (self.state[idx] == int(state))
        if tenant is not None:
            ok &= self.tenant[idx] == tenant
        return bool(ok.all())

    def holding(self, run: PageRun, owner: int, *shared_owners: int | None) -> PageRun:
        """The part of ``run`` whose tags still name this request (its own pages, or shared ones of its group or
        cache namespace): what a request that failed its check may let go. Pages tagged for anyone else are not
        its to touch."""
        idx = torch.tensor(run.pages, dtype=torch.int64)
        gens = torch.tensor(run.generations, dtype=torch.int64)
        own, state = self.owner[idx], self.state[idx]
        ok = (own == owner) & (state != PageState.FREE) & (state != PageState.SHARED)
        for group in shared_owners:
            if group is not None:
                ok |= (own == group) & (state == PageState.SHARED)
        keep = (ok & (self.generation[idx] == gens)).nonzero().flatten().tolist()
        return PageRun(tuple(run.pages[i] for i in keep), tuple(run.generations[i] for i in keep))

    # -- conservation ---------------------------------------------------------------------------------
    # Through numpy views of the tag tensors (no copy), with the states as plain ints (numpy probes an IntEnum
    # for array attributes at every comparison): the same vectorized checks at a fraction of torch's per-op
    # cost, which on the simulator's small pools was 80% of its run time.
    def _tag_views(self) -> tuple[np.ndarray, ...]:
        """The tag tensors as numpy arrays sharing their memory, made again only if a tensor was replaced."""
        tags = (self.state, self.owner, self.refs, self.cached)
        if self._views_of is None or any(a is not b for a, b in zip(tags, self._views_of)):
            self._views_of, self._views = tags, tuple(t.numpy() for t in tags)
        return self._views

    def counts(self) -> dict[str, int]:
        return dict(zip(_STATE_NAMES, np.bincount(self._tag_views()[0], minlength=len(PageState)).tolist()))

    def check_integrity(self) -> None:
        """Raise AssertionError if pages are not conserved or a page is in two places."""
        state, owner, refs, cached = self._tag_views()
        # a pure function of the tags and the free list: those it passed on last time pass again (the simulator
        # checks every pool after every event, and most events leave most pools as they were)
        seen = (state.tobytes(), owner.tobytes(), refs.tobytes(), cached.tobytes(), tuple(self._free))
        if seen == self._checked:
            return
        per_state = np.bincount(state, minlength=len(PageState))
        assert per_state.size == len(PageState), "a page has a state that does not exist"
        free = np.fromiter(self._free, dtype=np.int64, count=len(self._free))
        assert len(set(self._free)) == len(free), "a page is in the free list twice"
        assert per_state[_FREE] == len(free), f"free list {len(free)} != FREE tags {per_state[_FREE]}"
        assert (state[free] == _FREE).all()
        assert np.where(state == _FREE, owner == -1, owner >= 0).all(), "a FREE page has an owner, or a used one none"
        shared = state == _SHARED
        assert ((refs > 0) == shared).all(), "a page has references but is not SHARED, or none but is"
        assert shared[cached].all(), "a cached page is not SHARED"
        self._checked = seen

    def owned_by(self, owner: int) -> int:
        return int(((self.owner == owner) & (self.state != PageState.FREE)).sum())
