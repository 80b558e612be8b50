"""Preflight: a worker whose KV pool is smaller than its served context refuses to start (the 2026 setup:
a 1,048,576-token context over a 681,280-token pool), unless the operator caps the context at the pool."""

import pytest
import torch
from conftest import Server

from kvseal.config import ModelConfig
from kvseal.kv.preflight import PreflightError, preflight

INCIDENT = ModelConfig(vocab_size=151552, hidden_size=6144, intermediate_size=12288, num_layers=92, num_heads=96,
                       num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_eps=1e-5, max_context=1_048_576)


def test_the_incident_sizing_is_refused_with_both_numbers_and_the_fix():
    with pytest.raises(PreflightError) as e:
        preflight(INCIDENT, torch.bfloat16, 681_280, None, allow_below=False)
    msg = str(e.value)
    assert "681,280" in msg and "1,048,576" in msg and "--allow-pool-below-context" in msg


def test_allowing_it_caps_the_served_context_at_the_pool():
    s = preflight(INCIDENT, torch.bfloat16, 681_280, None, allow_below=True)
    assert s.served_context == 681_280 and s.context == 1_048_576
    assert preflight(INCIDENT, torch.bfloat16, 2_097_152, None, allow_below=False).served_context == 1_048_576


def test_a_worker_below_its_context_does_not_start():
    with pytest.raises(RuntimeError, match="KV pool holds 1,024 tokens but the served context is 2,048"):
        Server(["decode", "--kv-pool-tokens", "1024", "--context", "2048"], timeout=60)
    capped = Server(["decode", "--kv-pool-tokens", "1024", "--context", "2048", "--allow-pool-below-context"])
    try:
        assert capped.health()["context_window"] == 1024
    finally:
        capped.stop()
