// The decoder layers of one forward in one call: the same kernels, in the same order, as
// kvseal.model.llama.LlamaModel._layers_fused, so the result is bit for bit the same (in bf16 the gate/up GEMM
// and SiLU * up are one kernel here, kvseal_gemm_silu_bf16: the same bits as the two). The Python loop made
// about ten calls per layer (ctypes, tensor allocations, argument checks), 10-15 us each: ~4 ms of a 32-stream
// step and a quarter of a batch-1 step, with one core working and the other waiting. Here the loop runs in
// C++ and only the kernels' own OpenMP regions remain.
//
// Two element types: bf16 (kvseal_layers_bf16) and fp32 (kvseal_layers_f32: the fp32 compute of --dtype auto on
// a CPU without bf16 dot products, weights read as bf16 or int8 by the GEMMs). fp32 prefill chunks need the
// fp32 prefill attention kernel (the AVX2 and AVX-512 levels); at the generic level such steps stay in Python.
#include <chrono>

#include "common.h"

extern "C" {
void kvseal_add_rms_norm_bf16(uint16_t* x, const uint16_t* delta, const uint16_t* weight, uint16_t* out, int64_t n,
                              int64_t hidden, float eps);
void kvseal_add_rms_norm_f32(float* x, const float* delta, const float* weight, float* out, int64_t n,
                             int64_t hidden, float eps);
void kvseal_rope_store_bf16(uint16_t* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads,
                            int64_t dim, const uint16_t* cos, const uint16_t* sin, const int64_t* positions,
                            uint16_t* kv, const int64_t* slots, int64_t layers, int64_t layer, int64_t page_size);
void kvseal_rope_store_f32(float* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float* cos, const float* sin, const int64_t* positions, float* kv,
                           const int64_t* slots, int64_t layers, int64_t layer, int64_t page_size);
void kvseal_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t n, int64_t inter);
void kvseal_silu_mul_f32(const float* gate_up, float* out, int64_t n, int64_t inter);
void kvseal_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k,
                      uint16_t* out);
void kvseal_gemm_f32(const float* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k,
                     float* out);
void kvseal_gemm_q8_bf16(const uint16_t* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k,
                         uint16_t* out);
void kvseal_gemm_q8_f32(const float* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k,
                        float* out);
void kvseal_gemm_q4_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n, int64_t k,
                         uint16_t* out);
void kvseal_gemm_q4_f32(const float* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n, int64_t k,
                        float* out);
int kvseal_gemm_silu_supported(int64_t inter, int64_t k);
void kvseal_gemm_silu_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t inter,
                           int64_t k, uint16_t* out);
void kvseal_decode_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size,
                                  int64_t layers, int64_t layer, float scale);
void kvseal_decode_attention_f32(const float* q, int64_t q_row_stride, const float* kv, float* out,
                                 const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size, int64_t layers,
                                 int64_t layer, float scale);
int kvseal_prefill_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads,
                                  int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale);
int kvseal_prefill_attention_f32(const float* q, int64_t q_row_stride, const float* kv, float* out,
                                 const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads,
                                 int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale);
}

