"""Incremental detokenization with stop strings.

Text is re-decoded from all output tokens (cheap at these lengths) so multi-token characters come out whole;
a trailing U+FFFD means a character is still incomplete and is held back. A stop string ends the text
before it; text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer: object, stops: list[str]) -> None:
        self.tok = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, ids: tuple[int, ...] | list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to send."""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        for s in self.stops:
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
