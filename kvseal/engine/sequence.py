"""One request's state inside an engine: its tokens, its pages, where it stands, and where its output goes.

``tokens`` is prompt + generated; ``num_cached`` counts the tokens whose K/V are in the pool. ``run`` holds
the pages allocated so far, in position order; it grows a page at a time as the request does, and a
preemption empties it (``num_cached`` back to 0: the tokens are recomputed).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvseal.engine.request import Event, SamplingParams
from kvseal.engine.sampling import Logprob, make_generator
from kvseal.kv.pool import PageRun


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFER = "transfer"  # prefill role: KV written out, waiting for decode's ack
    DONE = "done"


@dataclass(eq=False)
class Sequence:
    rid: int
    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    eos_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    run: PageRun | None = None
    phase: Phase = Phase.WAITING
    arrived: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    lease: object | None = None  # prefill role: where the KV goes
    group: int | None = None  # the choices of one request (n > 1) share their prompt's pages; the leader's rid
    matcher: object | None = None  # response_format's grammar state (kvseal.engine.grammar)
    logprob: Logprob | None = None  # the last sampled token's, when asked for
    prompt_lps: list[Logprob] = field(default_factory=list)  # prompt tokens 1.. so far, when asked for
    tenant: str = "default"
    cache_salt: str = ""  # vLLM's cache_salt: keys apart from the tenant's other requests' (kvseal.kv.prefix)
    tenant_tag: int = 0  # kvseal.kv.pool.tenant_tag of it, set at admission: on every page the request takes
    space: int | None = None  # the tenant's prefix-cache namespace (an owner id of shared pages)
    cache_keys: list[int] | None = None  # one per full prompt block, once looked up
    registered: int = 0  # prompt blocks already in the cache (hit or kept)
    cached_tokens: int = 0  # prompt tokens read from the cache at admission

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)
        self.generator = make_generator(self.params)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def budget_tokens(self) -> int:
        """Prompt + max_tokens: what admission checks and what the reservation covers."""
        return len(self.prompt) + self.params.max_tokens

    def finish_reason(self, token: int) -> str | None:
        if token in self.params.stop_token_ids or (token in self.eos_ids and not self.params.ignore_eos):
            return "stop"
        if self.num_output >= self.params.max_tokens:
            return "length"
        return None
