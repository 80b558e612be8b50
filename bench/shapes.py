"""Config-only checkpoints of real models' shapes, for ``--load-format dummy`` (kvseal and vLLM alike): a
``config.json`` as the model's own, and SmolLM2's tokenizer (smaller than their vocabularies, so every id it
makes is valid). Nothing is downloaded.

    python bench/shapes.py DIR            # writes DIR/smollm2-135m, DIR/llama-3.2-1b and DIR/llama-3.1-8b
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_theta": 100000.0},  # the default model's own shape
    "llama-3.2-1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                     "rope_theta": 500000.0, "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}},
}
COMMON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
          "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False,
          "mlp_bias": False, "torch_dtype": "bfloat16"}


def write(root: Path, name: str) -> Path:
    from kvseal.model.loader import default_model_path, load_tokenizer

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**COMMON, **SHAPES[name]}, indent=1))
    load_tokenizer(default_model_path()).save_pretrained(str(d))
    return d


def params(name: str) -> int:
    s = SHAPES[name]
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return n * layer + v * h * (1 if s["tie_word_embeddings"] else 2) + h


if __name__ == "__main__":
    for n in SHAPES:
        print(write(Path(sys.argv[1]), n), f"{params(n) / 1e9:.2f} B parameters")
