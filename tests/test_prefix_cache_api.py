"""The prefix cache through the API, colocated and disaggregated (where prefill caches and the cached prefix is
still transferred whole, under the checksum): a tenant's repeat hits and answers the same as its cold run;
another tenant with the same prompt misses; usage and /metrics say so."""

import re

import httpx
import pytest
from conftest import MODEL, Server, wait_pages_back

KEYS = ["--api-key", "key-a=tenant-a", "--api-key", "key-b=tenant-b"]
SYSTEM = ("You answer questions about a lighthouse museum in one sentence. Exhibits: lenses (hall 1), keepers' "
          "logs (hall 2), shipwrecks (hall 3), foghorns (hall 4), lamp oils (hall 5). ") * 4


def chat(url: str, key: str, question: str, **kw) -> dict:
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": MODEL, "max_tokens": 16, "temperature": 0,
                         "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
                   | kw)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str, tenant: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer adm"}, timeout=10).text
    m = re.search(rf'^{name}_total{{tenant="{tenant}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_tenant_hits_its_own_prefix_and_never_anothers(mode):
    args = ["serve", "--dtype", "fp32", "--kv-pool-tokens", "8192", *KEYS]
    per_tenant = mode == "colocated"  # per-tenant series only where asked for; the other mode checks they are not
    s = Server(args + (["--colocated", "--per-tenant-metrics", "--admin-key", "adm"] if per_tenant else []))
    try:
        cold = chat(s.url, "key-a", "Where are the foghorns?")
        warm = chat(s.url, "key-a", "Where are the foghorns?")
        other = chat(s.url, "key-b", "Where are the foghorns?")
        n_prompt = cold["usage"]["prompt_tokens"]
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 16 * 16
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        texts = [r["choices"][0]["message"]["content"] for r in (cold, warm, other)]
        assert texts[0] == texts[1] == texts[2], texts  # fp32: the cache changes no output
        if per_tenant:  # tenant-named series answer the admin key only
            assert httpx.get(s.url + "/metrics", timeout=10).status_code == 401
            assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer key-a"}, timeout=10).status_code == 403
            assert metric(s.url, "kvseal_prefix_cache_hits", "tenant-a") == (n_prompt - 1) // 16 * 16
            assert metric(s.url, "kvseal_prefix_cache_hits", "tenant-b") == 0
            assert metric(s.url, "kvseal_prefix_cache_queries", "tenant-b") == n_prompt
        else:  # whoever scrapes sees neither tenants' names nor whose prompts hit
            assert "tenant-" not in httpx.get(s.url + "/metrics", timeout=10).text
            assert metric(s.url, "kvseal_prefix_cache_hits", "all") == (n_prompt - 1) // 16 * 16
        # the Responses API is the same path: a tenant's key, the tenant's own cache, the same answer
        resp = httpx.post(s.url + "/v1/responses", headers={"Authorization": "Bearer key-b"}, timeout=120, json={
            "model": MODEL, "max_output_tokens": 16, "temperature": 0, "instructions": SYSTEM,
            "input": "Where are the foghorns?"}).json()
        assert resp["usage"]["input_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 16 * 16, resp
        assert resp["output"][0]["content"][0]["text"] == texts[0]
        assert httpx.post(s.url + "/v1/responses", json={"model": MODEL, "input": "x"}, timeout=30).status_code == 401
        # vLLM's cache_salt reaches the cache (on prefill: in the Prefill message): a salted request of tenant-a
        # misses the prefix tenant-a cached without it, and the same salt then hits
        salted = [chat(s.url, "key-a", "Where are the foghorns?", cache_salt="user-1") for _ in range(2)]
        assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in salted] == \
            [0, (n_prompt - 1) // 16 * 16]
        assert [r["choices"][0]["message"]["content"] for r in salted] == texts[:2]
        wait_pages_back(s)
    finally:
        s.stop()
