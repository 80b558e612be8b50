// Paged decode attention that reads K/V in place from kvseal's page-major pool (no gather copy).
//
// Pool layout kv[page, layer, 0|1, kv_head, slot, head_dim]; one query token per request; grouped-query
// heads (H = G * KVH). One (request, kv_head) pair is one task: its G queries walk the request's pages in
// order with an online softmax, in fp32, and the result is rounded once to the pool's dtype. The plain
// PyTorch reference is kvseal.model.attention.decode_attention; tests/test_kernels.py holds the two equal.
//
// A C ABI, loaded with ctypes: no Python or PyTorch headers, so it builds in a second with any g++.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even, as torch does (NaN kept NaN)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<uint16_t>(u >> 16);
}

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const uint16_t* src, float* dst, int64_t n) {
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
}

constexpr int kMaxGroup = 16;
constexpr int kMaxDim = 256;
constexpr int kMaxPage = 128;

template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, const T* kv, T* out, const int64_t* pages,
                      const int64_t* lens, int64_t batch, int64_t max_pages, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = page_size * dim;                  // one head's keys (or values) in one page
  const int64_t page_stride = layers * 2 * kv_heads * row;
  const int64_t layer_off = layer * 2 * kv_heads * row;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < batch * kv_heads; ++task) {
    const int64_t b = task / kv_heads, h = task % kv_heads;
    float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], m[kMaxGroup], l[kMaxGroup];
    float s[kMaxGroup][kMaxPage];
    alignas(64) float kf[kMaxPage * kMaxDim], vf[kMaxPage * kMaxDim];
    for (int64_t g = 0; g < group; ++g) {
      const T* qp = q + b * q_row_stride + (h * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        qf[g][d] = to_f32(qp[d]) * scale;
        acc[g][d] = 0.f;
      }
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    const int64_t len = lens[b];
    for (int64_t p = 0; p * page_size < len; ++p) {
      const int64_t n = len - p * page_size < page_size ? len - p * page_size : page_size;
      const T* kp = kv + pages[b * max_pages + p] * page_stride + layer_off + h * row;
      const T* vp = kp + kv_heads * row;
      widen(kp, kf, n * dim);  // one page's keys, then values, as fp32: the loops below vectorize
      widen(vp, vf, n * dim);
      for (int64_t g = 0; g < group; ++g) {
        float mx = m[g];
        for (int64_t t = 0; t < n; ++t) {
          const float* k = kf + t * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qf[g][d] * k[d];
          s[g][t] = dot;
          mx = dot > mx ? dot : mx;
        }
        const float corr = std::exp(m[g] - mx);
        m[g] = mx;
        l[g] *= corr;
        float* a = acc[g];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
        for (int64_t t = 0; t < n; ++t) {
          const float w = std::exp(s[g][t] - mx);
          l[g] += w;
          const float* v = vf + t * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      T* op = out + (b * heads + h * group + g) * dim;
      const float inv = 1.f / l[g];
      for (int64_t d = 0; d < dim; ++d) from_f32(acc[g][d] * inv, op + d);
    }
  }
}

}  // namespace

extern "C" {

int kvseal_decode_limits(int64_t* group, int64_t* dim, int64_t* page) {
  *group = kMaxGroup;
  *dim = kMaxDim;
  *page = kMaxPage;
  return 1;
}

void kvseal_decode_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size,
                                  int64_t layers, int64_t layer, float scale) {
  decode_attention(q, q_row_stride, kv, out, pages, lens, batch, max_pages, heads, kv_heads, dim, page_size,
                   layers, layer, scale);
}

void kvseal_decode_attention_f32(const float* q, int64_t q_row_stride, const float* kv, float* out,
                                 const int64_t* pages, const int64_t* lens, int64_t batch, int64_t max_pages,
                                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size, int64_t layers,
                                 int64_t layer, float scale) {
  decode_attention(q, q_row_stride, kv, out, pages, lens, batch, max_pages, heads, kv_heads, dim, page_size,
                   layers, layer, scale);
}

}  // extern "C"
