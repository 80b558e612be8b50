"""Incremental detokenization with stop strings.

Text is re-decoded from all output tokens (cheap at these lengths) so multi-token characters come out whole;
a trailing U+FFFD means a character is still incomplete and is held back. A stop string ends the text
before it; text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer: object, stops: list[str], min_tokens: int = 0) -> None:
        self.tok = tokenizer
        self.stops = stops
        self.min_tokens = min_tokens  # as vLLM: no stop string ends a request before min_tokens
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, ids: tuple[int, ...] | list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to send."""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        for s in self.stops if len(self.ids) >= self.min_tokens else ():
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not final and not self.stopped:
            end -= self._partial_stop(text)
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _partial_stop(self, text: str) -> int:
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold


class TokenStrings:
    """A token's text and raw bytes, as OpenAI's logprobs give them. Byte-level BPE tokenizers (GPT-2 style,
    SmolLM2's) spell bytes as printable characters; this maps them back, so a token holding half of a UTF-8
    character has its true bytes and a text with U+FFFD."""

    def __init__(self, tokenizer: object) -> None:
        self.tok = tokenizer
        self.byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            piece = self.tok.convert_ids_to_tokens(tid) or ""
            if tid in self.special or any(ch not in self.byte_of for ch in piece):
                b = piece.encode() if tid in self.special else self.tok.decode([tid]).encode()
            else:
                b = bytes(self.byte_of[ch] for ch in piece)
            self._cache[tid] = b
        return b

    def text(self, tid: int) -> str:
        return self.bytes(tid).decode("utf-8", errors="replace")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))
