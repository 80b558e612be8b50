"""Frozen configuration, layered model ⊂ pool ⊂ engine ⊂ server.

Config is validated once, in ``__post_init__``; runtime state never lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, SmolLM2, Qwen2-style)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_context: int
    tie_embeddings: bool = True
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class PoolConfig:
    """The node's paged KV pool: ``num_pages`` pages of ``page_size`` token slots."""

    num_pages: int
    page_size: int = 16
    scrub_on_free: bool = False

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError(f"bad pool shape: {self.num_pages} pages × {self.page_size}")

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)


@dataclass(frozen=True)
class Protections:
    """The safety layer, all on by default; turning one off needs KVSEAL_UNSAFE=1 (see cli)."""

    page_tags: bool = True  # check page tables against page tags before each forward pass
    admission: bool = True  # reject over-long requests at every admission point
    coverage: bool = True  # commit must cover every leased page
    checksum: bool = True  # xxh3-128 over page bytes + metadata
    deferred_release: bool = True  # prefill frees only after decode acks; abort-ack retention
    disconnect_guard: bool = True  # a client disconnect never cuts reserve or transfer in half
    cache_salt: bool = True  # prefix-cache keys are salted per tenant (off: tenants share cached prefixes)

    NAMES = ("page_tags", "admission", "coverage", "checksum", "deferred_release", "disconnect_guard",
             "cache_salt")

    @classmethod
    def none(cls) -> Protections:
        return cls(**{n: False for n in cls.NAMES})

    def off(self) -> list[str]:
        return [n for n in self.NAMES if not getattr(self, n)]


@dataclass(frozen=True)
class EngineConfig:
    pool: PoolConfig
    dtype: str = "bf16"
    max_running: int = 64  # decode batch size cap
    step_token_budget: int = 512  # tokens per engine step: decodes first, then prefill chunks
    context_window: int = 8192  # served context (may be capped by preflight)
    threads: int = 0  # torch threads; 0 = all cores
    prefix_cache: bool = False  # keep full prompt pages per tenant for reuse (servers turn it on by default)
    protections: Protections = field(default_factory=Protections)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.max_running <= 0 or self.step_token_budget <= 0:
            raise ValueError("max_running and step_token_budget must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def admit_limit(self) -> int:
        """Largest prompt + max_tokens this engine can ever serve."""
        return min(self.context_window, self.pool.capacity_tokens)
