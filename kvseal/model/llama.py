"""Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU, tied embeddings) whose attention reads the paged pool.

The families that depart from plain Llama (``ModelConfig.plain`` is False: Gemma 2/3's norms, soft-capping
and scaled embeddings, Qwen3's q/k norms, sliding windows that bind, biases on o_proj or the MLP) run the
plain-PyTorch reference layers, ``_layers``, with the plain-PyTorch attention; the native kernels implement
plain Llama only. RoPE scaling (linear, llama3, YaRN) is in the tables, which every path reads.

One forward serves prefill chunks and decode steps together: a step's tokens are packed into ``[N]`` rows
(no padding), every linear layer runs on all rows at once, and attention (``kvseal.model.attention``) reads
each request's pages through its page table. New K/V are scattered into the pool *before* attention, so a
token attends to itself.

Numerics mirror Hugging Face's Llama (RMSNorm in fp32, RoPE tables in fp32 cast to the activation dtype) so
greedy tokens match transformers in the same dtype.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from kvseal.config import ModelConfig
from kvseal.model.arch import inv_freq
from kvseal.model.attention import DecodeRows, LayerShape, PagedAttention, Span, scatter_kv, write_rows
from kvseal.model.kernels import load_decode_kernel, load_fused_ops, load_native_layers
from kvseal.model.quant import Linear

QUANT_FIELD = {"int8": "q8", "int4": "q4"}  # --weights -> the Linear field of its small steps' packed weights


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(H + 2*KVH) * D, hidden]: q, k, v fused into one matmul
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * inter, hidden]: gate and up fused
    w_down: torch.Tensor
    q_norm: torch.Tensor | None = None  # [head_dim] (qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # on attention's output (sandwich_norms)
    post_mlp_norm: torch.Tensor | None = None  # on the MLP's output (sandwich_norms)
    bo: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied


@dataclass
class LayerLinears:
    """One layer's matmuls with their kernels chosen (``kvseal.model.quant.Linear``)."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


