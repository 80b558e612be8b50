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
import json
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from tqdm import tqdm

from kvseal.config import ModelConfig
from kvseal.model.arch import ConfigError, hf_config
from kvseal.model.files import (
    CACHE_VERSION,
    DONE,
    cache_dir,
    default_model_path,
    load_tokenizer,
    size_from_json,
    tokenizer_size,
    tokenizer_source,
)
from kvseal.model.llama import Layer, LlamaModel, Weights


class LoadedModel:
    """A model and its tokenizer. The transformers tokenizer is built on first use: a worker that serves plain
    text never needs it (the front door tokenizes), and importing transformers is ~1 s of every start."""

    def __init__(self, model: LlamaModel, tokenizer: Path | object, name: str, path: Path) -> None:
        self.model, self.name, self.path = model, name, path
        self._tok, self._source = (None, tokenizer) if isinstance(tokenizer, Path) else (tokenizer, None)
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> object:
        with self._lock:
            if self._tok is None:
                self._tok = load_tokenizer(self._source)
            return self._tok


def load(path: str | Path | None, dtype: torch.dtype, progress: bool = True, tokenizer: str | Path | None = None,
         dummy: bool = False, weights: str | None = None, release: bool = False,
         shared: str | Path | None = None) -> LoadedModel:
    """The model in ``dtype`` with its tokenizer (or ``tokenizer``'s). ``dummy``: random weights of the
    checkpoint's shape, nothing read but the config and the tensors' shapes (as vLLM's ``--load-format dummy``).
    ``weights`` and ``release``: ``LlamaModel``'s (a server keeps one packed copy of the weights).
    ``shared``: a file the workers of this host share their packed weights through (``kvseal.model.shared``)."""
    p = Path(path) if path else default_model_path()
    if shared is not None:
        return _load_shared(p, Path(shared), dtype, progress, tokenizer, dummy, weights)
    cached = cache_dir(p) if p.is_file() else None
    tok: Path | object = Path(tokenizer) if tokenizer else tokenizer_source(p)
    if dummy:
        cfg, raw = _shapes(p)
    elif cached is not None and (cached / DONE).exists():
        cfg, raw = _read_cache(cached)
    elif p.is_file() and p.suffix == ".gguf":
        cfg, raw = _read_gguf(p, progress)
        if cached is not None:
            built = load_tokenizer(p)
            _write_cache(cached, cfg, raw, built)
            tok = tok if tokenizer else built
    elif p.is_dir() and (p / "config.json").exists():
        cfg, raw = _read_hf_dir(p, progress)
    elif p.is_dir():
        raise ConfigError(f"{p}: a model directory needs a config.json (and safetensors weights)")
    else:
        raise ConfigError(f"{p}: expected a .gguf file or a directory with config.json")
    n = size_from_json(tok) if isinstance(tok, Path) else None
    if n is None:  # no tokenizer.json to count: built now, and kept
        tok = load_tokenizer(tok) if isinstance(tok, Path) else tok
        n = len(tok)
    _fits(n, cfg)
    assembled = _assemble(cfg, raw, dtype)
    del raw
    name = p.stem if p.is_file() else p.name
    return LoadedModel(LlamaModel(cfg, assembled, dtype, weights, release), tok, name, p)


