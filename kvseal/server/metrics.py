"""Prometheus metrics, one registry per process (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MAX_TENANT_LABELS = 64  # tenants come from the key file; past this many, the rest share the label "other"


class Metrics:
    def __init__(self, pool_counts: Callable[[], dict[str, int]] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvseal_requests", "Finished requests by HTTP status and tenant", ["status", "tenant"],
                                registry=r)
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
        self.cache_queries = Counter("kvseal_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                     ["tenant"], registry=r)
        self.cache_hits = Counter("kvseal_prefix_cache_hits", "Prompt tokens read from the prefix cache instead "
                                  "of computed", ["tenant"], registry=r)
        self.cache_pages = Gauge("kvseal_prefix_cache_pages", "Pages held by the prefix cache", registry=r)
        self._tenants: set[str] = set()
        self.pool_pages = Gauge("kvseal_pool_pages", "KV pool pages by state", ["state"], registry=r)
        self._pool_counts = pool_counts

    def tenant(self, name: str) -> str:
        """A bounded label for a tenant."""
        if name in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(name)
            return name
        return "other"

    def finished(self, status: int | str, tenant: str | None) -> None:
        self.requests.labels(str(status), self.tenant(tenant) if tenant else "unknown").inc()

    def cache_lookup(self, tenant: str, prompt_tokens: int, hit_tokens: int) -> None:
        label = self.tenant(tenant)
        self.cache_queries.labels(label).inc(prompt_tokens)
        self.cache_hits.labels(label).inc(hit_tokens)

    def render(self) -> bytes:
        if self._pool_counts:
            counts = self._pool_counts()
            self.cache_pages.set(counts.pop("cached", 0))
            for state, n in counts.items():
                self.pool_pages.labels(state).set(n)
        return generate_latest(self.registry)
