"""Models users bring, held to transformers: for each family kvseal serves (Llama with every RoPE scaling,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3), a tiny random checkpoint that transformers itself writes
(wide init, so greedy margins are clear), in both config styles (4.x: ``rope_theta``/``rope_scaling`` at the
top level; 5.x: ``rope_parameters``), with sliding windows of 8 tokens so every prompt crosses them.

Held equal, in fp32:
- teacher-forced logits over a 40-token sequence fed as two prefill chunks (the second reads the pool) and
  then one decode row per token, against transformers' logits of the whole sequence: max |gap| < 2e-3;
- greedy tokens through the engine (two prompts batched: decode rows and prefill chunks in one step) against
  ``generate``.
And refused at start, one line naming the problem: unknown architectures and keys, unsupported RoPE types,
missing, left-over and mis-shaped tensors, a tokenizer larger than the vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_util import generate, make_engine

from kvseal.config import PoolConfig
from kvseal.kv.pool import PagePool
from kvseal.model.arch import ConfigError
from kvseal.model.attention import DecodeRows, Span
from kvseal.model.llama import ForwardBatch
from kvseal.model.loader import default_model_path, load, load_tokenizer

VOCAB = 49152  # SmolLM2's tokenizer, saved into every checkpoint
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}

# name: (config class, its arguments, 4.x style: move RoPE to rope_theta / rope_scaling at the top level)
CASES = {
    "llama": ("LlamaConfig", {}, True),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}, True),
    "llama3": ("LlamaConfig", {"rope_parameters": LLAMA3}, False),
    "llama3-4x": ("LlamaConfig", {"rope_parameters": LLAMA3}, True),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": YARN}, False),
    "llama-dynamic": ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, False),
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}, False),
    "mistral": ("MistralConfig", {"sliding_window": 8}, False),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, True),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, False),
    "qwen3": ("Qwen3Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, False),
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 3.0, "tie_word_embeddings": True}, False),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
                                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                                    "tie_word_embeddings": True}, False),
    "phi3": ("Phi3Config", {"sliding_window": 8, "original_max_position_embeddings": 256}, False),
}
TEXT = ("The lighthouse keeper counted ships at dawn, and the harbor bell rang twice for every fishing boat that "
        "came home before the storm; the children ran along the pier to watch the boats sail past the rocks, "
        "and the keeper wrote every name in his book.")


def to_4x(d: Path) -> None:
    """Rewrite a saved config as transformers 4 wrote it: RoPE at the top level."""
    c = json.loads((d / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    rope.pop("partial_rotary_factor", None)
    if rope.get("rope_type", "default") != "default":
        c["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (d / "config.json").write_text(json.dumps(c))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(str(d))
    return d


def checkpoint(root: Path, tokenizer_dir: Path, name: str) -> Path:
    import transformers

    cls, kw, old = CASES[name]
    d = root / name
    if (d / "config.json").exists():
        return d
    torch.manual_seed(sum(map(ord, name)))
    cfg = getattr(transformers, cls)(**{**SMALL, **kw})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms away from 1 (Gemma's are 1 + w): each family's norm arithmetic matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(torch.rand_like(p) * 0.5 + (0.0 if cfg.model_type.startswith("gemma") else 0.75))
            elif n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(d))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    if old:
        to_4x(d)
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


def hf_model(d: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()


def paged_logits(model, ids: list[int], chunks: tuple[int, int]) -> torch.Tensor:
    """Logits for every position: two prefill chunks (the second reads the first's keys from the pool), then one
    decode row per token."""
    cfg = model.cfg
    pool = PagePool(PoolConfig(num_pages=16), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    ps = pool.cfg.page_size
    pages = torch.arange(10, dtype=torch.int64).flip(0)  # not in order: page tables are read, not assumed
    out = []

    def run(a: int, b: int) -> torch.Tensor:
        pos = torch.arange(a, b)
        slots = pages[pos // ps] * ps + pos % ps
        used = pages[: -(-b // ps)]
        if b - a == 1 and a > 0:
            fb = ForwardBatch(torch.tensor(ids[a:b]), pos, slots, torch.tensor([0]),
                              DecodeRows(used[None], torch.tensor([b])), [])
        else:
            fb = ForwardBatch(torch.tensor(ids[a:b]), pos, slots, torch.arange(b - a), None, [Span(0, b - a, a, used)])
        return model.forward(pool.kv, fb)

    out.append(run(0, chunks[0]))
    out.append(run(chunks[0], chunks[1]))
    for p in range(chunks[1], len(ids)):
        out.append(run(p, p + 1))
    return torch.cat(out)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(name, root, tokenizer_dir):
    d = checkpoint(root, tokenizer_dir, name)
    lm = load(d, torch.float32, progress=False)
    hf = hf_model(d)
    ids = lm.tokenizer.encode(TEXT, add_special_tokens=False)[:40]
    assert len(ids) == 40
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    got = paged_logits(lm.model, ids, (13, 24))
    gap = (got - want).abs().max().item()
    print(f"{name}: max |logit gap| {gap:.2e} (logits span {want.abs().max().item():.1f})")
    assert gap < 2e-3, f"{name}: teacher-forced logits differ from transformers by {gap}"

    prompts = [ids[:11], ids[:23]]
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                           max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
               for p in prompts]
    engine = make_engine(lm, pages=64, step_token_budget=16)  # prompts fed in chunks, beside decode rows
    try:
        ours = generate(engine, prompts, 16)
    finally:
        engine.stop()
    assert ours == ref, f"{name}: greedy tokens differ from transformers"


def test_configs_are_read_as_transformers_reads_them(root, tokenizer_dir):
    cfg = load(checkpoint(root, tokenizer_dir, "qwen2"), torch.float32, progress=False).model.cfg
    assert cfg.rope_theta == 1e6, "4.x style rope_theta at the top level"
    g = load(checkpoint(root, tokenizer_dir, "gemma3"), torch.float32, progress=False).model.cfg
    assert g.layer_windows == (8, 0, 8) and g.rope_local == {"rope_type": "default", "rope_theta": 1e4}
    assert g.rope["rope_type"] == "linear" and not g.plain
    dyn = load(checkpoint(root, tokenizer_dir, "llama-dynamic"), torch.float32, progress=False).model.cfg
    assert dyn.max_context == 256  # dynamic NTK is plain RoPE up to the original context: served that far
    q = load(checkpoint(root, tokenizer_dir, "qwen2-window"), torch.float32, progress=False).model.cfg
    assert q.layer_windows == (0, 8, 8)


def broken(root: Path, tokenizer_dir: Path, name: str, edit) -> Path:
    src = checkpoint(root, tokenizer_dir, "llama")
    d = root / f"broken-{name}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    c = json.loads((d / "config.json").read_text())
    edit(c, d)
    (d / "config.json").write_text(json.dumps(c))
    return d


def _drop_tensor(d: Path, name: str, add: dict | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    t = load_file(str(f))
    t.pop(name, None)
    if reshape:
        t[reshape] = t[reshape][:, :-1].contiguous()
    t.update(add or {})
    save_file(t, str(f))


REFUSALS = {
    "model_type": (lambda c, d: c.update(model_type="falcon"), "model_type 'falcon' is not supported"),
    "rope_type": (lambda c, d: c.update(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
                  "not supported"),
    "unknown_key": (lambda c, d: c.update(model_type="mistral", sliding_window=None, attention_bias=True),
                    "config key 'attention_bias' of model_type 'mistral'"),
    "activation": (lambda c, d: c.update(hidden_act="relu"), "activation 'relu'"),
    "quantized": (lambda c, d: c.update(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    "partial_rotary": (lambda c, d: c.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "missing_tensor": (lambda c, d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"),
                       "no tensor model.layers.1.mlp.up_proj.weight"),
    "extra_tensor": (lambda c, d: _drop_tensor(d, "", add={"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
                     "does not describe, e.g. model.layers.0.self_attn.q_norm.weight"),
    "shape": (lambda c, d: _drop_tensor(d, "", reshape="model.layers.0.mlp.down_proj.weight"),
              "tensor model.layers.0.mlp.down_proj.weight has shape [64, 127]"),
    "vocab": (lambda c, d: c.update(vocab_size=1000), "tokenizer"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_checkpoint_kvseal_cannot_serve_exactly_is_refused_by_name(case, root, tokenizer_dir):
    edit, says = REFUSALS[case]
    d = broken(root, tokenizer_dir, case, edit)
    with pytest.raises(ConfigError) as e:
        load(d, torch.float32, progress=False)
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["activation", "missing_tensor", "shape"])
def test_serve_refuses_such_a_checkpoint_in_one_line_before_starting(case, root, tokenizer_dir):
    """Found from the config and the safetensors headers alone, before any worker process starts."""
    import subprocess
    import sys

    d = broken(root, tokenizer_dir, case, REFUSALS[case][0])
    r = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--model", str(d), "--port", "18997"],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and REFUSALS[case][1] in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize("name", ["gemma2", "qwen3"])
def test_served_disaggregated_over_http_it_answers_as_transformers(name, root, tokenizer_dir):
    """The default (disaggregated) server: prefill's pages cross to decode, which runs the same family's layers."""
    import openai
    from conftest import Server

    d = checkpoint(root, tokenizer_dir, name)
    tok = load_tokenizer(d)
    prompt = tok.encode(TEXT, add_special_tokens=False)[:30]
    with torch.no_grad():
        ref = hf_model(d).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 30, dtype=torch.int64),
                                   max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 30:]
    s = Server(["serve", "--model", str(d), "--dtype", "fp32", "--kv-pool-tokens", "4096"])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == tok.decode(ref.tolist())
        assert out.usage.prompt_tokens == 30
    finally:
        s.stop()


# -- vLLM's model flags -----------------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'forbidden' %}{{ raise_exception('not that') }}{% endif %}"
            "<<{{ m['content'] }}>>{% endfor %}{% if shout %}!!{% endif %}")


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_vllm_model_flags_reach_the_front_door(mode, root, tokenizer_dir, tmp_path):
    """--served-model-name (two names), --max-model-len, --generation-config (its defaults apply where a request
    is silent, a request's own values win), a request's chat_template_kwargs, in both modes (the launcher hands the front door's flags to the
    router); the chat template comes from --chat-template (colocated) or from a --tokenizer that carries it
    (disaggregated)."""
    import httpx
    from conftest import Server

    d = checkpoint(root, tokenizer_dir, "qwen3")
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5, "top_k": 20}))
    if mode == "colocated":
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        template = ["--colocated", "--chat-template", str(tmp_path / "t.jinja")]
    else:
        t = load_tokenizer(tokenizer_dir)
        t.chat_template = TEMPLATE
        t.save_pretrained(str(tmp_path / "tok2"))
        template = ["--tokenizer", str(tmp_path / "tok2")]
    s = Server(["serve", *template, "--model", str(d), "--dtype", "fp32", "--kv-pool-tokens", "4096",
                "--max-model-len", "128", "--served-model-name", "small", "small-alias", "--generation-config", str(gen)])
    try:
        models = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["small", "small-alias"]
        assert all(m["max_model_len"] == 128 and m["root"] == str(d) for m in models)
        tok = load_tokenizer(d)
        ids = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert ids == tok.encode("<<hi>>", add_special_tokens=False)
        # vLLM's chat_template_kwargs reach the template; a template's raise_exception is a 400, not a 500
        loud = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "chat_template_kwargs": {"shout": True}}).json()["tokens"]
        assert loud == tok.encode("<<hi>>!!", add_special_tokens=False)
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "model": "small", "messages": [{"role": "user", "content": "forbidden"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "not that" in r.text, r.text
        prompt = tok.encode(TEXT, add_special_tokens=False)[:20]
        with torch.no_grad():
            ref = hf_model(d).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 20, dtype=torch.int64),
                                       max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 20:]
        for name in ("small", "small-alias"):  # temperature 0 and 5 tokens: the generation config's defaults
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": prompt}, timeout=60).json()
            assert r["choices"][0]["text"] == tok.decode(ref.tolist()) and r["usage"]["completion_tokens"] == 5, r
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                       json={"model": "small", "messages": [{"role": "user", "content": "hi"}]}).json()
        assert r["usage"]["completion_tokens"] == 5 and r["usage"]["prompt_tokens"] == len(ids), r
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "small", "prompt": prompt, "max_tokens": 2}).json()
        assert r["usage"]["completion_tokens"] == 2, "a request's own max_tokens wins"
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "big", "prompt": prompt})
        assert r.status_code == 404 and "'small', 'small-alias'" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": "small", "prompt": prompt * 7})
        assert r.status_code == 400, "140 tokens past --max-model-len 128"
    finally:
        s.stop()


@pytest.mark.parametrize("flags, says", [
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template /nonexistent/t.jinja: No such file"),
    (["--chat-template", "{% for m in messages %}"], "--chat-template: line 1"),
    (["--generation-config", "/nonexistent"], "--generation-config /nonexistent: no generation_config.json"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice and --tool-call-parser go together"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice and --tool-call-parser go together"),
])
def test_bad_front_door_flags_are_refused_in_one_line(flags, says):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--port", "18996", *flags],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_dummy_weights_have_the_checkpoints_shapes_and_none_of_its_values(source, root, tokenizer_dir):
    path = None if source == "gguf" else checkpoint(root, tokenizer_dir, "gemma2")
    real, dummy = load(path, torch.float32, progress=False), load(path, torch.float32, progress=False, dummy=True)
    assert real.model.cfg == dummy.model.cfg
    pairs = [(real.model.w.embed, dummy.model.w.embed), (real.model.w.layers[0].wqkv, dummy.model.w.layers[0].wqkv)]
    assert all(a.shape == b.shape and a.dtype == b.dtype and not torch.equal(a, b) for a, b in pairs)


def test_a_generation_config_out_of_bounds_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7.0}))
    r = subprocess.run([sys.executable, "-m", "kvseal.cli", "serve", "--port", "18995", "--generation-config",
                        str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "temperature 7.0" in lines[0], r.stderr[-2000:]
