"""Prometheus metrics, one registry per process (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, pool_counts: Callable[[], dict[str, int]] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvseal_requests", "Finished requests by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("kvseal_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("kvseal_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kvseal_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvseal_inter_token_latency_seconds", "Inter-token latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.integrity_failures = Counter("kvseal_kv_integrity_failures", "Page-tag or commit check failures",
                                          registry=r)
        self.preemptions = Counter("kvseal_preemptions", "Requests preempted (pages freed, recomputed later)",
                                   registry=r)
        self.shared_tokens = Counter("kvseal_shared_prompt_tokens", "Prompt tokens a choice (n > 1) read from "
                                     "its request's shared pages instead of computing them", registry=r)
        self.engine_seconds = Counter("kvseal_engine_seconds", "Engine step time by phase", ["phase"], registry=r)
        self.engine_steps = Counter("kvseal_engine_steps", "Engine steps that ran a forward pass", registry=r)
        self.pool_pages = Gauge("kvseal_pool_pages", "KV pool pages by state", ["state"], registry=r)
        self._pool_counts = pool_counts

    def render(self) -> bytes:
        if self._pool_counts:
            for state, n in self._pool_counts().items():
                self.pool_pages.labels(state).set(n)
        return generate_latest(self.registry)