@dataclass
class ForwardBatch:
    """Everything one forward pass needs, packed without padding; built by the runner from page tables."""

    input_ids: torch.Tensor  # [N] decode rows first, then each prefill chunk's rows
    positions: torch.Tensor  # [N]
    write_slots: torch.Tensor  # [N] flat pool slots (page * page_size + offset) each token's K/V go to
    logits_index: torch.Tensor  # [B] each request's last row (every row of a chunk in ``rows``): the logits wanted
    decode: DecodeRows | None  # rows [0, decode.n): one token per request
    spans: list[Span]  # prefill chunks
    rows: list[range] | None = None  # each request's rows of the logits, where some want more than their last


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """Llama's RMSNorm; with ``offset``, Gemma's: scaled by ``1 + weight``, in fp32, then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def rope_tables(cfg: ModelConfig, dtype: torch.dtype, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and a *signed* sin: ``rotate_half(x) * sin == roll(x, D/2) * cat(-sin, sin)``, one op fewer.
    ``local``: the sliding-window layers' RoPE (``cfg.rope_local``)."""
    params = cfg.rope_local if local else cfg.rope
    theta = float(params["rope_theta"]) if local else cfg.rope_theta
    inv, scale = inv_freq(theta, cfg.head_dim, params, cfg.max_context)
    freqs = torch.outer(torch.arange(cfg.max_context, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin() * scale
    half = cfg.head_dim // 2
    return (emb.cos() * scale).to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin``, bit for bit (negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LlamaModel:
    """Stateless apart from weights: the KV lives in the pool passed to ``forward``."""

    def __init__(self, cfg: ModelConfig, weights: Weights, dtype: torch.dtype, mode: str | None = None,
                 release: bool = False, packed: dict[str, torch.Tensor] | None = None) -> None:
        """``mode``: the linear layers' weights (``use_weights``; default bf16, or fp32 for an fp32 model).
        ``release``: keep only what the chosen kernels read (one copy of the weights, see ``use_weights``).
        ``packed``: the GEMM's packed weights by name (``kvseal.model.shared``); ``weights`` then has meta
        tensors for the linear layers."""
        self.packed_given = packed
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.cos, self.sin = rope_tables(cfg, dtype)
        self.local_rope = rope_tables(cfg, dtype, local=True) if cfg.rope_local is not None else None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.shapes = [LayerShape(cfg.window(i), cfg.attn_softcap, cfg.attn_scale or cfg.head_dim**-0.5,
                                  plain=not (cfg.window(i) or cfg.attn_softcap or cfg.attn_scale))
                       for i in range(cfg.num_layers)]
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype) if cfg.embed_scale else None
        self.last_times = (0.0, 0.0)
        self.device = torch.device("cpu")  # to_device moves the model to a GPU
        kernels = cfg.plain  # the native kernels implement plain Llama only
        # the in-place paged decode kernel when it was built (None: the plain PyTorch reference)
        self.decode_kernel = load_decode_kernel(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype) if kernels else None
        # the fused norm / rope+store / silu ops when they were built (None: the plain PyTorch ops)
        self.fused = load_fused_ops(cfg.head_dim, dtype) if kernels else None
        # the whole layer loop in one native call, when every piece of it is native (bf16; fp32 for decode rows)
        self.native = load_native_layers() if dtype in (torch.bfloat16, torch.float32) and kernels else None
        self.use_weights(mode or ("bf16" if dtype == torch.bfloat16 else "fp32"), release=release)

    def to_device(self, device: str | torch.device) -> LlamaModel:
        """Run on ``device`` (a CUDA GPU): the weights move there, the linear layers run ``F.linear``, attention
        the Triton kernels (``kvseal.model.triton_attention``; the plain PyTorch path for the families that
        depart from plain Llama), everything else plain PyTorch; the CPU's native kernels are dropped. Needs
        the unpacked weights: a model loaded without ``release``. Not yet run on a GPU (docs/gpu.md)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        if any(t.is_meta for x in self.w.layers for t in (x.wqkv, x.wo, x.w_gate_up, x.w_down)):
            raise RuntimeError("the weights were released after packing: load the model without release")

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        for layer in self.w.layers:
            for f in fields(layer):
                setattr(layer, f.name, move(getattr(layer, f.name)))
        tied = self.w.lm_head is self.w.embed
        self.w.embed, self.w.norm = move(self.w.embed), move(self.w.norm)
        self.w.lm_head = self.w.embed if tied else move(self.w.lm_head)
        self.cos, self.sin, self.embed_scale = move(self.cos), move(self.sin), move(self.embed_scale)
        if self.local_rope is not None:
            self.local_rope = (move(self.local_rope[0]), move(self.local_rope[1]))
        from kvseal.model.triton_attention import TritonAttention  # triton: a GPU host's, not every CPU's

        self.native = self.fused = None
        self.decode_kernel = TritonAttention() if self.cfg.plain else None
        self.device = device
        self.use_weights(self.weights_mode, self.small_rows)
        return self

    def use_weights(self, mode: str, small_rows: int = 8, release: bool = False) -> None:
        """Pick the linear layers' weights and kernels (``kvseal.model.quant``): fp32 (fp32 models), bf16, or
        int8/int4 for steps of at most ``small_rows`` rows.

        ``release``: a layer whose linear layers all run from a packed copy (the GEMM's) drops its weights
        as soon as they are packed, layer by layer, so the process never holds two copies of the model (a
        weight left as a meta tensor keeps only its shape); ``use_weights`` cannot be called again after."""
        given = self.packed_given
        if given is None and any(t.is_meta for x in self.w.layers for t in (x.wqkv, x.wo, x.w_gate_up, x.w_down)):
            raise RuntimeError("the weights were released after packing: load the model again to change them")
        self.packed_given = None  # used once

        def lin(w: torch.Tensor, b: torch.Tensor | None, name: str) -> Linear:
            return Linear(w, b, mode, small_rows, packed=None if given is None else given[name])

        self.weights_mode, self.small_rows = mode, small_rows
        self.lin = []
        for i, x in enumerate(self.w.layers):
            self.lin.append(LayerLinears(lin(x.wqkv, x.bqkv, f"{i}.qkv.packed"), lin(x.wo, x.bo, f"{i}.o.packed"),
                                         lin(x.w_gate_up, x.b_gate_up, f"{i}.gate_up.packed"),
                                         lin(x.w_down, x.b_down, f"{i}.down.packed")))
            for name, field in (("qkv", "wqkv"), ("o", "wo"), ("gate_up", "w_gate_up"), ("down", "w_down")):
                linear = getattr(self.lin[-1], name)
                if release and linear.release():
                    setattr(x, field, linear.weight)
        self.native_table = self._native_table()
        # the int8/int4 weights of the small steps (QUANT: the layer loop's code for their kernel)
        self.native_table_small = self._native_table(QUANT_FIELD[mode]) if mode in ("int8", "int4") else None
        # the (tied) embedding is not a 4-bit tensor in GGUF files: int4 there costs real accuracy, int8 not
        self.head = Linear(self.w.lm_head, None, "int8" if mode == "int4" else mode, small_rows,
                           packed=None if given is None else given["head.packed"])
        if release and not self.cfg.tie_embeddings and self.head.release():
            self.w.lm_head = self.head.weight

    def _native_table(self, field: str = "packed") -> torch.Tensor | None:
        """Per layer, pointers to its norms and packed weights for ``NativeLayers`` (None: some linear layer
        or norm is not in the native GEMM's form). ``field``: the ``Linear`` attribute holding them (``packed``
        for bf16, ``q8`` and ``q4`` for the int8 and int4 weights of small steps)."""
        if self.native is None or self.fused is None or self.decode_kernel is None:
            return None
        rows = []
        for layer, lin in zip(self.w.layers, self.lin):
            linears = (lin.qkv, lin.o, lin.gate_up, lin.down)
            norms = (layer.attn_norm, layer.mlp_norm)
            if any(getattr(x, field) is None or x.gemm is None for x in linears) or any(
                    not t.is_contiguous() or t.dtype != self.dtype for t in norms):
                return None
            qkv, o, gate_up, down = (getattr(x, field).data_ptr() for x in linears)
            rows.append([layer.attn_norm.data_ptr(), qkv, o, layer.mlp_norm.data_ptr(), gate_up, down])
        return torch.tensor(rows, dtype=torch.int64)

    def _table_for(self, b: ForwardBatch) -> tuple[torch.Tensor | None, str]:
        """The native table a step of ``b``'s rows runs with, and the ``Linear`` field its weights are from:
        int8/int4 modes take their own kernels for steps of at most ``small_rows`` rows."""
        if self.weights_mode == "bf16" or b.input_ids.shape[0] > self.small_rows:
            return self.native_table, "packed"
        return self.native_table_small, QUANT_FIELD.get(self.weights_mode, "packed")

    def _goes_native(self, kv: torch.Tensor, b: ForwardBatch) -> bool:
        """Can this batch run the native layer loop: every op it needs has its kernel, and so do the linear
        layers at this row count (``_table_for``)."""
        cfg, k = self.cfg, self.decode_kernel
        return (self._table_for(b)[0] is not None and self.native is not None and self.fused is not None
                and k is not None and kv.dtype == self.dtype and k.fits(kv)
                and (not b.spans or k.prefill_takes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv)))

    def _layers_native(self, kv: torch.Tensor, b: ForwardBatch, x: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        spans = torch.tensor([[s.start, s.n, s.pos0, s.pages.data_ptr()] for s in b.spans], dtype=torch.int64)
        spans = spans.view(-1, 4)
        assert all(s.pages.dtype == torch.int64 and s.pages.is_contiguous() for s in b.spans)
        times = (ctypes.c_double * 2)()
        d = b.decode
        table, field = self._table_for(b)
        self.native(x, table, self.cfg, self.cfg.head_dim**-0.5, self.cos, self.sin,
                    b.positions.contiguous(), b.write_slots.contiguous(), kv, None if d is None else d.pages.contiguous(),
                    None if d is None else d.lens.contiguous(), spans, times, weights=field)
        return x, times[0], times[1]

    @torch.inference_mode()
    def forward(self, kv: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """Returns fp32 logits [B, vocab] for ``b.logits_index``; writes this step's K/V into ``kv``."""
        x = F.embedding(b.input_ids, self.w.embed)  # [N, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self._goes_native(kv, b):
            x, t_lin, t_att = self._layers_native(kv, b, x)
        else:
            attend = PagedAttention(kv, b.decode, b.spans, self.decode_kernel, self.shapes)
            layers = self._layers if self.fused is None else self._layers_fused
            x, t_lin, t_att = layers(kv, b, x, attend)
        last = x.index_select(0, b.logits_index)
        t0 = time.perf_counter()
        logits = self.head(rms_norm(last, self.w.norm, self.cfg.rms_eps, self.cfg.norm_offset)).float()
        if self.cfg.final_softcap:
            logits = torch.tanh(logits / self.cfg.final_softcap) * self.cfg.final_softcap
        self.last_times = (t_lin + time.perf_counter() - t0, t_att)  # seconds in weight matmuls and in attention
        return logits

    def _layers(self, kv: torch.Tensor, b: ForwardBatch, x: torch.Tensor,
                attend: PagedAttention) -> tuple[torch.Tensor, float, float]:
        """The decoder layers in plain PyTorch ops: the reference for the fused path, and the only path of the
        families that depart from plain Llama. Returns the residual stream, seconds in weight matmuls and in
        attention."""
        cfg = self.cfg
        n = b.input_ids.shape[0]
        heads, kvh, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, off = cfg.rms_eps, cfg.norm_offset
        tables = [(self.cos[b.positions].unsqueeze(1), self.sin[b.positions].unsqueeze(1))]  # [N, 1, D]
        if self.local_rope is not None:
            tables.append((self.local_rope[0][b.positions].unsqueeze(1), self.local_rope[1][b.positions].unsqueeze(1)))
        act = F.silu if cfg.act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
        writes = write_rows(kv, b.write_slots)
        clock, t_lin, t_att = time.perf_counter, 0.0, 0.0
        for i, (layer, lin) in enumerate(zip(self.w.layers, self.lin)):
            cos, sin = tables[1 if len(tables) > 1 and cfg.window(i) else 0]
            h = rms_norm(x, layer.attn_norm, eps, off)
            t0 = clock()
            qkv = lin.qkv(h)
            t_lin += clock() - t0
            qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + kvh, dim)
            if layer.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :heads], layer.q_norm, eps, off),
                                rms_norm(qk[:, heads:], layer.k_norm, eps, off)], dim=1)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(n, kvh, dim)
            scatter_kv(kv, writes, i, 0, k)
            scatter_kv(kv, writes, i, 1, v)
            t0 = clock()
            a = attend(i, q, k, v)
            t1 = clock()
            o = lin.o(a)
            t2 = clock()
            if layer.post_attn_norm is not None:
                o = rms_norm(o, layer.post_attn_norm, eps, off)
            x = x + o
            h = rms_norm(x, layer.mlp_norm, eps, off)
            t3 = clock()
            gate, up = lin.gate_up(h).chunk(2, dim=-1)
            t4 = clock()
            y = act(gate) * up
            t5 = clock()
            y = lin.down(y)
            t_lin += (t2 - t1) + (t4 - t3) + (clock() - t5)
            if layer.post_mlp_norm is not None:
                y = rms_norm(y, layer.post_mlp_norm, eps, off)
            x = x + y
            t_att += t1 - t0
        return x, t_lin, t_att

    def _layers_fused(self, kv: torch.Tensor, b: ForwardBatch, x: torch.Tensor,
                      attend: PagedAttention) -> tuple[torch.Tensor, float, float]:
        """The decoder layers with the fused ops (``kvseal.model.kernels.FusedOps``): a residual add rides
        along with the next norm, RoPE writes keys and values straight to the pool. Returns the residual
        stream, seconds in weight matmuls and in attention."""
        cfg, f = self.cfg, self.fused
        n = b.input_ids.shape[0]
        heads, kvh, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qs, ks = self.q_size, self.q_size + self.kv_size
        clock, t_lin, t_att = time.perf_counter, 0.0, 0.0
        delta = None  # the last layer's output, not yet added to x
        for i, (layer, lin) in enumerate(zip(self.w.layers, self.lin)):
            h = f.add_rms_norm(x, delta, layer.attn_norm, cfg.rms_eps)
            t0 = clock()
            qkv = lin.qkv(h)
            t1 = clock()
            f.rope_store(qkv, heads, kvh, self.cos, self.sin, b.positions, kv, b.write_slots, i)
            t2 = clock()
            a = attend(i, qkv[:, :qs].view(n, heads, dim), qkv[:, qs:ks].view(n, kvh, dim),
                       qkv[:, ks:].view(n, kvh, dim))
            t3 = clock()
            o = lin.o(a)
            t4 = clock()
            h = f.add_rms_norm(x, o, layer.mlp_norm, cfg.rms_eps)
            t5 = clock()
            gate_up = lin.gate_up(h)
            t6 = clock()
            act = f.silu_mul(gate_up)
            t7 = clock()
            delta = lin.down(act)
            t_lin += (t1 - t0) + (t4 - t3) + (t6 - t5) + (clock() - t7)
            t_att += t3 - t2
        return x + delta, t_lin, t_att
