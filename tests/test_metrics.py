"""Metrics from every process (router, prefill, decode, colocated) in Prometheus' text format, the three gauges
the Gateway API Inference Extension schedules on among them, and the refusals an operator looks for in the
2026 failure counted where they happen."""

import re

import httpx
from conftest import Trio, complete

POOL_ARGS = ["--kv-pool-tokens", "8192"]

GAIE = ("kvseal:num_requests_waiting", "kvseal:num_requests_running", "kvseal:kv_cache_usage_perc")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value, unsigned, as Prometheus scrapes."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-zA-Z_:][^ ]*) ([0-9.e+-]+|NaN)$", r.text, re.MULTILINE)}


def test_every_process_exports_metrics_and_the_gateway_gauges(disagg):
    assert complete(disagg.url, "The capital of France is", 4).status_code == 200
    port = int(disagg.url.rsplit(":", 1)[1])
    router, prefill, decode = (scrape(f"http://127.0.0.1:{port + i}") for i in range(3))
    for name, m in (("router", router), ("prefill", prefill), ("decode", decode)):
        assert all(g in m for g in GAIE), f"{name} lacks a gateway gauge"
        assert 0.0 <= m["kvseal:kv_cache_usage_perc"] <= 1.0
    for m in (prefill, decode):
        assert m['kvseal_pool_pages{state="free"}'] > 0 and "kvseal_engine_steps_total" in m
    assert prefill['kvseal_transfers_total{outcome="ok"}'] >= 1 and prefill["kvseal_transfer_bytes_total"] > 0
    assert prefill["kvseal_transfer_commit_seconds_count"] >= 1
    assert all(f'kvseal_leases{{state="{s}"}}' in decode for s in ("reserved", "verifying", "running", "quarantined"))
    assert decode['kvseal_transfer_refusals_total{reason="checksum"}'] == 0
    assert router["kvseal_generation_tokens_total"] >= 4
    assert sum(v for k, v in router.items() if k.startswith("kvseal_worker_healthy")) == 2


def test_colocated_exports_the_gateway_gauges(colocated):
    assert complete(colocated.url, "The capital of France is", 4).status_code == 200
    m = scrape(colocated.url)
    assert all(g in m for g in GAIE) and m['kvseal_pool_pages{state="free"}'] > 0


def test_a_corrupted_transfer_is_counted_by_its_reason():
    with Trio(POOL_ARGS, env={"KVSEAL_FAULTS": "corrupt_page_write"}) as t:
        assert complete(t.url, "The capital of France is", 4).status_code == 500
        decode, prefill = scrape(t.dec.url), scrape(t.pre.url)
    assert decode['kvseal_transfer_refusals_total{reason="checksum"}'] == 1
    assert prefill['kvseal_transfers_total{outcome="kv_integrity_error"}'] == 1
