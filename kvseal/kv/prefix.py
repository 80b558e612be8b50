"""The prefix cache: full prompt pages kept after their request ends, reused by later requests of the same tenant.

A prompt is cut into page-sized blocks. Block ``i``'s key is a hash chain,
``xxh3_128(salt ‖ key[i-1] ‖ tokens of block i)``, so a key names the whole prefix up to and including its
block. The salt is an HMAC of the tenant's name under a secret the node draws at start: a client cannot choose
it, and the same prompt of two tenants gives unrelated keys. Nothing a client sends widens sharing.

A cached page is a SHARED page (``kvseal.kv.pool``) owned by the tenant's *namespace* (an owner id above every
request id) with one reference held by the cache. A hit gives the request one more reference and puts
``(page, generation)`` into its table; the page-tag check accepts a SHARED page only for a request whose
namespace owns it. Only pages nobody else holds are evicted, least recently used first (lookups touch a chain
from its end back to its start, so a prefix's later blocks go before its earlier ones); eviction frees the page,
which bumps its generation as every free does.

Only blocks the prompt fills completely are cached, and a request always computes at least its last prompt
token (its logits start the output), so no request ever writes into a cached page.

With ``salted=False`` (a known-unsafe switch, for the probe's timing test) every tenant shares one namespace,
like a cache without per-tenant salts. A request may add its own ``cache_salt`` (vLLM's field): its keys then
match only requests of its tenant that send the same salt (``keys``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from kvseal.kv.pool import PagePool, PageRun, PageState

NAMESPACE_BASE = 1 << 62  # request ids are below it (62 random bits); a namespace's owner id is above
SHARED_NAMESPACE = ""  # the one namespace of an unsalted cache


@dataclass
class Entry:
    page: int
    generation: int
    owner: int


class PrefixCache:
    def __init__(self, pool: PagePool, salted: bool = True, secret: bytes | None = None) -> None:
        self.pool = pool
        self.ps = pool.cfg.page_size
        self.salted = salted
        self._secret = secret or os.urandom(32)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # key → entry, least recently used first
        self._spaces: dict[str, tuple[int, bytes]] = {}  # tenant → (owner id, salt)
        pool.reclaimer = self

    # -- namespaces and keys ------------------------------------------------------------------------------
    def namespace(self, tenant: str) -> int:
        return self._space(tenant)[0]

    def _space(self, tenant: str) -> tuple[int, bytes]:
        name = tenant if self.salted else SHARED_NAMESPACE
        space = self._spaces.get(name)
        if space is None:
            salt = hmac.new(self._secret, name.encode(), hashlib.sha256).digest()
            space = self._spaces[name] = (NAMESPACE_BASE + len(self._spaces), salt)
        return space

    def keys(self, tenant: str, prompt: list[int], cache_salt: str = "") -> list[int]:
        """One key per full block of ``prompt``. A request's ``cache_salt`` (vLLM's) derives its own salt from its
        tenant's: its keys match only requests of the same tenant with the same salt. Its pages stay in the
        tenant's namespace (no namespace per salt: a client cannot grow this table), so the page-tag check still
        draws the line between tenants and the salt between the keys."""
        salt = self._space(tenant)[1]
        if cache_salt:
            salt = hmac.new(salt, cache_salt.encode(), hashlib.sha256).digest()
        raw = torch.tensor(prompt, dtype=torch.int32).numpy().tobytes()
        step = 4 * self.ps
        keys, prev = [], b""
        for i in range(len(prompt) // self.ps):
            prev = xxhash.xxh3_128_digest(salt + prev + raw[i * step:(i + 1) * step])
            keys.append(int.from_bytes(prev, "little"))
        return keys

    # -- hits and inserts -----------------------------------------------------------------------------------
    def lookup(self, keys: list[int], owner: int) -> PageRun:
        """The longest cached chain of ``keys`` in ``owner``'s namespace, each page with one more reference."""
        hits: list[Entry] = []
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.owner != owner:
                break
            hits.append(e)
        for k in reversed(keys[:len(hits)]):  # the chain's start ends most recently used: evicted last
            self._entries.move_to_end(k)
        run = PageRun(tuple(e.page for e in hits), tuple(e.generation for e in hits))
        if hits:
            self.pool.acquire(run.pages)
        return run

    def insert(self, key: int, page: int, generation: int, owner: int) -> bool:
        """Keep a request's just-filled prompt page: it becomes SHARED in ``owner``'s namespace, held by the
        request and by the cache. False (the page stays the request's own) if the key is already cached."""
        if key in self._entries or self.pool.state[page] != PageState.OWNED:
            return False
        self.pool.share((page,), owner, 2)
        self.pool.cached[page] = True
        self._entries[key] = Entry(page, generation, owner)
        return True

    # -- eviction (the pool's Reclaimer) --------------------------------------------------------------------
    def evictable(self) -> int:
        return int((self.pool.cached & (self.pool.refs == 1)).sum())

    def evict(self, n_pages: int) -> int:
        """Free up to ``n_pages`` cached pages that nobody else holds, least recently used first."""
        idle = set((self.pool.cached & (self.pool.refs == 1)).nonzero().flatten().tolist())  # one look, no loop
        gone: list[int] = []
        for k, e in self._entries.items():
            if len(gone) == n_pages:
                break
            if e.page in idle:
                gone.append(k)
        for k in gone:
            self._drop(k)
        return len(gone)

    def clear(self) -> int:
        """Evict every page nobody else holds."""
        return self.evict(len(self._entries))

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.pool.cached[e.page] = False
        self.pool.free(PageRun((e.page,), (e.generation,)))  # the cache's reference was the last one

    @property
    def pages(self) -> int:
        """Pages the cache holds (some may also be in use)."""
        return len(self._entries)
