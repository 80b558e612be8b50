"""Incremental detokenization with stop strings.

Each push decodes only a window: the tokens since the text before last was read, which gives the new tokens the
context their text depends on (a SentencePiece word's leading space, a character split over tokens, a
tokenizer's clean-up of spaces), and keeps the part past what that context alone decodes to. A step costs the
same at the 4,000th token as at the first; re-decoding the whole output each time cost 0.6 ms there, per stream
and token, on the HTTP loop's core. Where the window's two decodings do not line up the whole output is
decoded instead. A trailing U+FFFD means a character is still incomplete and is held back. A stop string ends
the text before it; text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations


class TextStream:
    """``stop_ids``: the request's ``stop_token_ids``; the engine ends a request on the first one it samples
    (never before ``min_tokens``), and as in vLLM its text is not part of the answer (the token still counts,
    and has its logprob). ``include_stop``: vLLM's ``include_stop_str_in_output``, which keeps that text and
    a matched stop string's. ``skip_special``: vLLM's ``skip_special_tokens``; with it off, special tokens are
    part of the text, except the one that ends the request (an end of sequence): a special token's text waits
    for the next event, which says whether it was that one."""

    def __init__(self, tokenizer: object, stops: list[str], min_tokens: int = 0,
                 stop_ids: frozenset[int] = frozenset(), include_stop: bool = False,
                 skip_special: bool = True) -> None:
        self.tok = tokenizer
        self.stops = stops
        self.min_tokens = min_tokens  # as vLLM: no stop string ends a request before min_tokens
        self.stop_ids = frozenset() if include_stop else stop_ids
        self.include_stop = include_stop
        self.skip_special = skip_special
        self.wait_ids = frozenset() if skip_special or include_stop else frozenset(tokenizer.all_special_ids)
        self.waiting: list[int] = []  # a special token whose text waits to know if it ended the request
        self.count = 0  # tokens pushed
        self.ids: list[int] = []  # those whose text is the answer's
        self.text = ""  # the output's text so far: ids[:read], whole characters
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next tokens are decoded after
        self.sent = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, ids: tuple[int, ...] | list[int], final: bool = False, stop_token: bool = False) -> str:
        """Add tokens; return the new text that is safe to send. ``stop_token``: the engine ended the request
        with "stop", which it does on a stop token (an end of sequence or one of ``stop_token_ids``): the last
        token pushed."""
        self.count += len(ids)
        ids = self.waiting + list(ids)
        self.waiting = []
        if final and stop_token and ids and ids[-1] in self.wait_ids:
            ids.pop()  # the end of sequence: not the answer's text
        elif not final and ids and ids[-1] in self.wait_ids:
            self.waiting = [ids.pop()]
        self.ids.extend(ids[:-1] if ids and ids[-1] in self.stop_ids else ids)
        context = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if not final and window.endswith("\ufffd"):
            return ""
        if window.startswith(context):
            piece = window[len(context):]
            self.text += piece
        else:  # the context decodes differently once followed: the whole output, then
            whole = self._decode(self.ids)
            piece, self.text = whole[len(self.text):], whole
        # the next context is these tokens, if they hold text: tokens that decode to nothing (special ones,
        # skipped) would leave the next word first in its window, where SentencePiece drops its space
        self.prefix, self.read = (self.read if piece else self.prefix), len(self.ids)
        text = self.text
        for s in self.stops if self.count >= self.min_tokens else ():
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.stopped = True
                text = text[:at + len(s) * self.include_stop]
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
