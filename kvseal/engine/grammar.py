"""Structured output: ``response_format`` (or vLLM's ``structured_outputs``) compiled to a grammar by llguidance,
enforced as a token mask.

The front door compiles a JSON schema (or "any JSON object", a regex, a list of choices, a Lark or GBNF grammar)
into an llguidance grammar string and rejects one the library cannot compile (400). The grammar string travels
with the request's sampling parameters to whichever engine samples (the colocated engine; prefill for the first
token, decode for the rest), and each engine builds its own matcher from it, replaying the tokens the request
already has. The mask removes every token the grammar cannot take next; once the grammar is complete only EOS
is allowed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import llguidance

from kvseal.errors import BadRequest

if TYPE_CHECKING:
    import torch


def compile_response_format(fmt: dict | None) -> str | None:
    """OpenAI's ``response_format`` → an llguidance grammar string, or None for plain text."""
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        schema: dict = {"type": "object"}
    else:
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                             param="response_format")
    return compile_json_schema(schema, "response_format")


def compile_json_schema(schema: dict, param: str) -> str:
    """A JSON schema → an llguidance grammar string; 400 naming ``param`` if it cannot be compiled."""
    return _checked(lambda: llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}), param, "the schema")


def compile_structured(kind: str, value: object) -> str:
    """vLLM's ``structured_outputs`` (``kvseal.server.schema.StructuredOutputs.form``) → an llguidance grammar:
    a JSON schema (or its text), any JSON object, a regex the whole output matches, one of a list of strings
    exactly, or a Lark / GBNF grammar. 400 naming the field if it cannot be compiled."""
    param = f"structured_outputs.{kind}"
    if kind == "json_object":
        return compile_json_schema({"type": "object"}, param)
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            raise BadRequest(f"{param} is neither a JSON schema object nor its JSON text", param=param) from None
        if not isinstance(schema, dict):
            raise BadRequest(f"{param} must be a JSON schema object", param=param)
        return compile_json_schema(schema, param)
    if kind == "choice":
        if not all(value):
            raise BadRequest(f"{param}: every choice must be a non-empty string", param=param)
        return _checked(lambda: llguidance.grammar_from("choice", value), param, "the choices")
    if kind == "regex":
        return _checked(lambda: llguidance.LLMatcher.grammar_from_regex(value), param, "the regex")
    return _checked(lambda: llguidance.grammar_from("grammar", value), param, "the grammar")


def _checked(make: Callable[[], str], param: str, what: str) -> str:
    try:
        grammar = make()
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        err = str(e)
    if err:
        raise BadRequest(f"{param}: {what} cannot be compiled: {err}", param=param)
    return grammar


class Grammars:
    """Builds matchers for one tokenizer; ``tokenizer`` gives the transformers tokenizer, asked for (and the
    llguidance tokenizer made from it) once, on the first request with a grammar."""

    def __init__(self, tokenizer: Callable[[], object], vocab_size: int) -> None:
        self.hf = tokenizer
        self.vocab_size = vocab_size
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def matcher(self, grammar: str, replay: list[int]) -> llguidance.LLMatcher:
        with self._lock:
            if self._tok is None:
                # imported here: it imports transformers, which a worker need not load to serve plain text
                from llguidance.hf import from_tokenizer

                self._tok = from_tokenizer(self.hf(), n_vocab=self.vocab_size)
        m = llguidance.LLMatcher(self._tok, grammar)
        for t in replay:
            m.consume_token(t)
        if m.is_error():
            raise BadRequest(f"response_format: grammar rejected: {m.get_error()}", param="response_format")
        return m


def mask_row(matcher: llguidance.LLMatcher, row: torch.Tensor) -> None:
    """Set every token the grammar cannot accept next to -inf, in place (row [V], fp32).

    llguidance fills a bitmask (bit t of word t // 32: token t allowed); the bits are unpacked here with eager
    PyTorch ops, not with ``llguidance.torch.apply_token_bitmask_inplace``: that is a ``torch.compile`` kernel,
    which needs a C++ compiler at run time (kvseal runs without one), and Inductor's cache hands a kernel built
    under one ``ATEN_CPU_CAPABILITY`` to a process under another (seen here: wrong masks, then a corrupted heap).
    Importing ``llguidance.torch`` at all costs ~2 s of every process start (it loads Dynamo and Inductor), so
    the bitmask is filled here through the matcher's own call."""
    row.masked_fill_(~allowed_tokens(matcher, row.numel()), float("-inf"))


def allowed_tokens(matcher: llguidance.LLMatcher, n: int) -> torch.Tensor:
    """The tokens the grammar can take next, as a bool tensor [n]."""
    import torch  # here, not at the top: the router compiles grammars and never loads PyTorch

    bits = torch.full(((n + 31) // 32,), -1, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
    return ((bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:n].bool()
