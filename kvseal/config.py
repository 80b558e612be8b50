"""Frozen configuration, layered model ⊂ pool ⊂ engine ⊂ server.

Config is validated once, in ``__post_init__``; runtime state never lives here.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}  # → torch's names


def torch_dtype(name: str) -> torch.dtype:
    """``bf16`` / ``fp32`` (or torch's own names) as a torch dtype. PyTorch is imported here, not at the top:
    the router reads this configuration and never loads it."""
    import torch

    return getattr(torch, DTYPES[name])


@dataclass(frozen=True)
class ModelConfig:
    """Shape and arithmetic of a Llama-family decoder: Llama 2/3.x, SmolLM2, Mistral, Qwen2/2.5/3, Gemma 2/3,
    Phi-3 (``kvseal.model.arch`` reads a checkpoint's config into this and refuses what it cannot honour).

    Fields past ``eos_token_ids`` describe where a family departs from plain Llama; their defaults are Llama's.
    """

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
    # RoPE scaling in Hugging Face's ``rope_parameters`` form (rope_type + its parameters); None = plain RoPE
    rope: dict | None = None
    # RoPE of sliding-window layers where it differs from the global one (Gemma 3's local layers)
    rope_local: dict | None = None
    layer_windows: tuple[int, ...] = ()  # per layer: a token sees this many positions, itself included; 0 = all
    attn_softcap: float = 0.0  # scores = cap * tanh(scores / cap) before the softmax (Gemma 2); 0 = none
    final_softcap: float = 0.0  # the same on the output logits
    attn_scale: float = 0.0  # scores' scale; 0 = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight), in fp32 (Gemma)
    act: str = "silu"  # the gate's activation: silu | gelu_tanh
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) in the model's dtype (Gemma)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on attention's and the MLP's outputs too (Gemma 2/3)
    o_bias: bool = False  # o_proj has a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down have biases (Llama mlp_bias)

    @property
    def plain(self) -> bool:
        """Plain Llama arithmetic (RoPE scaling and q/k/v biases aside), which the native kernels implement;
        any other model runs the plain-PyTorch reference layers."""
        return (not any(0 < w < self.max_context for w in self.layer_windows) and not self.attn_softcap
                and not self.final_softcap and not self.attn_scale and not self.norm_offset and self.act == "silu"
                and not self.embed_scale and not self.qk_norm and not self.sandwich_norms and not self.o_bias
                and not self.mlp_bias and self.rope_local is None)

    def window(self, layer: int) -> int:
        """How many positions a token of ``layer`` sees (itself included), or 0 for all of them."""
        w = self.layer_windows[layer] if self.layer_windows else 0
        return w if 0 < w < self.max_context else 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows names {len(self.layer_windows)} layers, the model has {self.num_layers}")
        if self.act not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.act!r} is not supported (silu, gelu_tanh)")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        elem = dtype.itemsize
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

    @classmethod
    def from_args(cls, a: object) -> Protections:
        """From parsed ``--unsafe-no-<name>`` flags (``UNSAFE_FLAGS``); any off needs ``KVSEAL_UNSAFE=1``."""
        off = {n for n in cls.NAMES if getattr(a, f"unsafe_{n}", False) or getattr(a, "unsafe_no_all", False)}
        if off and os.environ.get("KVSEAL_UNSAFE") != "1":
            sys.exit(f"refusing to turn off protections {sorted(off)}: set KVSEAL_UNSAFE=1 (tests only)")
        return cls(**{n: n not in off for n in cls.NAMES})


UNSAFE_FLAGS = {n: f"--unsafe-no-{n.replace('_', '-')}" for n in Protections.NAMES}
"""Each protection's switch, for tests and the protections benchmark only."""


# Tokens per engine step when --step-token-budget is not given. An engine that decodes keeps steps short: the
# budget bounds its streams' inter-token gap. A prefill worker has no streams of its own, and each step reads
# every weight once, so its chunks are twice as long: on one host (kvseal serve, the two workers taking turns
# on the cores) 32 streams of ~850-token prompts ran 84.6 -> 87.7 tok/s (3 runs each, Zen 4), with decode's
# inter-token p99 unchanged (0.78 s); 2,048 added nothing more and doubled that p99.
STEP_TOKENS = {"prefill": 1024}
STEP_TOKENS_DEFAULT = 512


def step_token_budget(given: int | None, role: str) -> int:
    return given or STEP_TOKENS.get(role, STEP_TOKENS_DEFAULT)


@dataclass(frozen=True)
class EngineConfig:
    pool: PoolConfig
    dtype: str = "bf16"
    max_running: int = 64  # decode batch size cap
    step_token_budget: int = STEP_TOKENS_DEFAULT  # tokens per engine step: decodes first, then prefill chunks
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
        return torch_dtype(self.dtype)

    @property
    def admit_limit(self) -> int:
        """Largest prompt + max_tokens this engine can ever serve."""
        return min(self.context_window, self.pool.capacity_tokens)


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's flags as given (``kvseal.cli.worker_spec``); ``kvseal.engine.build`` turns them into an engine."""

    model: str | None = None
    dtype: str = "auto"  # auto | bf16 | fp32 (kvseal.model.cpu.resolve_dtype)
    kv_pool_tokens: int | None = None
    kv_memory_gib: float = 1.5
    page_size: int = 16
    context: int | None = None
    allow_pool_below_context: bool = False
    max_running: int = 64
    step_token_budget: int | None = None  # None: the role's default (step_token_budget())
    weights: str = "auto"  # auto or kvseal.model.quant.WEIGHT_MODES (kvseal.model.cpu.resolve_weights)
    threads: int = 0
    share_cores: str | None = None  # lock file shared with another engine on this host (CoreLock)
    scrub_on_free: bool = False
    prefix_cache: bool = True
    protections: Protections = field(default_factory=Protections)
    tokenizer: str | None = None  # a tokenizer other than the checkpoint's
    load_format: str = "auto"  # auto | dummy (random weights of the checkpoint's shape)
    shared_weights: str | None = None  # a file this host's workers share their packed weights through
    device: str = "cpu"  # cpu | cuda (not yet run on a GPU: docs/gpu.md)
