"""Pages staged through host memory: the transfer path of a pool the transport cannot reach (a GPU's), run here
on the CPU with ``KVSEAL_KV_STAGING=1`` (kvseal.transfer.staging).

Prefill sends a host copy of the pages; decode's transport writes a landing area, and decode copies a lease's
pages, and no other, into its pool before it hashes them. These tests hold the staged path to the same answers
and the same integrity checks as the pool written in place.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import Trio, complete, signed, wait_pages_back

from kvseal.config import PoolConfig
from kvseal.kv.pool import PagePool
from kvseal.transfer import messages as P
from kvseal.transfer import staging

SHAPE = (8, 2, 2, 1, 4, 8)  # pages, layers, k|v, kv heads, slots, head dim
PROMPTS = ["The capital of France is", "List three colors:", "Write a haiku about the sea."]


def pool(landing: bool = True, scrub: bool = False) -> PagePool:
    return PagePool(PoolConfig(num_pages=8, page_size=4, scrub_on_free=scrub), 2, 1, 8, torch.float32,
                    landing=torch.randn(SHAPE) if landing else None)


def test_take_in_copies_the_lease_pages_and_no_other():
    p = pool()
    p.kv.copy_(torch.randn(SHAPE))  # other requests' pages, which a landing copy must leave alone
    before = p.kv.clone()
    p.take_in((2, 5, 6))
    for page in range(8):
        want = p.landing[page] if page in (2, 5, 6) else before[page]
        assert torch.equal(p.kv[page], want), page


def test_a_pool_written_in_place_takes_nothing_in():
    p = pool(landing=False)
    p.take_in((1, 2))
    assert not p.kv.any()


def test_scrub_on_free_zeroes_the_landing_area_too():
    p = pool(scrub=True)
    run = p.allocate(owner=1, n_pages=2)
    p.free(run)
    for page in range(8):
        assert (not p.landing[page].any()) == (page in run.pages), page


def test_stage_out_sends_a_copy_of_just_the_pages(monkeypatch):
    kv = torch.randn(SHAPE)
    monkeypatch.delenv(staging.ENV, raising=False)
    data, at = staging.stage_out(kv, [3, 1])
    assert data is kv and at == [3, 1]  # a host pool is sent as it is
    monkeypatch.setenv(staging.ENV, "1")
    data, at = staging.stage_out(kv, [3, 1])
    assert at == [0, 1] and torch.equal(data, kv[[3, 1]]) and data.data_ptr() != kv.data_ptr()
    # the checksum prefill takes over the copy is the one decode recomputes over the same bytes in its pool
    assert P.checksum(data, at, 7, 1, 2, [5, 6], [0, 0], 9) == P.checksum(kv, [3, 1], 7, 1, 2, [5, 6], [0, 0], 9)


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def staged(request):
    """Both transports: Mooncake registers each staged copy for its write only (loopback TCP here)."""
    with Trio(["--kv-pool-tokens", "8192", "--transport", request.param],
              env={staging.ENV: "1", "KVSEAL_FAULTS": "armable"}) as t:
        yield t


def test_both_workers_say_their_pages_are_staged(staged):
    for s in (staged.pre, staged.dec):
        assert signed("GET", s.url + "/health").json()["machine"]["kv_staged"] is True


def test_a_prefill_worker_runs_longer_steps_than_a_decode_worker_unless_told(staged):
    """A prefill worker streams nothing itself: its default chunks are twice decode's (kvseal.config.STEP_TOKENS).
    Each worker says its budget (start line, /health); ``--step-token-budget`` sets both."""
    from kvseal.cli import parser
    from kvseal.config import step_token_budget
    from kvseal.server.launch import _worker_argv

    steps = [signed("GET", s.url + "/health").json()["machine"]["step_tokens"] for s in (staged.pre, staged.dec)]
    assert steps == [1024, 512]
    assert step_token_budget(None, "colocated") == 512 and step_token_budget(300, "prefill") == 300
    argv = _worker_argv(parser().parse_args(["serve", "--step-token-budget", "300"]))
    assert argv[argv.index("--step-token-budget") + 1] == "300"
    assert "--step-token-budget" not in _worker_argv(parser().parse_args(["serve"]))  # each worker picks its own


def text(url: str, prompt: str, n: int = 16) -> str:
    r = complete(url, prompt, n)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_staged_answers_equal_colocated_ones_side_by_side(staged, colocated):
    """A long answer decodes while the others' pages come in: a landing copy that touched any page but its own
    lease's would overwrite the keys and values the long one has written since."""
    long, *short = PROMPTS
    want = {p: text(colocated.url, p, 64 if p == long else 16) for p in PROMPTS}
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(text, staged.url, long, 64)
        time.sleep(0.3)
        got = {p: text(staged.url, p) for p in short}
        got[long] = first.result()
    assert got == want
    wait_pages_back(staged.pre)
    wait_pages_back(staged.dec)


@pytest.mark.parametrize("fault", ["skip_page_write", "corrupt_page_write"])
def test_bad_bytes_in_the_landing_area_fail_the_checksum_over_the_pool(staged, fault):
    wait_pages_back(staged.dec)
    staged.arm(fault)
    try:
        r = complete(staged.url, PROMPTS[0], 16)
        assert r.status_code == 500 and r.json()["error"]["code"] == "kv_integrity_error", r.text
    finally:
        staged.arm("")
    wait_pages_back(staged.pre)
    wait_pages_back(staged.dec)
