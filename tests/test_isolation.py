"""The 2026 incident, reproduced and prevented.

Prefill's pool (1024 tokens) is smaller than decode's (2048); tenant A fills decode's pages with prompts
carrying a random canary; tenant B sends a normal and an over-long prompt while ``legacy_placeholder`` is on
(prefill swaps the over-long prompt for 1 token and commits). Hardened: B's over-long request is a 400 and
B never sees A's canary. All protections off: the same run must show the leak — HTTP 200 for a request that
could not be served, with A's canary in B's output or B's output differing from its correct result.
"""

import secrets

import pytest
from conftest import Server, Trio, complete, wait_pages_back

WORKER = ["--context", "2048", "--allow-pool-below-context"]
KEYS = ["--api-key", "key-a=tenant-a", "--api-key", "key-b=tenant-b"]


def scenario(unsafe: list[str]) -> dict:
    env = {"KVSEAL_FAULTS": "legacy_placeholder", "KVSEAL_FAULT_SEED": "1", "KVSEAL_UNSAFE": "1" if unsafe else "0"}
    with Trio([*WORKER, *unsafe], [*KEYS, *unsafe], env, prefill=["--kv-pool-tokens", "1024"],
              decode=["--kv-pool-tokens", "2048"]) as t:
        canary = "ZQX" + secrets.token_hex(3).upper()
        a_text = (f"Secret note {canary}. The password is {canary}. " * 40)[:1500]
        for _ in range(2):
            assert complete(t.url, a_text + " The password is", 24, key="key-a").status_code == 200
        b_ok = complete(t.url, "The capital of France is", 24, key="key-b")
        b_long = complete(t.url, B_LONG, 24, key="key-b")  # ~1500 tokens > prefill pool
        out = {"canary": canary, "b_ok": b_ok, "b_long": b_long}
        if not unsafe:
            wait_pages_back(t.dec)
            wait_pages_back(t.pre)
        return out


B_LONG = "Tell me about the weather. " * 250


@pytest.fixture(scope="module")
def b_reference() -> str:
    """B's over-long prompt on a server big enough to serve it: what B should have received."""
    s = Server(["serve", "--colocated", "--context", "2048", "--kv-pool-tokens", "4096"])
    try:
        return complete(s.url, B_LONG, 24).json()["choices"][0]["text"]
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


def test_with_protections_off_the_incident_reproduces(b_reference):
    r = scenario(["--unsafe-no-all"])
    assert r["b_long"].status_code == 200, "the unprotected path should wrongly return 200"
    assert leaked(r, b_reference), f"expected a leak, got {r['b_long'].json()['choices'][0]['text']!r}"


def test_coverage_alone_catches_the_placeholder():
    """Admission switched off everywhere: decode's coverage check still refuses the 1-token commit."""
    r = scenario(["--unsafe-no-admission"])
    assert r["b_long"].status_code == 500
    assert r["b_long"].json()["error"]["code"] == "kv_integrity_error"


def test_without_coverage_the_placeholder_is_served(b_reference):
    """Admission and coverage off, checksum and page tags on: the placeholder's one page hashes correctly
    (prefill hashed what it wrote), so only coverage stood between it and the leak."""
    r = scenario(["--unsafe-no-admission", "--unsafe-no-coverage"])
    assert r["b_long"].status_code == 200, r["b_long"].text
    assert leaked(r, b_reference), f"expected a leak, got {r['b_long'].json()['choices'][0]['text']!r}"