def _load_shared(p: Path, file: Path, dtype: torch.dtype, progress: bool, tokenizer: str | Path | None,
                 dummy: bool, weights: str | None) -> LoadedModel:
    from kvseal.model import cpu, shared

    mode = weights or ("bf16" if dtype == torch.bfloat16 else "fp32")
    files = sorted([p / "config.json", *p.glob("*.safetensors")]) if p.is_dir() else [p]
    key = {"model": str(p.resolve()), "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
           "dtype": str(dtype), "weights": mode, "level": cpu.choice().level, "dummy": dummy,
           "version": CACHE_VERSION}
    with shared.Lock(file):
        mapped = shared.read(file, key) if file.exists() else None
        if mapped is None:
            lm = load(p, dtype, progress, tokenizer, dummy, weights, release=True)
            if not shared.shareable(lm.model):
                print(f"kvseal: weights not shared ({mode} weights at kernel level {key['level']} run from "
                      "private copies)", flush=True)
                return lm
            if file.exists():
                print(f"kvseal: {file} holds other weights; this worker keeps its own copy", flush=True)
                return lm
            try:
                shared.write(file, {**key, "config": dataclasses.asdict(lm.model.cfg)}, shared.tensors(lm.model))
            except OSError as e:  # a full disk, a read-only directory: this worker keeps its own copy
                print(f"kvseal: weights not shared ({file}: {e.strerror})", flush=True)
                return lm
            del lm
            mapped = shared.read(file, key)
    cfg = _config_from_dict(json.loads(_header_config(file)))
    layers = []
    for i in range(cfg.num_layers):
        g = {f: mapped.get(f"{i}.{f}") for f in shared.LAYER_TENSORS}
        layers.append(Layer(wqkv=_meta(cfg, "qkv", dtype), wo=_meta(cfg, "o", dtype),
                            w_gate_up=_meta(cfg, "gate_up", dtype), w_down=_meta(cfg, "down", dtype), **g))
    embed = mapped["embed"]
    head = embed if cfg.tie_embeddings else torch.empty((cfg.vocab_size, cfg.hidden_size), dtype=dtype, device="meta")
    w = Weights(embed=embed, layers=layers, norm=mapped["norm"], lm_head=head)
    tok = Path(tokenizer) if tokenizer else tokenizer_source(p)
    _fits(tokenizer_size(tok), cfg)
    return LoadedModel(LlamaModel(cfg, w, dtype, "bf16", packed=mapped), tok, p.stem if p.is_file() else p.name, p)


def _fits(n_tokens: int, cfg: ModelConfig) -> None:
    if n_tokens > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {n_tokens} tokens, the model's vocabulary only {cfg.vocab_size}: "
                          "they do not belong together")


def _meta(cfg: ModelConfig, which: str, dtype: torch.dtype) -> torch.Tensor:
    hid, d = cfg.hidden_size, cfg.head_dim
    qn, kvn = cfg.num_heads * d, cfg.num_kv_heads * d
    shape = {"qkv": (qn + 2 * kvn, hid), "o": (hid, qn), "gate_up": (2 * cfg.intermediate_size, hid),
             "down": (hid, cfg.intermediate_size)}[which]
    return torch.empty(shape, dtype=dtype, device="meta")


def _header_config(file: Path) -> str:
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.dumps(json.loads(f.read(n))["key"]["config"])


def _config_from_dict(c: dict) -> ModelConfig:
    return ModelConfig(**{**c, "eos_token_ids": tuple(c["eos_token_ids"]), "layer_windows": tuple(c["layer_windows"])})


# -- load cache -------------------------------------------------------------------------------------------
def _read_cache(d: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    c = json.loads((d / "config.json").read_text())
    cfg = _config_from_dict(c)
    return cfg, load_file(str(d / "weights.safetensors"))


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
        raise ConfigError(f"GGUF architecture {arch!r} is not supported from GGUF (llama, qwen2); "
                          "give the Hugging Face directory (safetensors) instead")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    for key in ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "rope.scaling.yarn_log_multiplier"):
        if g(key) is not None:
            raise ConfigError(f"GGUF key {arch}.{key} is not supported from GGUF; give the Hugging Face directory")
    kind = g("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ConfigError(f"GGUF key {arch}.rope.scaling.type {kind!r} is not supported (none, linear)")
    rope = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))} if kind == "linear" else None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.x: per-frequency divisors (llama.cpp's rope_freqs), the llama3 scaling baked in
        if rope is not None:
            raise ConfigError("GGUF with both rope_freqs.weight and rope scaling is not supported")
        rope = {"rope_type": "factors", "factors": [float(x) for x in freqs.data.reshape(-1)]}
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
        bos_token_id=None if bos is None else int(bos), eos_token_ids=() if eos is None else (int(eos),), rope=rope)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(p: Path) -> object:
    import gguf

    try:
        return gguf.GGUFReader(str(p))
    except (ValueError, IndexError, OSError) as e:  # not GGUF, or cut short: one line, as a bad config is
        raise ConfigError(f"{p}: cannot read it as GGUF (damaged or cut short): {e}") from None