namespace {
// each kernel under one name for both element types
inline void norm(uint16_t* x, const uint16_t* d, const uint16_t* w, uint16_t* o, int64_t n, int64_t h, float e) {
  kvseal_add_rms_norm_bf16(x, d, w, o, n, h, e);
}
inline void norm(float* x, const float* d, const float* w, float* o, int64_t n, int64_t h, float e) {
  kvseal_add_rms_norm_f32(x, d, w, o, n, h, e);
}
template <typename T>
inline void rope(T* qkv, int64_t n, int64_t stride, int64_t heads, int64_t kvh, int64_t dim, const T* cos,
                 const T* sin, const int64_t* pos, T* kv, const int64_t* slots, int64_t layers, int64_t layer,
                 int64_t page) {
  if constexpr (sizeof(T) == 2)
    kvseal_rope_store_bf16(qkv, n, stride, heads, kvh, dim, cos, sin, pos, kv, slots, layers, layer, page);
  else
    kvseal_rope_store_f32(qkv, n, stride, heads, kvh, dim, cos, sin, pos, kv, slots, layers, layer, page);
}
inline void silu_mul(const uint16_t* gu, uint16_t* out, int64_t n, int64_t inter) { kvseal_silu_mul_bf16(gu, out, n, inter); }
inline void silu_mul(const float* gu, float* out, int64_t n, int64_t inter) { kvseal_silu_mul_f32(gu, out, n, inter); }
// quant: 0 bf16 weights (kvseal_gemm_pack_bf16), 1 int8 (kvseal_gemm_pack_q8), 2 int4 (kvseal_gemm_pack_q4)
inline void gemm(const uint16_t* x, int64_t m, int64_t w, int64_t n, int64_t k, uint16_t* out, int64_t quant) {
  if (quant == 1)
    kvseal_gemm_q8_bf16(x, k, m, reinterpret_cast<const int8_t*>(w), n, k, out);
  else if (quant == 2)
    kvseal_gemm_q4_bf16(x, k, m, reinterpret_cast<const uint8_t*>(w), n, k, out);
  else
    kvseal_gemm_bf16(x, k, m, reinterpret_cast<const uint16_t*>(w), n, k, out);
}
inline void gemm(const float* x, int64_t m, int64_t w, int64_t n, int64_t k, float* out, int64_t quant) {
  if (quant == 1)
    kvseal_gemm_q8_f32(x, k, m, reinterpret_cast<const int8_t*>(w), n, k, out);
  else if (quant == 2)
    kvseal_gemm_q4_f32(x, k, m, reinterpret_cast<const uint8_t*>(w), n, k, out);
  else
    kvseal_gemm_f32(x, k, m, reinterpret_cast<const uint16_t*>(w), n, k, out);
}
template <typename T>
inline void decode(const T* q, int64_t stride, const T* kv, T* out, const int64_t* pages, const int64_t* lens,
                   int64_t batch, int64_t width, int64_t heads, int64_t kvh, int64_t dim, int64_t page,
                   int64_t layers, int64_t layer, float scale) {
  if constexpr (sizeof(T) == 2)
    kvseal_decode_attention_bf16(q, stride, kv, out, pages, lens, batch, width, heads, kvh, dim, page, layers,
                                 layer, scale);
  else
    kvseal_decode_attention_f32(q, stride, kv, out, pages, lens, batch, width, heads, kvh, dim, page, layers,
                                layer, scale);
}
template <typename T>
inline int prefill(const T* q, int64_t stride, const T* kv, T* out, const int64_t* pages, int64_t n, int64_t pos0,
                   int64_t heads, int64_t kvh, int64_t dim, int64_t page, int64_t layers, int64_t layer,
                   float scale) {
  if constexpr (sizeof(T) == 2)
    return kvseal_prefill_attention_bf16(q, stride, kv, out, pages, n, pos0, heads, kvh, dim, page, layers, layer,
                                         scale);
  else
    return kvseal_prefill_attention_f32(q, stride, kv, out, pages, n, pos0, heads, kvh, dim, page, layers, layer,
                                        scale);
}

template <typename T>
int layers_loop(T* x, int64_t n, const int64_t* weights, int64_t quant, int64_t layers, int64_t hidden, int64_t heads,
                int64_t kv_heads, int64_t dim, int64_t inter, float eps, float scale, const T* cos, const T* sin,
                const int64_t* positions, const int64_t* slots, T* kv, int64_t page_size, int64_t n_dec,
                const int64_t* dec_pages, const int64_t* dec_lens, int64_t dec_width, int64_t n_spans,
                const int64_t* spans, T* h, T* qkv, T* a, T* o, T* gu, T* act, double* times) {
  using clock = std::chrono::steady_clock;
  const int64_t qkv_w = (heads + 2 * kv_heads) * dim, q_w = heads * dim;
  double t_lin = 0, t_att = 0;
  auto secs = [](clock::time_point a0, clock::time_point a1) { return std::chrono::duration<double>(a1 - a0).count(); };
  const T* delta = nullptr;  // the last layer's output, not yet added to x
  const bool fuse_silu = sizeof(T) == 2 && !quant && kvseal_gemm_silu_supported(inter, hidden) != 0;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t* w = weights + 6 * i;
    const T* attn_norm = reinterpret_cast<const T*>(w[0]);
    const T* mlp_norm = reinterpret_cast<const T*>(w[3]);
    norm(x, delta, attn_norm, h, n, hidden, eps);
    auto t0 = clock::now();
    gemm(h, n, w[1], qkv_w, hidden, qkv, quant);
    auto t1 = clock::now();
    rope(qkv, n, qkv_w, heads, kv_heads, dim, cos, sin, positions, kv, slots, layers, i, page_size);
    auto t2 = clock::now();
    if (n_dec > 0)
      decode(qkv, qkv_w, kv, a, dec_pages, dec_lens, n_dec, dec_width, heads, kv_heads, dim, page_size, layers, i,
             scale);
    for (int64_t s = 0; s < n_spans; ++s) {
      const int64_t* sp = spans + 4 * s;
      if (!prefill(qkv + sp[0] * qkv_w, qkv_w, kv, a + sp[0] * q_w, reinterpret_cast<const int64_t*>(sp[3]), sp[1],
                   sp[2], heads, kv_heads, dim, page_size, layers, i, scale))
        return 0;
    }
    auto t3 = clock::now();
    gemm(a, n, w[2], hidden, q_w, o, quant);
    auto t4 = clock::now();
    norm(x, o, mlp_norm, h, n, hidden, eps);
    auto t5 = clock::now();
    if (fuse_silu) {  // the same values as the two calls below, without the [n, 2 inter] product in memory
      if constexpr (sizeof(T) == 2)
        kvseal_gemm_silu_bf16(h, hidden, n, reinterpret_cast<const uint16_t*>(w[4]), inter, hidden, act);
    } else {
      gemm(h, n, w[4], 2 * inter, hidden, gu, quant);
      silu_mul(gu, act, n, inter);
    }
    gemm(act, n, w[5], hidden, inter, o, quant);
    t_lin += secs(t0, t1) + secs(t3, t4) + secs(t5, clock::now());
    t_att += secs(t2, t3);
    delta = o;
  }
  if (delta != nullptr) {  // x + delta, rounded as PyTorch's add of this dtype rounds
    for (int64_t j = 0; j < n * hidden; ++j) kvseal::from_f32(kvseal::to_f32(x[j]) + kvseal::to_f32(delta[j]), x + j);
  }
  times[0] += t_lin;
  times[1] += t_att;
  return 1;
}
}  // namespace

