// The decoder layers of one forward in one call: the same kernels, in the same order, as
// kvseal.model.llama.LlamaModel._layers_fused, so the result is bit for bit the same (the gate/up GEMM and
// SiLU * up are one kernel here, kvseal_gemm_silu_bf16: the same bits as the two). The Python loop made
// about ten calls per layer (ctypes, tensor allocations, argument checks), 10-15 us each: ~4 ms of a 32-stream
// step and a quarter of a batch-1 step, with one core working and the other waiting. Here the loop runs in
// C++ and only the kernels' own OpenMP regions remain.
#include <chrono>

#include "common.h"

extern "C" {
void kvseal_add_rms_norm_bf16(uint16_t* x, const uint16_t* delta, const uint16_t* weight, uint16_t* out, int64_t n,
                              int64_t hidden, float eps);
void kvseal_rope_store_bf16(uint16_t* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads,
                            int64_t dim, const uint16_t* cos, const uint16_t* sin, const int64_t* positions,
                            uint16_t* kv, const int64_t* slots, int64_t layers, int64_t layer, int64_t page_size);
void kvseal_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t n, int64_t inter);
void kvseal_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k,
                      uint16_t* out);
void kvseal_gemm_q8_bf16(const uint16_t* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k,
                         uint16_t* out);
int kvseal_gemm_silu_supported(int64_t inter, int64_t k);
void kvseal_gemm_silu_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t inter,
                           int64_t k, uint16_t* out);
void kvseal_decode_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size,
                                  int64_t layers, int64_t layer, float scale);
int kvseal_prefill_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads,
                                  int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale);

// x [n, hidden]: the embedded tokens in, the residual stream after the last layer out (the last layer's
// output added). weights [layers][6]: pointers to attn_norm, packed qkv, packed o, mlp_norm, packed gate_up,
// packed down. Decode rows are rows [0, n_dec) with page tables dec_pages [n_dec, dec_width] and lengths
// dec_lens; spans [n_spans][4] = (first row, rows, first position, pointer to the page table) are prefill
// chunks. Scratch: h, o [n, hidden], qkv [n, (heads + 2 kv_heads) dim], a [n, heads dim], gu [n, 2 inter],
// act [n, inter]. times[0] += seconds in the GEMMs, times[1] += seconds in attention. Returns 0 if a prefill
// chunk's shape is not taken by the kernel (the caller checks first; nothing is then trustworthy).
// q8: the four weights are int8, packed by kvseal_gemm_pack_q8 (--weights int8 on a small step), and SiLU * up
// runs after the gate/up GEMM instead of in its epilogue.
int kvseal_layers_bf16(uint16_t* x, int64_t n, const int64_t* weights, int64_t q8, int64_t layers, int64_t hidden,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, float eps, float scale,
                       const uint16_t* cos, const uint16_t* sin, const int64_t* positions, const int64_t* slots,
                       uint16_t* kv, int64_t page_size, int64_t n_dec, const int64_t* dec_pages,
                       const int64_t* dec_lens, int64_t dec_width, int64_t n_spans, const int64_t* spans,
                       uint16_t* h, uint16_t* qkv, uint16_t* a, uint16_t* o, uint16_t* gu, uint16_t* act,
                       double* times) {
  using clock = std::chrono::steady_clock;
  const int64_t qkv_w = (heads + 2 * kv_heads) * dim, q_w = heads * dim;
  double t_lin = 0, t_att = 0;
  auto secs = [](clock::time_point a0, clock::time_point a1) { return std::chrono::duration<double>(a1 - a0).count(); };
  const uint16_t* delta = nullptr;  // the last layer's output, not yet added to x
  const bool fuse_silu = !q8 && kvseal_gemm_silu_supported(inter, hidden) != 0;
  auto linear = [q8](const uint16_t* in, int64_t m, int64_t w, int64_t n_out, int64_t k, uint16_t* out) {
    if (q8)
      kvseal_gemm_q8_bf16(in, k, m, reinterpret_cast<const int8_t*>(w), n_out, k, out);
    else
      kvseal_gemm_bf16(in, k, m, reinterpret_cast<const uint16_t*>(w), n_out, k, out);
  };
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t* w = weights + 6 * i;
    const auto* attn_norm = reinterpret_cast<const uint16_t*>(w[0]);
    const auto* mlp_norm = reinterpret_cast<const uint16_t*>(w[3]);
    kvseal_add_rms_norm_bf16(x, delta, attn_norm, h, n, hidden, eps);
    auto t0 = clock::now();
    linear(h, n, w[1], qkv_w, hidden, qkv);
    auto t1 = clock::now();
    kvseal_rope_store_bf16(qkv, n, qkv_w, heads, kv_heads, dim, cos, sin, positions, kv, slots, layers, i, page_size);
    auto t2 = clock::now();
    if (n_dec > 0)
      kvseal_decode_attention_bf16(qkv, qkv_w, kv, a, dec_pages, dec_lens, n_dec, dec_width, heads, kv_heads, dim,
                                   page_size, layers, i, scale);
    for (int64_t s = 0; s < n_spans; ++s) {
      const int64_t* sp = spans + 4 * s;
      if (!kvseal_prefill_attention_bf16(qkv + sp[0] * qkv_w, qkv_w, kv, a + sp[0] * q_w,
                                         reinterpret_cast<const int64_t*>(sp[3]), sp[1], sp[2], heads, kv_heads, dim,
                                         page_size, layers, i, scale))
        return 0;
    }
    auto t3 = clock::now();
    linear(a, n, w[2], hidden, q_w, o);
    auto t4 = clock::now();
    kvseal_add_rms_norm_bf16(x, o, mlp_norm, h, n, hidden, eps);
    auto t5 = clock::now();
    if (fuse_silu) {  // the same values as the two calls below, without the [n, 2 inter] product in memory
      kvseal_gemm_silu_bf16(h, hidden, n, reinterpret_cast<const uint16_t*>(w[4]), inter, hidden, act);
    } else {
      linear(h, n, w[4], 2 * inter, hidden, gu);
      kvseal_silu_mul_bf16(gu, act, n, inter);
    }
    linear(act, n, w[5], hidden, inter, o);
    t_lin += secs(t0, t1) + secs(t3, t4) + secs(t5, clock::now());
    t_att += secs(t2, t3);
    delta = o;
  }
  if (delta != nullptr) {  // x + delta, rounded as PyTorch's bf16 add rounds
    for (int64_t j = 0; j < n * hidden; ++j) kvseal::from_f32(kvseal::to_f32(x[j]) + kvseal::to_f32(delta[j]), x + j);
  }
  times[0] += t_lin;
  times[1] += t_att;
  return 1;
}

}  // extern "C"
