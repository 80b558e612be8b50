"""What a checkpoint's ``config.json`` means, or a refusal: every key that changes the arithmetic is either
implemented or refused at start, naming the key.

A server that answers 200 with the wrong model's arithmetic (RoPE θ read from the wrong place, a scaling or a
sliding window ignored) is the failure kvseal exists to rule out, so reading a config is strict:

- the families below are understood (``FAMILIES``), in both config styles transformers has written: 4.x
  (``rope_theta`` and ``rope_scaling`` at the top level) and 5.x (``rope_parameters``, per layer type for
  Gemma 3);
- a key that transformers' own config class for that family reads is either implemented here, listed in
  ``INERT`` (it cannot change a forward pass: dropout, ids, bookkeeping), or refused;
- a value this module does not implement (an activation, a RoPE type, partial rotary, bidirectional
  attention, a quantization config) is refused by name;
- keys transformers' class does not know are ignored, as transformers ignores them.

RoPE types: default, linear, llama3, yarn (static tables, as transformers computes them) and dynamic. Dynamic
NTK rescales with the sequence's current length in transformers, which a paged cache cannot follow (keys
cached at one length would be rotated for another); kvseal serves such a model up to its original context,
where dynamic RoPE is plain RoPE, exactly. longrope (Phi-3 128k) is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvseal.config import ModelConfig

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A checkpoint kvseal cannot serve exactly; the message names the key."""


@dataclass(frozen=True)
class Family:
    act_key: str = "hidden_act"
    gemma: bool = False  # (1 + w) norms, scaled embeddings, sandwich norms, query_pre_attn_scalar
    qk_norm: bool = False
    windows: str = "none"  # none | all (Mistral, Phi-3: sliding_window on every layer) | layer_types
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj stored fused
    handled: frozenset = frozenset()  # family keys read below


