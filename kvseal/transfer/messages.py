"""Typed, versioned messages of the transfer protocol, and the per-transfer checksum.

    router → decode   Reserve   → Lease        decode admission, pages RESERVED for rid, a fresh nonce
    router → prefill  Prefill   → PrefillDone  prefill admission *before* any allocation or byte moved
    prefill → decode  (page writes into the leased pages), then Commit → CommitAck
    prefill frees its own pages only after the ack (deferred release)
    router → decode   Abort;  prefill → decode  WriterDone (abort-ack: quarantined pages may be freed)
    decode → prefill  Forget  → {writing}  a lease past its TTL (its router died): refused from now on
    decode → router   one NDJSON line of ``StepEvents`` per engine step, on one stream per router

The checksum (xxh3-128) covers the page bytes *and* the commit's metadata (rid, nonce, pages, generations,
token count, first token), so a commit cannot be replayed onto other pages or another lease, and a control
message corrupted on the way is caught like a corrupted page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import xxhash

from kvseal.errors import EngineError

if TYPE_CHECKING:
    import torch

VERSION = 6  # 2: Reserve names the router's stream, tokens multiplexed; 3: page-major pool layout;
# 4: every sampling parameter travels (SamplingParams.to_wire), logprobs ride with tokens, leases carry a
# capability that commits and WriterDone must present; 5: prompt logprobs (a sampling parameter, and in Ack);
# 6: Prefill carries the request's cache_salt


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    """One generated token's logprob and the ``top`` alternatives, most likely first: ``[(token, logprob)]``."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []
    rank: int = 0  # 1 = the most likely token; a prompt token's (vLLM's prompt_logprobs), 0 where not computed


class Msg(msgspec.Struct, kw_only=True):
    v: int = VERSION


class Reserve(Msg):
    rid: int
    tenant: str
    prompt: list[int]
    max_new: int
    sampling: dict
    prefill_id: str
    subscriber: str = ""  # the router stream that carries this request's tokens


class TokenEvent(msgspec.Struct, array_like=True):
    """One request's tokens from one engine step; ``finish`` set on its last event."""

    rid: int
    tokens: list[int]
    finish: str | None = None
    error: dict | None = None  # {"message", "type", "code", "status"}
    logprobs: list[Logprob] | None = None  # one per token, when the request asked for them


class Capability(msgspec.Struct, kw_only=True):
    """What a lease lets its writer touch, MACed by decode with a key that never leaves it: decode verifies it
    without any state, so a capability for one lease cannot commit another, name pages outside it, or outlive
    its writer's fencing (the writer's epoch moved on) or its expiry."""

    rid: int
    nonce: int
    decode_id: str
    writer: str  # the prefill the router chose (its URL as the router knows it)
    epoch: int  # the writer's epoch on decode when the lease was granted; fencing bumps it
    pages: list[int]
    generations: list[int]
    expires: float = 0.0  # wall-clock seconds after which a commit is refused (0: the lease has no TTL)
    mac: str = ""


class Lease(Msg):
    rid: int
    nonce: int
    pages: list[int]
    generations: list[int]
    n_prompt: int
    decode_id: str
    target: str  # transport address of the decode pool (shm path or mooncake session)
    layout: list[int]  # pool shape, checked by the writer
    cap: Capability | None = None
    dtype: str = ""  # the pool's element type ("bfloat16", "float32"), checked by the writer: --dtype auto can
    # resolve differently on hosts with different CPUs


class Prefill(Msg):
    rid: int
    tenant: str
    prompt: list[int]
    max_new: int
    sampling: dict
    lease: Lease
    decode_url: str
    group: int | None = None  # n > 1: the choices of a prompt share its pages on prefill (never on decode)
    cache_salt: str = ""  # vLLM's: the prompt's prefix-cache keys apart from its tenant's other requests'


class Commit(Msg):
    rid: int
    nonce: int
    n_tokens: int
    first_token: int
    pages: list[int]
    generations: list[int]
    checksum: str
    cap: Capability | None = None


class Ack(Msg):
    ok: bool
    status: int = 200
    code: str = ""
    message: str = ""
    first_token: int = -1
    first_logprob: Logprob | None = None  # prefill's, for the router; not covered by the checksum
    cached_tokens: int = 0  # prompt tokens prefill read from its prefix cache (usage and metrics)
    prompt_logprobs: list[Logprob] | None = None  # prefill's, when asked for (echo with logprobs)


class Abort(Msg):
    rid: int
    nonce: int = 0
    writer_done: bool = False  # the router holds prefill's final answer: no write can still land


class Fence(Msg):
    prefill_id: str  # declared dead: revoke its leases, free what they quarantined


class WriterDone(Msg):
    rid: int
    nonce: int
    cap: Capability | None = None


class Forget(Msg):
    """decode → prefill (a lease that outlived its TTL) or router → prefill (a transfer it gave up on): stop,
    or never start, writing into it. The answer ``{"writing": false}`` promises no byte will land."""

    rid: int
    nonce: int


def page_bytes(kv: torch.Tensor, pages: list[int], n_tokens: int) -> list[torch.Tensor]:
    """The bytes of the first ``n_tokens`` slots of ``pages``, in a fixed order on every node: the full
    pages whole, then the written slots of the last one (its unwritten tail differs between nodes)."""
    import torch  # here, not at the top: the router speaks these messages and never loads PyTorch

    full, rem = divmod(n_tokens, kv.shape[4])
    parts = [kv[torch.tensor(pages[:full], dtype=torch.int64, device=kv.device)]] if full else []
    if rem:
        parts.append(kv[pages[full], :, :, :, :rem].contiguous())
    return [p.view(torch.uint8).reshape(-1).cpu() for p in parts]  # a GPU pool's bytes are hashed on the host


def checksum(kv: torch.Tensor, pages: list[int], n_tokens: int, rid: int, nonce: int, dest_pages: list[int],
             generations: list[int], first_token: int) -> str:
    h = xxhash.xxh3_128()
    for part in page_bytes(kv, pages, n_tokens):
        h.update(part.numpy())
    h.update(msgspec.msgpack.encode([rid, nonce, dest_pages, generations, n_tokens, first_token]))
    return h.hexdigest()


class ProtocolMismatch(EngineError):
    status = 500
    code = "protocol_version_mismatch"
    type = "server_error"


encode = msgspec.json.encode


def decode(data: bytes, typ: type) -> object:
    msg = msgspec.json.decode(data, type=typ)
    if isinstance(msg, Msg) and msg.v != VERSION:
        raise ProtocolMismatch(f"protocol version {msg.v}, this worker speaks {VERSION}: upgrade the older side")
    return msg
