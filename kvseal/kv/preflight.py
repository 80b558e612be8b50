"""Pool sizing against the served context, checked before a worker starts.

The 2026 incident ran a 1,048,576-token context over a 681,280-token prefill pool. A worker whose pool is
smaller than its context refuses to start, naming both numbers and the fix, unless the operator allows it,
in which case the served context is capped at the pool (and /v1/models says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.config import ModelConfig


class PreflightError(SystemExit):
    pass


@dataclass(frozen=True)
class Sizing:
    kv_bytes_per_token: int
    pool_tokens: int
    pool_bytes: int
    context: int
    served_context: int

    def table(self) -> str:
        rows = [("KV bytes per token", f"{self.kv_bytes_per_token:,}"),
                ("pool capacity (tokens)", f"{self.pool_tokens:,}"),
                ("pool memory", f"{self.pool_bytes / 2**30:.2f} GiB"),
                ("requested context", f"{self.context:,}"),
                ("served context", f"{self.served_context:,}"),
                ("pool / context", f"{self.pool_tokens / self.context:.2f}×")]
        return "\n".join(f"{k:<24}{v:>16}" for k, v in rows)


def pool_tokens_for(model: ModelConfig, dtype: torch.dtype, memory_bytes: int, page_size: int) -> int:
    per_page = model.kv_bytes_per_token(dtype) * page_size
    return (memory_bytes // per_page) * page_size


def preflight(model: ModelConfig, dtype: torch.dtype, pool_tokens: int, context: int | None,
              allow_below: bool) -> Sizing:
    ctx = context or model.max_context
    if ctx > model.max_context:
        raise PreflightError(f"--context {ctx} exceeds the model's trained context {model.max_context}")
    per_tok = model.kv_bytes_per_token(dtype)
    served = ctx
    if pool_tokens < ctx:
        if not allow_below:
            raise PreflightError(
                f"KV pool holds {pool_tokens:,} tokens but the served context is {ctx:,}: a request near the "
                f"context could never fit. Give the pool at least {ctx * per_tok / 2**30:.2f} GiB "
                f"(--kv-pool-tokens {ctx}), lower --context to {pool_tokens}, or pass "
                f"--allow-pool-below-context to cap the served context at the pool.")
        served = pool_tokens
    return Sizing(per_tok, pool_tokens, pool_tokens * per_tok, ctx, served)
