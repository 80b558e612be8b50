"""Weights as stored, one copy of them: a server releases each weight once its packed copy is made, and the
workers of one host map one shared file of packed weights instead of a copy each (``kvseal.model.shared``)."""

import pytest
import torch
from engine_util import generate, make_engine

from kvseal.model import shared
from kvseal.model.loader import load

PROMPT = [list(range(100, 140))]


def greedy(lm) -> list[list[int]]:
    e = make_engine(lm, dtype="bf16")
    try:
        return generate(e, PROMPT, 16)
    finally:
        e.stop()


def needs_gemm(lm) -> None:
    if not shared.shareable(lm.model):
        pytest.skip("the bf16 GEMM is not built at this kernel level: nothing is packed, nothing shared")


def test_a_released_model_holds_one_copy_and_computes_the_same(bf16_model):
    lm = load(None, torch.bfloat16, progress=False, release=True)
    needs_gemm(lm)
    m = lm.model
    assert all(getattr(x, f).is_meta for x in m.w.layers for f in ("wqkv", "wo", "w_gate_up", "w_down"))
    held = sum(lin.packed.numel() for x in m.lin for lin in (x.qkv, x.o, x.gate_up, x.down))
    params = sum(getattr(x, f).numel() for x in bf16_model.model.w.layers for f in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert held == params, "one packed copy, no more"
    with pytest.raises(RuntimeError, match="released"):
        m.use_weights("int8")
    assert greedy(lm) == greedy(bf16_model)


def test_workers_of_one_host_map_one_file_of_weights(tmp_path, bf16_model):
    f = tmp_path / "weights"
    first = load(None, torch.bfloat16, progress=False, shared=f)
    needs_gemm(first)
    size = f.stat().st_size
    second = load(None, torch.bfloat16, progress=False, shared=f)
    assert f.stat().st_size == size, "the second worker maps the file, it does not write it again"
    p = second.model.lin[3].gate_up.packed
    on_file = shared.read(f, {k: v for k, v in _key(f).items() if k != "config"})["3.gate_up.packed"]
    assert torch.equal(p, on_file)
    assert greedy(first) == greedy(second) == greedy(bf16_model)


def test_a_worker_with_other_weights_keeps_its_own_copy(tmp_path, capfd):
    f = tmp_path / "weights"
    bf16 = load(None, torch.bfloat16, progress=False, shared=f)
    needs_gemm(bf16)
    before = f.read_bytes()[:64]
    int8 = load(None, torch.bfloat16, progress=False, shared=f, weights="int8")  # another key: never mapped
    out = capfd.readouterr().out
    assert "weights not shared" in out or "keeps its own copy" in out
    assert f.read_bytes()[:64] == before
    assert int8.model.weights_mode == "int8"


def _key(f):
    import json

    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n))["key"]


def test_a_checkpoint_changed_on_disk_is_never_read_from_an_older_shared_file(tmp_path, capfd, monkeypatch):
    """The shared file names the checkpoint's files by size and time: after the checkpoint changes, a worker
    keeps its own copy instead of mapping weights packed from the old one. (A small random checkpoint: the
    key is made the same way for a GGUF file and a directory's files, and this one loads in a second.)"""
    import os

    import transformers

    from kvseal.model.loader import default_model_path, load_tokenizer

    d = tmp_path / "model"
    tok = load_tokenizer(default_model_path())
    tok.save_pretrained(str(d))
    monkeypatch.setenv("KVSEAL_CACHE", "off")  # no load-cache entry for a checkpoint that lives only this long
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(d))
    f = tmp_path / "weights"
    needs_gemm(load(d, torch.bfloat16, progress=False, shared=f))
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # new weights, same name
    load(d, torch.bfloat16, progress=False, shared=f)
    assert "holds other weights" in capfd.readouterr().out
