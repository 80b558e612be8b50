"""The 2026 incident, reproduced and prevented.

Prefill's pool (1024 tokens) is smaller than decode's (2048); tenant A fills decode's pages with prompts
carrying a random canary; tenant B sends a normal and an over-long prompt while ``legacy_placeholder`` is on
(prefill swaps the over-long prompt for 1 token and commits). Hardened: B's over-long request is a 400 and
B never sees A's canary. All protections off: the same run must show the leak — HTTP 200 for a request that
could not be served, with A's canary in B's output or B's output differing from its correct result.
"""

import secrets

import httpx
import pytest
from conftest import MODEL, Server, wait_pages_back

WORKER = ["--context", "2048", "--allow-pool-below-context"]


def start(unsafe: list[str]):
    env = {"KVSEAL_FAULTS": "legacy_placeholder", "KVSEAL_FAULT_SEED": "1", "KVSEAL_UNSAFE": "1" if unsafe else "0"}
    pre = Server(["prefill", "--kv-pool-tokens", "1024", *WORKER, *unsafe], env=env)
    dec = Server(["decode", "--kv-pool-tokens", "2048", *WORKER, *unsafe], env=env)
    router = Server(["router", "--prefill", pre.url, "--decode", dec.url,
                     "--api-key", "key-a=tenant-a", "--api-key", "key-b=tenant-b", *unsafe], env=env)
    return pre, dec, router


def complete(router, key, prompt, n=24):
    return httpx.post(router.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0})


def scenario(unsafe: list[str]) -> dict:
    pre, dec, router = start(unsafe)
    try:
        canary = "ZQX" + secrets.token_hex(3).upper()
        a_text = (f"Secret note {canary}. The password is {canary}. " * 40)[:1500]
        for _ in range(2):
            assert complete(router, "key-a", a_text + f" The password is").status_code == 200
        b_ok = complete(router, "key-b", "The capital of France is")
        b_long = complete(router, "key-b", B_LONG)  # ~1500 tokens > prefill pool
        out = {"canary": canary, "b_ok": b_ok, "b_long": b_long}
        if not unsafe:
            wait_pages_back(dec)
            wait_pages_back(pre)
        return out
    finally:
        for s in (router, dec, pre):
            s.stop()


B_LONG = "Tell me about the weather. " * 250


def correct_b_long() -> str:
    """B's over-long prompt on a server big enough to serve it: what B should have received."""
    s = Server(["serve", "--colocated", "--context", "2048", "--kv-pool-tokens", "4096"])
    try:
        return complete(s, "none", B_LONG).json()["choices"][0]["text"]
    finally:
        s.stop()


def leaked(r: dict, reference: str) -> bool:
    """A's canary in B's output, or B's output not what its own prompt gives: it read foreign pages."""
    if r["b_long"].status_code != 200:
        return False
    text = r["b_long"].json()["choices"][0]["text"]
    return r["canary"][:5] in text or text != reference


def test_hardened_rejects_over_long_and_never_leaks():
    r = scenario([])
    assert r["b_ok"].status_code == 200
    assert r["b_long"].status_code == 400 and r["b_long"].json()["error"]["code"] == "context_length_exceeded"
    assert r["canary"] not in r["b_ok"].text


def test_with_protections_off_the_incident_reproduces():
    r = scenario(["--unsafe-no-all"])
    assert r["b_long"].status_code == 200, "the unprotected path should wrongly return 200"
    ref = correct_b_long()
    assert leaked(r, ref), f"expected a leak, got {r['b_long'].json()['choices'][0]['text']!r} == {ref!r}"


def test_coverage_alone_catches_the_placeholder():
    """Admission switched off everywhere: decode's coverage check still refuses the 1-token commit."""
    r = scenario(["--unsafe-no-admission"])
    assert r["b_long"].status_code == 500
    assert r["b_long"].json()["error"]["code"] == "kv_integrity_error"


@pytest.mark.parametrize("unsafe,expect", [([], 500), (["--unsafe-no-checksum"], 200)])
def test_checksum_catches_a_corrupted_page_write(unsafe, expect):
    env = {"KVSEAL_FAULTS": "corrupt_page_write", "KVSEAL_UNSAFE": "1" if unsafe else "0"}
    pre = Server(["prefill", "--kv-pool-tokens", "8192", *unsafe], env=env)
    dec = Server(["decode", "--kv-pool-tokens", "8192", *unsafe], env=env)
    router = Server(["router", "--prefill", pre.url, "--decode", dec.url, *unsafe], env=env)
    try:
        r = httpx.post(router.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8})
        assert r.status_code == expect, r.text
        if expect == 500:
            assert r.json()["error"]["code"] == "kv_integrity_error"
            time_ok = wait_pages_back(pre)
            assert time_ok
    finally:
        for s in (router, dec, pre):
            s.stop()


@pytest.mark.parametrize("fault,status", [
    ("skip_page_write", 500),  # checksum: the bytes in decode's pool are not what prefill hashed
    ("duplicate_commit", 200),  # the second commit changes nothing
    ("drop_commit", 503),  # decode never hears: the lease is dropped, pages come back
    ("crash_after_write", 503),  # prefill dies between writes and commit: fenced, pages come back
])
def test_protocol_faults_end_cleanly(fault, status):
    env = {"KVSEAL_FAULTS": fault}
    pre = Server(["prefill", "--kv-pool-tokens", "8192"], env=env)
    dec = Server(["decode", "--kv-pool-tokens", "8192"])
    router = Server(["router", "--prefill", pre.url, "--decode", dec.url, "--timeout", "10"])
    try:
        r = httpx.post(router.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == status, r.text
        if status == 200:
            assert "Paris" in r.json()["choices"][0]["text"]
        wait_pages_back(dec, timeout=30)
        if fault != "crash_after_write":
            wait_pages_back(pre)
    finally:
        for s in (router, dec, pre):
            s.stop()
