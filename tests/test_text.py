"""The front door's incremental detokenizer (``kvseal.server.text.TextStream``): whatever the tokens and however
they arrive, the text it sends is the whole output decoded at once; for the default byte-level BPE tokenizer
and for a SentencePiece-style one (a word's leading space in its first token, dropped at the very start)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.model.loader import default_model_path, load_tokenizer
from kvseal.server.text import TextStream

TEXT = ("The lighthouse keeper counted ships at dawn — naïve café, 東京, 🙂 — and the harbor bell rang twice "
        "for every boat that came home before the storm.")


@functools.cache
def default() -> object:
    return load_tokenizer(default_model_path())


@functools.cache
def metaspace() -> object:
    """A small BPE over Metaspace pieces (``▁word``), as Llama 2's, Mistral's and Gemma's tokenizers split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tk.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


TOKENIZERS = {"byte-level": default, "metaspace": metaspace}


def streamed(tok: object, ids: list[int], cuts: list[int]) -> str:
    ts, out, i = TextStream(tok, []), [], 0
    for k in cuts + [len(ids)]:
        out.append(ts.push(ids[i:i + k]))
        i += k
    return "".join(out) + ts.push([], final=True)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_real_text_streamed_a_token_at_a_time_is_the_whole_decode(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 20
    assert streamed(tok, ids, [1] * len(ids)) == tok.decode(ids, skip_special_tokens=True) != ""


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_tokens_in_any_chunks_stream_as_the_whole_decode(name, data):
    """Random ids (bytes that never make a character, special tokens, words) in chunks of 1-4."""
    tok = TOKENIZERS[name]()
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(1, 4), max_size=40))
    assert streamed(tok, ids, cuts) == tok.decode(ids, skip_special_tokens=True)


def test_a_step_decodes_a_window_not_the_whole_output():
    """Each push decodes the tokens since the text before last, not all of them (that cost grew with the
    output: 0.6 ms a token at 4,000 tokens, per stream, on the HTTP loop)."""
    tok = default()
    seen: list[int] = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(TEXT * 8, add_special_tokens=False)
    assert streamed(Counting(), ids, [1] * len(ids)) == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 200 and max(seen) <= 8, max(seen)
