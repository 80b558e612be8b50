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


def test_the_grafana_dashboard_reads_only_metrics_a_cluster_exports(disagg):
    """Every series deploy/grafana/kvseal.json queries is exported by the router, prefill or decode of a live
    cluster (a renamed metric would leave an empty panel)."""
    import json
    from pathlib import Path

    assert complete(disagg.url, "The capital of France is", 4).status_code == 200
    dash = json.loads((Path(__file__).resolve().parent.parent / "deploy/grafana/kvseal.json").read_text())
    wanted = {m for p in dash["panels"] for t in p["targets"]
              for m in re.findall(r"kvseal[_:][a-zA-Z0-9_:]+", t["expr"])}  # digits too: kvseal_e2e_…
    port = int(disagg.url.rsplit(":", 1)[1])
    exported = set()
    for i in range(3):
        exported |= {k.split("{")[0] for k in scrape(f"http://127.0.0.1:{port + i}")}
    assert wanted and not wanted - exported, f"the dashboard asks for {sorted(wanted - exported)}"


def test_a_real_prometheus_scrapes_every_process(disagg, tmp_path):
    """Prometheus (Debian's ``prometheus``) with deploy/prometheus.yml's jobs pointed at a live cluster: one
    gateway gauge comes back from each of the three processes."""
    import shutil
    import subprocess

    import pytest
    import yaml
    from conftest import free_port, prometheus_jobs

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (make setup installs Debian's)")
    port = int(disagg.url.rsplit(":", 1)[1])
    from pathlib import Path

    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "deploy/prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    for i, job in enumerate(cfg["scrape_configs"]):
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{port + i}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    web = free_port()
    p = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path}/db",
                          f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        jobs = prometheus_jobs(web, "kvseal:kv_cache_usage_perc")
        assert jobs == {"kvseal-router", "kvseal-prefill", "kvseal-decode"}, jobs
    finally:
        p.terminate()
        p.wait(10)


def test_a_scrape_storm_renders_at_most_ten_pages_a_second_and_a_scrape_is_fresh_otherwise():
    import asyncio
    import time

    from kvseal.server.metrics import RENDERS_PER_S, Metrics, ScrapeDoor

    m, renders = Metrics(), []
    m.add_source(lambda: renders.append(1) or [("kvseal_probe", "gauge", "renders", None, len(renders))])

    async def app(scope, receive, send):  # everything but a scrape reaches the app
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=ScrapeDoor(app, m))
        async with httpx.AsyncClient(transport=transport, base_url="http://m") as c:
            return await c.get(path)

    m.generation_tokens.inc(3)
    assert "kvseal_generation_tokens_total 3.0" in asyncio.run(get("/metrics")).text  # rendered for this scrape
    m.generation_tokens.inc(1)
    assert "kvseal_generation_tokens_total 4.0" in asyncio.run(get("/metrics")).text  # and again: never stale
    assert asyncio.run(get("/v1/models")).status_code == 204
    t0 = time.monotonic()
    pages = [asyncio.run(get("/metrics")) for _ in range(100)]
    took = time.monotonic() - t0
    assert all(p.status_code == 200 and p.headers["content-type"].startswith("text/plain") for p in pages)
    assert len(renders) <= RENDERS_PER_S * (2 + int(took)), f"{len(renders)} renders for 102 scrapes in {took:.2f} s"
