"""Prometheus metrics, one registry per process (no module-level state), served at ``/metrics`` by every
process: the colocated server, the router, prefill and decode workers.

Every process exports the three gauges the Gateway API Inference Extension schedules on, under kvseal's
prefix with vLLM's meaning: ``kvseal:num_requests_waiting``, ``kvseal:num_requests_running`` and
``kvseal:kv_cache_usage_perc`` (the used fraction of the KV pool, 0..1; pages the prefix cache alone holds
count as free, since allocation evicts them). An engine process reads them from its engine; the router
counts requests in its hands and reports the fullest decode pool it last probed. Sources (``add_source``) are
read at scrape time; nothing runs between scrapes.

A scrape is answered before the app (``ScrapeDoor``: no routing, no middleware). Each scrape gets a page
rendered for it, up to ``RENDERS_PER_S`` in any second; past that (a scrape storm) the last page is served
again, so a storm costs an HTTP exchange per scrape, not a render (bench/scrape.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)  # a whole request, seconds
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RENDERS_PER_S = 10  # fresh pages a second; Prometheus scrapes each target every few seconds
MAX_TENANT_LABELS = 64  # tenants come from the key file; past this many, the rest share the label "other"


class Metrics:
    def __init__(self, pool_counts: Callable[[], dict[str, int]] | None = None, per_tenant: bool = False) -> None:
        """``per_tenant``: label requests and prefix-cache hits with the tenant's name (``--per-tenant-metrics``).
        Off by default: whoever can scrape would see every tenant's name and cache hits, a side channel (vLLM
        treats per-request cache timing as one since CVE-2025-46570); off, they are all labelled ``all``."""
        self.per_tenant = per_tenant
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvseal_requests", "Finished requests by HTTP status and tenant", ["status", "tenant"],
                                registry=r)
        self.prompt_tokens = Counter("kvseal_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("kvseal_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kvseal_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvseal_inter_token_latency_seconds", "Inter-token latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvseal_e2e_request_latency_seconds", "A served request's arrival to its last token",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.request_tokens = Histogram("kvseal_request_generation_tokens", "Tokens a served request generated "
                                        "(all its choices)", buckets=TOKEN_BUCKETS, registry=r)
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
        # prefill: each transfer from its commit to decode's answer, by outcome (ok, or the refusal's code)
        self.transfers = Counter("kvseal_transfers", "KV transfers by decode's answer", ["outcome"], registry=r)
        self.transfer_bytes = Counter("kvseal_transfer_bytes", "KV page bytes written to decode pools", registry=r)
        self.transfer_seconds = Histogram("kvseal_transfer_commit_seconds", "Commit sent to decode's answer "
                                          "(checksum and tag verification included)", buckets=LATENCY_BUCKETS,
                                          registry=r)
        self._pool_counts = pool_counts
        self._page = b""
        self._renders: deque[float] = deque(maxlen=RENDERS_PER_S)
        self._sources: list[Callable[[], list[tuple]]] = []
        r.register(_Sources(self._sources))

    def add_source(self, fn: Callable[[], list[tuple]]) -> None:
        """``fn()`` → ``[(name, "gauge" | "counter", help, {label: value} | None, value), …]``, read per scrape."""
        self._sources.append(fn)

    def tenant(self, name: str) -> str:
        """A bounded label for a tenant."""
        if not self.per_tenant:
            return "all"
        if name in self._tenants or len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(name)
            return name
        return "other"

    def finished(self, status: int | str, tenant: str | None) -> None:
        self.requests.labels(str(status), self.tenant(tenant) if tenant else "unknown").inc()

    def served(self, tenant: str | None, seconds: float, tokens: int) -> None:
        """A request answered whole (200, its last token sent): as vLLM's e2e latency and generation length."""
        self.finished(200, tenant)
        self.e2e.observe(seconds)
        self.request_tokens.observe(tokens)

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

    def page(self) -> bytes:
        """A page rendered now; past ``RENDERS_PER_S`` renders in the last second, the last one."""
        now = time.monotonic()
        r = self._renders
        if len(r) < r.maxlen or now - r[0] >= 1.0 or not self._page:
            self._page = self.render()
            r.append(now)
        return self._page


class ScrapeDoor:
    """``GET /metrics`` answered in front of ``app`` from ``Metrics.page``. With per-tenant series on, the
    scrape goes through the app, which asks for the admin key first."""

    CONTENT_TYPE = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")

    def __init__(self, app: Callable, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if (scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] != "GET"
                or self.metrics.per_tenant):
            return await self.app(scope, receive, send)
        body = self.metrics.page()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [self.CONTENT_TYPE, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return None


class _Sources:
    """A collector over ``Metrics.add_source`` callbacks: one metric family per name."""

    def __init__(self, sources: list[Callable[[], list[tuple]]]) -> None:
        self.sources = sources

    def describe(self) -> list:
        return []  # families vary with the sources: collected per scrape

    def collect(self) -> Iterator:
        families: dict[str, object] = {}
        for fn in self.sources:
            for name, kind, doc, labels, value in fn():
                fam = families.get(name)
                if fam is None:
                    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                    fam = families[name] = cls(name, doc, labels=sorted(labels) if labels else None)
                fam.add_metric([labels[k] for k in sorted(labels)] if labels else [], value)
        yield from families.values()


def engine_source(engine: object) -> Callable[[], list[tuple]]:
    """The GAIE gauges of a process that runs an engine (read on any thread: lengths and a pool count)."""
    def read() -> list[tuple]:
        pool = engine.pool
        used = 1.0 - pool.num_available / pool.cfg.num_pages
        return [("kvseal:num_requests_waiting", "gauge", "Requests waiting to be scheduled", None, len(engine.waiting)),
                ("kvseal:num_requests_running", "gauge", "Requests in the running batch", None, len(engine.running)),
                ("kvseal:kv_cache_usage_perc", "gauge", "Used fraction of the KV pool (0..1)", None, used)]
    return read