def _read_gguf(p: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(p)
    cfg = gguf_config(reader)
    permuted = _field(reader, "general.architecture") == "llama"  # llama.cpp permutes Q/K for llama only
    raw: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"loading {p.name}", disable=not progress):
        if t.name == "rope_freqs.weight":  # read into the config by gguf_config
            continue
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
    if rest not in _GGUF_NAMES:
        raise ConfigError(f"GGUF tensor {name} is not supported")
    return f"model.layers.{i}.{_GGUF_NAMES[rest]}"


# -- Hugging Face directory -------------------------------------------------------------------------------
def inspect(path: str | Path | None, dummy: bool = False, tokenizer: str | Path | None = None) -> ModelConfig | None:
    """Everything ``load`` would refuse in a Hugging Face directory (config keys, tensor names and shapes, the
    tokenizer's size), found without reading a weight: a server refuses in one line before it starts any
    process. None for a GGUF file (``load`` checks those)."""
    p = Path(path) if path else None
    if p is None or not p.is_dir():
        if p is not None and not p.exists():
            raise ConfigError(f"{p}: no such file or directory")
        return None
    if not (p / "config.json").exists():
        raise ConfigError(f"{p}: a model directory needs a config.json (and safetensors weights)")
    cfg, raw = _shapes(p) if dummy else _read_hf_dir(p, progress=False, meta=True)
    _fits(tokenizer_size(Path(tokenizer) if tokenizer else p), cfg)
    _assemble(cfg, raw, torch.float32, check_only=True)
    return cfg


def _shapes(p: Path) -> tuple[ModelConfig, dict[str, torch.Tensor] | None]:
    """The config and every tensor's shape (on the meta device) of an HF directory or a GGUF file; an HF
    directory without weights gives None: the config alone decides every shape."""
    if p.is_dir():
        if not any(p.glob("*.safetensors")):
            return hf_config(_config_json(p), None), None
        return _read_hf_dir(p, progress=False, meta=True)
    reader = _gguf_reader(p)
    cfg = gguf_config(reader)
    return cfg, {_gguf_to_hf(t.name): torch.empty(tuple(reversed([int(d) for d in t.shape])), device="meta")
                 for t in reader.tensors if t.name != "rope_freqs.weight"}


