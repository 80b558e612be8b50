"""Admission boundaries through the router: context±1 and pool±1, prefill pool smaller than decode's and
the other way round. The limit is min(context, prefill pool, decode pool); beyond it, 400 with nothing
allocated anywhere."""

import httpx
import pytest
from conftest import MODEL, Server, wait_pages_back

CONTEXT = 1536


@pytest.fixture(scope="module", params=["prefill-smaller", "decode-smaller"])
def cluster(request):
    small, big = ["--kv-pool-tokens", "1024", "--allow-pool-below-context"], ["--kv-pool-tokens", "2048"]
    pre_pool, dec_pool = (small, big) if request.param == "prefill-smaller" else (big, small)
    ctx = ["--context", str(CONTEXT)]
    pre, dec = Server(["prefill", *ctx, *pre_pool]), Server(["decode", *ctx, *dec_pool])
    router = Server(["router", "--prefill", pre.url, "--decode", dec.url])
    yield router, pre, dec
    for s in (router, pre, dec):
        s.stop()


def needs(router, n: int) -> httpx.Response:
    """A request needing exactly n tokens: n-1 prompt tokens + 1 max_tokens."""
    return httpx.post(router.url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": [5] * (n - 1), "max_tokens": 1, "temperature": 0})


@pytest.mark.parametrize("n", [1023, 1024, 1025, CONTEXT - 1, CONTEXT, CONTEXT + 1])
def test_pool_and_context_boundaries(cluster, n):
    router, pre, dec = cluster
    r = needs(router, n)
    if n <= 1024:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "1024" in r.json()["error"]["message"]
    wait_pages_back(pre)
    wait_pages_back(dec)


def test_context_boundary_when_pools_are_larger():
    s = Server(["serve", "--colocated", "--context", "1024", "--kv-pool-tokens", "2048"])
    try:
        assert [needs(s, n).status_code for n in (1023, 1024, 1025)] == [200, 200, 400]
        wait_pages_back(s)
    finally:
        s.stop()
