"""What a request asks of an engine and what an engine reports about it: plain data, no tensors.

``SamplingParams`` travel from the front door to the workers (``to_wire``); ``Event`` is what an engine, or a
router relaying a worker's stream, yields per step. The router imports these and never needs PyTorch: a front
door starts without loading it (``tests/test_packaging.py`` holds it to that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvseal.transfer.messages import Logprob  # a wire type: it rides in Ack and token events


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a request's seed: a signed 64-bit integer, as vLLM takes it


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's ``choice``-th choice: ``seed + choice``, wrapped into the signed 64-bit range so
    that it travels in a wire message and seeds a generator whatever seed the client chose."""
    return (seed + choice - SEED_MIN) % 2**64 + SEED_MIN


# A temperature below this samples greedily, as vLLM's does: dividing logits by 1e-40 gives infinities, and a draw
# from them fails (it was a 500, and before that the failure of every request in the step)
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob and the k most likely
    grammar: str | None = None  # an llguidance grammar, compiled from response_format at the front door

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # the wire form carries lists; the frozen form holds tuples
        set_(self, "stop", tuple(self.stop))
        set_(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        set_(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError("temperature >= 0, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1")
        if (self.repetition_penalty <= 0 or self.min_tokens < 0 or (self.logprobs or 0) < 0
                or (self.prompt_logprobs or 0) < 0):
            raise ValueError("repetition_penalty > 0, min_tokens >= 0, logprobs >= 0, prompt_logprobs >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Does any processor change this request's logits?"""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1 or self.grammar
                    or self.presence_penalty or self.frequency_penalty)

    @property
    def plain(self) -> bool:
        return self.greedy and not self.processed and self.logprobs is None

    def to_wire(self) -> dict:
        """Everything but ``max_tokens``, as JSON-ready values: what travels to prefill and decode workers."""
        d = dataclasses.asdict(self)
        del d["max_tokens"]
        return d


@dataclass(frozen=True)
class Event:
    """What an engine reports about a request: new tokens, then exactly one final event."""

    rid: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: Exception | None = None
    logprobs: tuple[Logprob, ...] = ()  # one per token, when the request asked for logprobs
    cached_tokens: int = 0  # on the first token's event: prompt tokens read from the prefix cache
    # on the first token's event, when the request asked for them: the logprob of each prompt token after the
    # first, given the tokens before it (the first has nothing to be predicted from)
    prompt_logprobs: tuple[Logprob, ...] = ()