def _read_hf_dir(p: Path, progress: bool, meta: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and tensors as stored (bf16 stays bf16: ``_assemble`` converts once, to the model's dtype).
    ``meta``: shapes only (tensors on the meta device), nothing read."""
    from safetensors import safe_open

    c = _config_json(p)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{p}: no *.safetensors files (other weight formats are not supported)")
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    cfg = hf_config(c, names)
    gen = p / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            cfg = dataclasses.replace(cfg, eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),))
    raw: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {p.name}", disable=not progress):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                raw[k] = torch.empty(fh.get_slice(k).get_shape(), device="meta") if meta else fh.get_tensor(k)
    if c.get("model_type") == "phi3":
        raw = _split_phi3(cfg, raw)
    return cfg, raw


def _config_json(p: Path) -> dict:
    try:
        return json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p / 'config.json'}: not valid JSON ({e})") from None


def _split_phi3(cfg: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``: name them as Llama does."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for k, v in raw.items():
        if k.endswith("self_attn.qkv_proj.weight"):
            pre = k[: -len("qkv_proj.weight")]
            _shape(k, v, (q + 2 * kv, cfg.hidden_size))
            out[pre + "q_proj.weight"], out[pre + "k_proj.weight"], out[pre + "v_proj.weight"] = v.split([q, kv, kv])
        elif k.endswith("mlp.gate_up_proj.weight"):
            pre = k[: -len("gate_up_proj.weight")]
            _shape(k, v, (2 * cfg.intermediate_size, cfg.hidden_size))
            out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = v.chunk(2)
        else:
            out[k] = v
    return out


# -- assembly ---------------------------------------------------------------------------------------------
def _random(w: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, rng: torch.Generator) -> torch.Tensor:
    """--load-format dummy: random weights (norms near 1, so activations stay in range)."""
    out = torch.empty(shape, dtype=dtype)
    return out.uniform_(0.9, 1.1, generator=rng) if len(shape) == 1 else out.uniform_(-0.05, 0.05, generator=rng)


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(t.shape) != want:
        raise ConfigError(f"tensor {name} has shape {list(t.shape)}, the config says {list(want)}")


def _assemble(cfg: ModelConfig, raw: dict[str, torch.Tensor] | None, dtype: torch.dtype,
              check_only: bool = False) -> Weights:
    """The model's weights in ``dtype``, each tensor checked against the config's shapes; a missing or
    mis-shaped tensor, or one left over (the config does not describe the checkpoint), is a ``ConfigError``.
    Tensors on the meta device (shapes only), or every tensor when ``raw`` is None, become random weights
    (seeded: every worker of a cluster draws the same), or stay meta with ``check_only``."""
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qn, kvn = cfg.num_heads * d, cfg.num_kv_heads * d
    rng = torch.Generator().manual_seed(0)

    def t(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if raw is None:
            w = torch.empty(shape, device="meta")
            return _random(w, shape, dtype, rng) if not check_only else w
        if name not in raw:
            raise ConfigError(f"the checkpoint has no tensor {name}")
        w = raw.pop(name)
        _shape(name, w, shape)
        if w.is_meta and check_only:
            return w
        if w.is_meta:
            return _random(w, shape, dtype, rng)
        return w.to(dtype).contiguous()

    def opt(name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return t(name, shape) if present else None

    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        a, m = pre + "self_attn.", pre + "mlp."
        q, k, v = t(a + "q_proj.weight", (qn, hid)), t(a + "k_proj.weight", (kvn, hid)), t(a + "v_proj.weight", (kvn, hid))
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([t(a + "q_proj.bias", (qn,)), t(a + "k_proj.bias", (kvn,)), t(a + "v_proj.bias", (kvn,))])
        gemma = cfg.sandwich_norms
        layers.append(Layer(
            attn_norm=t(pre + "input_layernorm.weight", (hid,)), wqkv=torch.cat([q, k, v]).contiguous(), bqkv=bias,
            wo=t(a + "o_proj.weight", (hid, qn)),
            mlp_norm=t(pre + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"), (hid,)),
            w_gate_up=torch.cat([t(m + "gate_proj.weight", (inter, hid)), t(m + "up_proj.weight", (inter, hid))]).contiguous(),
            w_down=t(m + "down_proj.weight", (hid, inter)),
            q_norm=opt(a + "q_norm.weight", (d,), cfg.qk_norm), k_norm=opt(a + "k_norm.weight", (d,), cfg.qk_norm),
            post_attn_norm=opt(pre + "post_attention_layernorm.weight", (hid,), gemma),
            post_mlp_norm=opt(pre + "post_feedforward_layernorm.weight", (hid,), gemma),
            bo=opt(a + "o_proj.bias", (hid,), cfg.o_bias),
            b_gate_up=torch.cat([t(m + "gate_proj.bias", (inter,)), t(m + "up_proj.bias", (inter,))]) if cfg.mlp_bias else None,
            b_down=opt(m + "down_proj.bias", (hid,), cfg.mlp_bias)))
    embed = t("model.embed_tokens.weight", (cfg.vocab_size, hid))
    lm_head = embed if cfg.tie_embeddings else t("lm_head.weight", (cfg.vocab_size, hid))
    norm = t("model.norm.weight", (hid,))
    left = sorted(k for k in raw or () if not k.endswith("rotary_emb.inv_freq"))
    if left:
        raise ConfigError(f"the checkpoint has {len(left)} tensor(s) the config does not describe, e.g. {left[0]}")
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