FAMILIES = {
    "llama": Family(handled=frozenset({"attention_bias", "mlp_bias"})),
    "mistral": Family(windows="all"),
    "qwen2": Family(windows="layer_types"),
    "qwen3": Family(windows="layer_types", qk_norm=True, handled=frozenset({"attention_bias"})),
    "gemma2": Family(act_key="hidden_activation", gemma=True, windows="layer_types",
                     handled=frozenset({"attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                                        "query_pre_attn_scalar", "use_bidirectional_attention"})),
    "gemma3_text": Family(act_key="hidden_activation", gemma=True, qk_norm=True, windows="layer_types",
                          handled=frozenset({"attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                                             "query_pre_attn_scalar", "use_bidirectional_attention",
                                             "rope_local_base_freq"})),
    "phi3": Family(windows="all", fused=True, handled=frozenset({"original_max_position_embeddings"})),
}
# read by every family
COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
          "rope_parameters", "rope_theta", "rope_scaling", "sliding_window", "layer_types", "use_sliding_window",
          "max_window_layers", "bos_token_id", "eos_token_id", "model_type", "hidden_act", "hidden_activation",
          "partial_rotary_factor"}
# cannot change a forward pass at inference
INERT = {"_name_or_path", "architectures", "pad_token_id", "dtype", "torch_dtype", "transformers_version",
         "use_cache", "initializer_range", "attention_dropout", "embd_pdrop", "resid_pdrop", "id2label", "label2id",
         "output_attentions", "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward",
         "is_encoder_decoder", "tokenizer_class", "pretraining_tp", "cache_implementation",
         "_sliding_window_pattern", "sliding_window_pattern", "auto_map"}
ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
ROPE_TYPES = {"default", "linear", "dynamic", "llama3", "yarn"}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate", "partial_rotary_factor"}


def family_keys(model_type: str) -> set[str]:
    """The keys transformers' config class for ``model_type`` reads beyond every config's generic ones."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    return set(CONFIG_MAPPING[model_type]().to_dict()) - set(PreTrainedConfig().to_dict())


def hf_config(c: dict, tensor_names: set[str] | None) -> ModelConfig:
    """A ``ModelConfig`` for an HF ``config.json`` (as a dict), or ``ConfigError`` naming what cannot be served.
    ``tensor_names``: the checkpoint's (they decide tied embeddings and q/k/v biases); None for a directory
    without weights (``--load-format dummy``), where the config and the family decide.

    transformers' own config class reads the dict first: it turns either config style into one (layer types,
    per-layer-type RoPE parameters), exactly as the reference implementation will see it."""
    from transformers import CONFIG_MAPPING

    mt = c.get("model_type")
    if mt == "gemma3" and "text_config" in c:
        raise ConfigError("model_type 'gemma3' is Gemma 3's multimodal checkpoint: serve a text-only one "
                          "(model_type 'gemma3_text')")
    fam = FAMILIES.get(mt)
    if fam is None:
        raise ConfigError(f"model_type {mt!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    if c.get("quantization_config"):
        q = c["quantization_config"]
        raise ConfigError(f"config key 'quantization_config' ({q.get('quant_method') if isinstance(q, dict) else q}):"
                          " pre-quantized checkpoints are not supported; give the unquantized weights")
    for key in sorted(family_keys(mt) & set(c)):
        if key not in COMMON | INERT | fam.handled:
            raise ConfigError(f"config key {key!r} of model_type {mt!r} is not implemented by kvseal "
                              "and may change the arithmetic")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(c.get(key), int) or c[key] <= 0:
            raise ConfigError(f"config key {key!r} is missing or not a positive integer ({c.get(key)!r})")
    try:
        hf = CONFIG_MAPPING[mt].from_dict(dict(c))
    except Exception as e:  # noqa: BLE001 - transformers' own validation, whatever it raises
        raise ConfigError(f"transformers refuses this {mt} config: {str(e).splitlines()[0]}") from None
    act = getattr(hf, fam.act_key, None) or "silu"
    if act not in ACTS:
        raise ConfigError(f"config key {fam.act_key!r}: activation {act!r} is not supported ({', '.join(ACTS)})")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError("config key 'use_bidirectional_attention': only causal attention is supported")
    if getattr(hf, "attention_bias", False) and mt != "llama":
        raise ConfigError(f"config key 'attention_bias' of model_type {mt!r} is not supported")
    heads = hf.num_attention_heads
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    layers = hf.num_hidden_layers
    max_context = int(hf.max_position_embeddings)
    rope, rope_local, max_context = _rope(hf.rope_parameters, max_context)
    windows = _windows(hf, fam, layers)
    eos = c.get("eos_token_id")
    scalar = getattr(hf, "query_pre_attn_scalar", None) if fam.gemma else None
    return ModelConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=layers, num_heads=heads, num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=head_dim, rope_theta=float(rope.pop("rope_theta")), rms_eps=float(hf.rms_norm_eps),
        max_context=max_context,
        tie_embeddings=bool(hf.tie_word_embeddings) if tensor_names is None else _tied(c, tensor_names),
        qkv_bias=(mt == "qwen2" or bool(getattr(hf, "attention_bias", False))) if tensor_names is None
        else "model.layers.0.self_attn.q_proj.bias" in tensor_names,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        rope=rope if rope["rope_type"] != "default" else None, rope_local=rope_local,
        layer_windows=windows if any(windows) else (),
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0, norm_offset=fam.gemma, act=ACTS[act],
        embed_scale=fam.gemma, qk_norm=fam.qk_norm, sandwich_norms=fam.gemma,
        o_bias=bool(getattr(hf, "attention_bias", False)), mlp_bias=bool(getattr(hf, "mlp_bias", False)))


def _tied(c: dict, names: set[str]) -> bool:
    if "lm_head.weight" in names:
        return False
    if c.get("tie_word_embeddings") is False:
        raise ConfigError("config key 'tie_word_embeddings' is false but the checkpoint has no lm_head.weight")
    return True


def _windows(hf: object, fam: Family, layers: int) -> tuple[int, ...]:
    w = getattr(hf, "sliding_window", None)
    if not w:
        return (0,) * layers
    if fam.windows == "all":
        return (int(w),) * layers
    types = getattr(hf, "layer_types", None) or ["full_attention"] * layers
    if len(types) != layers:
        raise ConfigError(f"config key 'layer_types' names {len(types)} layers, num_hidden_layers is {layers}")
    bad = set(types) - {"full_attention", "sliding_attention"}
    if bad:
        raise ConfigError(f"config key 'layer_types': {sorted(bad)} not supported (full_attention, sliding_attention)")
    return tuple(int(w) if t == "sliding_attention" else 0 for t in types)


def _rope(params: dict, max_context: int) -> tuple[dict, dict | None, int]:
    """(global RoPE parameters with rope_theta, the sliding layers' where they differ, served context)."""
    local = None
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or params["full_attention"])
        params = dict(params.get("full_attention") or local)
    else:
        params = dict(params)
    for p in (params, local):
        if p is None:
            continue
        unknown = set(p) - ROPE_KEYS
        if unknown:
            raise ConfigError(f"config key 'rope_parameters': {sorted(unknown)} not supported")
        p.setdefault("rope_type", p.pop("type", "default"))
        p.pop("type", None)
        if p["rope_type"] not in ROPE_TYPES:
            raise ConfigError(f"config key 'rope_parameters': rope_type {p['rope_type']!r} is not supported "
                              f"({', '.join(sorted(ROPE_TYPES))})")
        if float(p.pop("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ConfigError("config key 'partial_rotary_factor': only full rotary embeddings are supported")
        if p.get("rope_theta") is None:
            raise ConfigError("config key 'rope_theta' is missing")
        if p["rope_type"] == "dynamic":  # plain RoPE up to the original context: served that far, exactly
            max_context = min(max_context, int(p.get("original_max_position_embeddings") or max_context))
    if local == params:
        local = None
    return params, local, max_context


# -- RoPE tables ---------------------------------------------------------------------------------------------
def inv_freq(theta: float, dim: int, params: dict | None, max_context: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[dim / 2]`` and the factor applied to cos and sin, as transformers computes
    them for each RoPE type."""
    import torch  # here, not at the top: the router reads configs (ConfigError) and never loads PyTorch

    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (params or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "factors":  # GGUF's rope_freqs: each frequency divided by its factor
        return base / torch.tensor(params["factors"], dtype=torch.float32), 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return base / factor, 1.0
    original = int(params.get("original_max_position_embeddings") or max_context)
    if kind == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > original / low, base / factor, base)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all else _mscale(factor)
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / ((hi + 0.001 if lo == hi else hi) - lo)).clamp(0, 1)
    extrapolate = 1 - ramp
    return base / factor * (1 - extrapolate) + base * extrapolate, float(attn)


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