extern "C" {

// x [n, hidden]: the embedded tokens in, the residual stream after the last layer out (the last layer's
// output added). weights [layers][6]: pointers to attn_norm, packed qkv, packed o, mlp_norm, packed gate_up,
// packed down. Decode rows are rows [0, n_dec) with page tables dec_pages [n_dec, dec_width] and lengths
// dec_lens; spans [n_spans][4] = (first row, rows, first position, pointer to the page table) are prefill
// chunks. Scratch: h, o [n, hidden], qkv [n, (heads + 2 kv_heads) dim], a [n, heads dim], gu [n, 2 inter],
// act [n, inter]. times[0] += seconds in the GEMMs, times[1] += seconds in attention. Returns 0 if a prefill
// chunk's shape is not taken by the kernel (the caller checks first; nothing is then trustworthy).
// quant: the four weights are bf16 (0), int8 (1, packed by kvseal_gemm_pack_q8) or int4 (2, kvseal_gemm_pack_q4):
// --weights int8/int4 on a small step, where SiLU * up runs after the gate/up GEMM instead of in its epilogue.
int kvseal_layers_bf16(uint16_t* x, int64_t n, const int64_t* weights, int64_t quant, int64_t layers, int64_t hidden,
                       int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, float eps, float scale,
                       const uint16_t* cos, const uint16_t* sin, const int64_t* positions, const int64_t* slots,
                       uint16_t* kv, int64_t page_size, int64_t n_dec, const int64_t* dec_pages,
                       const int64_t* dec_lens, int64_t dec_width, int64_t n_spans, const int64_t* spans,
                       uint16_t* h, uint16_t* qkv, uint16_t* a, uint16_t* o, uint16_t* gu, uint16_t* act,
                       double* times) {
  return layers_loop(x, n, weights, quant, layers, hidden, heads, kv_heads, dim, inter, eps, scale, cos, sin, positions,
                     slots, kv, page_size, n_dec, dec_pages, dec_lens, dec_width, n_spans, spans, h, qkv, a, o, gu,
                     act, times);
}

// the same in fp32 (weights: bf16 packed by kvseal_gemm_pack_bf16, or int8/int4 as above); decode rows only
int kvseal_layers_f32(float* x, int64_t n, const int64_t* weights, int64_t quant, int64_t layers, int64_t hidden,
                      int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, float eps, float scale,
                      const float* cos, const float* sin, const int64_t* positions, const int64_t* slots, float* kv,
                      int64_t page_size, int64_t n_dec, const int64_t* dec_pages, const int64_t* dec_lens,
                      int64_t dec_width, int64_t n_spans, const int64_t* spans, float* h, float* qkv, float* a,
                      float* o, float* gu, float* act, double* times) {
  return layers_loop(x, n, weights, quant, layers, hidden, heads, kv_heads, dim, inter, eps, scale, cos, sin, positions,
                     slots, kv, page_size, n_dec, dec_pages, dec_lens, dec_width, n_spans, spans, h, qkv, a, o, gu,
                     act, times);
}

}  // extern "C"
