"""Pages on demand through real servers: a burst bigger than the pool is served whole in both modes, and
requests without ``max_tokens`` (as the openai client sends them) run side by side instead of one by one."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import MODEL, Server, Trio, wait_pages_back

TOPICS = ["the sea", "a mountain", "the moon", "a forest", "the desert", "a river", "the wind", "a city",
          "the snow", "a garden", "the stars", "an island"]


def burst(url: str, n: int, max_tokens: int | None) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        body = {"model": MODEL, "temperature": 0, "ignore_eos": max_tokens is not None,
                "messages": [{"role": "user", "content": f"Write a long poem about {TOPICS[i % len(TOPICS)]}."}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=180)

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_burst_larger_than_the_pool_is_served_whole(mode):
    """12 requests × (~40 prompt + 120 output) tokens ≈ 1,900 tokens of KV against a 1,024-token pool: they
    grow, preempt and recompute, and every one ends 200 with all its tokens; every page comes back."""
    args = ["serve", "--kv-pool-tokens", "1024", "--context", "1024"] + (["--colocated"] if mode == "colocated" else [])
    s = Server(args)
    try:
        rs = burst(s.url, 12, 120)
        assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
        assert all(r.json()["usage"]["completion_tokens"] == 120 for r in rs)
        wait_pages_back(s)
        if mode == "colocated":
            lines = httpx.get(s.url + "/metrics").text.splitlines()
            assert float(next(x for x in lines if x.startswith("kvseal_preemptions_total ")).split()[1]) > 0
    finally:
        s.stop()


def test_the_choices_of_one_request_take_turns_in_a_decode_pool_that_holds_two_of_them():
    """n=3 choices (or 3 prompts) of 240 prompt + 60 new tokens (19 pages each at the end) on a 40-page decode
    pool: two run, the third waits for pages only its own siblings hold. It once waited out decode's reservation
    wait and the request got 503 on an idle server, every time it was sent (colocated served it). The router now
    asks decode again while a sibling still holds pages there; all three come back whole, every page returns."""
    prompt = list(range(1000, 1240))
    with Trio(["--context", "512", "--kv-pool-tokens", "640"], decode=["--reserve-wait", "0.2"]) as t:
        for many in ({"prompt": prompt, "n": 3}, {"prompt": [prompt, prompt[1:], prompt[2:]]}):
            body = {"model": MODEL, "max_tokens": 60, "ignore_eos": True, "temperature": 0, **many}
            r = httpx.post(t.url + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
            assert r.json()["usage"]["completion_tokens"] == 180
            wait_pages_back(t.router)


def test_requests_without_max_tokens_run_side_by_side(colocated):
    """32 chat requests without max_tokens (each may grow to the whole 8,192-token context, which a
    reserve-it-all scheduler could start only two of on this 16,384-token pool) run at least 24 wide."""
    seen = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            h = httpx.get(colocated.url + "/health", timeout=10).json()
            seen[0] = max(seen[0], sum(p["running"] for p in h["pools"]))
            time.sleep(0.05)

    client = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0)
    w = threading.Thread(target=watch)
    w.start()
    try:
        with ThreadPoolExecutor(32) as ex:
            outs = list(ex.map(lambda i: client.chat.completions.create(
                model=MODEL, temperature=0,
                messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} in two sentences."}]),
                range(32)))
    finally:
        stop.set()
        w.join()
    assert all(o.choices[0].finish_reason == "stop" and o.choices[0].message.content for o in outs)
    assert seen[0] >= 24, f"at most {seen[0]} ran at once"
    wait_pages_back(colocated)
