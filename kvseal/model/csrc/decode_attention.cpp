// Paged decode attention that reads K/V in place from kvseal's page-major pool (no gather copy).
//
// Pool layout kv[page, layer, 0|1, kv_head, slot, head_dim]; one query token per request; grouped-query
// heads (H = G * KVH). One (request, kv_head) pair is one task (an fp32 pool's long context: one task per span
// of its pages, merged after; see kSpanTokens): its G queries walk the pages in order with an online softmax,
// in fp32, and the result is rounded once to the pool's dtype. The plain
// PyTorch reference is kvseal.model.attention.decode_attention; tests/test_kernels.py holds the two equal.
//
// A C ABI, loaded with ctypes: no Python or PyTorch headers, so it builds in a second with any g++.
#include <algorithm>
#include <vector>

#include "common.h"

namespace {
using namespace kvseal;

// n elements of the pool as fp32: an fp32 pool's in place, a bf16 pool's widened into buf
inline const float* kp_f32(const float* src, float*, int64_t) { return src; }
inline const float* kp_f32(const uint16_t* src, float* buf, int64_t n) {
  uint32_t* d = reinterpret_cast<uint32_t*>(buf);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(src[i]) << 16;
  return buf;
}

constexpr int kMaxGroup = 16;
constexpr int kMaxDim = 256;
constexpr int kMaxPage = 128;

// A context over kSpanTokens is split into spans of near-equal whole pages, at most kSpanTokens each, one task
// each, merged after by their maxima (as flash-decoding does): one stream's few (row, kv head) tasks then fill
// the cores. Where the spans fall depends on the row's own length alone, so a row's result does not depend on
// what shares its step. Measured on a Zen 3 (2 cores, AVX2; SmolLM2's heads, 30 layers): one row of 512 / 900
// tokens 1.89 -> 1.48 / 3.74 -> 3.04 ms; in an engine, a one-stream decode step at ~900 tokens 16.6 -> 16.1 ms
// (medians of 4 interleaved runs); 32 rows of ~900 tokens 151.8 -> 149.2 ms a step (2 runs each: no loss).
// fp32 pools only: the bf16 fast path (AVX-512 BF16) runs each (row, kv head) whole, as it did; a split there
// is unmeasured (this was written on a CPU without it).
constexpr int64_t kSpanTokens = 256;

// a span's G accumulators (unnormalised; query g's at acc + g * acc_stride), maxima and sums, as split_merge
// reads them: part[G * D + 2 * G]
inline void leave_part(const float* acc, int64_t acc_stride, const float* m, const float* l, int64_t group,
                       int64_t dim, float* part) {
  for (int64_t g = 0; g < group; ++g) std::memcpy(part + g * dim, acc + g * acc_stride, sizeof(float) * dim);
  std::memcpy(part + group * dim, m, sizeof(float) * group);
  std::memcpy(part + group * dim + group, l, sizeof(float) * group);
}

// out[g] = the softmax-weighted sum over all n spans: each span's sums scaled by exp(its max - the max)
inline void split_merge(const float* parts, int64_t n, int64_t group, int64_t dim, float* out) {
  const int64_t stride = group * dim + 2 * group;
  for (int64_t g = 0; g < group; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < n; ++s) mx = std::max(mx, parts[s * stride + group * dim + g]);
    float l = 0.f;
    float* o = out + g * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = 0.f;
    for (int64_t s = 0; s < n; ++s) {
      const float* p = parts + s * stride;
      const float w = std::exp(p[group * dim + g] - mx);
      l += p[group * dim + group + g] * w;
      const float* a = p + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) o[d] += a[d] * w;
    }
    const float inv = 1.f / l;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

// The bf16 fast path for 16-slot pages (AVX-512 BF16): a page's 16 keys are turned into 4 x 4 columns of
// bf16 pairs (two rounds of unpacks), so one vdpbf16ps scores 4 keys against 4 query pairs, and the 16
// scores come out as one vector (no horizontal sum per key). bf16 x bf16 products are exact in fp32 and the
// sums are fp32, as in the reference's matmul. Values are widened once per page and shared by the group's G
// queries, whose accumulators stay in registers. The next page is prefetched while this one is scored.
#if defined(__AVX512BF16__)
using FastTask = void (*)(const uint16_t* q, const uint16_t* kv, const int64_t* pages, int64_t len,
                          int64_t page_stride, int64_t head_off, int64_t v_off, float scale, uint16_t* out);

constexpr int AHEAD = 2;  // pages prefetched ahead

template <int G, int C>  // G queries per kv head, C = head_dim / 32
void fast_task(const uint16_t* q, const uint16_t* kv, const int64_t* pages, int64_t len, int64_t page_stride,
               int64_t head_off, int64_t v_off, float scale, uint16_t* out) {
  constexpr int D = 32 * C, NV = D / 16, P = 16;
  // qv[g][c][k], lane (L, r): the query pair (dword) 4L + k of chunk c, as the key columns are laid out below
  __m512i qv[G][C][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) {
      const __m512i qd = _mm512_loadu_si512(q + g * D + 32 * c);
      for (int k = 0; k < 4; ++k) {
        const __m512i idx = _mm512_set_epi32(12 + k, 12 + k, 12 + k, 12 + k, 8 + k, 8 + k, 8 + k, 8 + k, 4 + k,
                                             4 + k, 4 + k, 4 + k, k, k, k, k);
        qv[g][c][k] = _mm512_permutexvar_epi32(idx, qd);
      }
    }
  __m512 acc[G][NV];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_setzero_ps();
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  alignas(64) float pw[G][P];
  for (int64_t p = 0; p < AHEAD - 1 && (p + 1) * P < len; ++p) {  // the pages before the first prefetched one
    const char* nk = reinterpret_cast<const char*>(kv + pages[p + 1] * page_stride + head_off);
    for (int i = 0; i < P * D * 2; i += 64) {
      _mm_prefetch(nk + i, _MM_HINT_T1);
      _mm_prefetch(nk + v_off * 2 + i, _MM_HINT_T1);
    }
  }
  for (int64_t p = 0; p * P < len; ++p) {
    const int n = len - p * P < P ? static_cast<int>(len - p * P) : P;
    const uint16_t* kp = kv + pages[p] * page_stride + head_off;
    const uint16_t* vp = kp + v_off;
    if ((p + AHEAD) * P < len) {
      const char* nk = reinterpret_cast<const char*>(kv + pages[p + AHEAD] * page_stride + head_off);
      for (int i = 0; i < P * D * 2; i += 64) {
        _mm_prefetch(nk + i, _MM_HINT_T1);
        _mm_prefetch(nk + v_off * 2 + i, _MM_HINT_T1);
      }
    }
    // keys: u[c][i][k] lane (L, r) = key 4i + r, dword 4L + k of chunk c (slots >= n hold whatever the page
    // holds; their scores are masked below and their values never read)
    __m512i u[C][4][4];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 4; ++i) {
        const __m512i r0 = _mm512_loadu_si512(kp + (4 * i + 0) * D + 32 * c);
        const __m512i r1 = _mm512_loadu_si512(kp + (4 * i + 1) * D + 32 * c);
        const __m512i r2 = _mm512_loadu_si512(kp + (4 * i + 2) * D + 32 * c);
        const __m512i r3 = _mm512_loadu_si512(kp + (4 * i + 3) * D + 32 * c);
        const __m512i t0 = _mm512_unpacklo_epi32(r0, r1), t1 = _mm512_unpackhi_epi32(r0, r1);
        const __m512i t2 = _mm512_unpacklo_epi32(r2, r3), t3 = _mm512_unpackhi_epi32(r2, r3);
        u[c][i][0] = _mm512_unpacklo_epi64(t0, t2);
        u[c][i][1] = _mm512_unpackhi_epi64(t0, t2);
        u[c][i][2] = _mm512_unpacklo_epi64(t1, t3);
        u[c][i][3] = _mm512_unpackhi_epi64(t1, t3);
      }
    const __mmask16 live = n == P ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 a[4];
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c)
          for (int k = 0; k < 4; ++k)
            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)u[c][i][k], (__m512bh)qv[g][c][k]);
      }
      // lane (L, r) of a[i] holds a quarter of key 4i + r's score: sum the quarters, keys in lane order
      const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
      const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
      __m512 sc = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
      sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
      const float page_max = _mm512_reduce_max_ps(sc);
      const float mx = page_max > m[g] ? page_max : m[g];
      const __m512 pr = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
      const float corr = std::exp(m[g] - mx);
      m[g] = mx;
      l[g] = l[g] * corr + _mm512_reduce_add_ps(pr);
      const __m512 cv = _mm512_set1_ps(corr);
      for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], cv);
      _mm512_store_ps(pw[g], pr);
    }
    for (int t = 0; t < n; ++t)
      for (int v = 0; v < NV; ++v) {
        const __m512 vv = widen16(vp + t * D + 16 * v);
        for (int g = 0; g < G; ++g) acc[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(pw[g][t]), vv, acc[g][v]);
      }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / l[g]);
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * D + 16 * v),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][v], inv)));
  }
}

inline FastTask fast_path(const uint16_t*, int64_t group, int64_t dim, int64_t page_size) {
  return for_shape<FastTask>(group, dim, page_size, [](auto g, auto d) {
    return &fast_task<decltype(g)::value, decltype(d)::value / 32>;
  });
}
#else
using FastTask = void (*)(const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          float, uint16_t*);
inline FastTask fast_path(const uint16_t*, int64_t, int64_t, int64_t) { return nullptr; }
#endif

// The fp32 fast path for 16-slot pages (AVX2 and up: the fp32 compute of --dtype auto on CPUs without bf16
// dot products). The portable loop sums each key's dot product across the lanes on its own; here a query
// takes 8 keys at a time into 8 partial-sum vectors, and one tree of horizontal adds turns them into the 8
// scores, in key order. Each query (its G queries share the page, read from L1) keeps its accumulator chunk
// in registers while it walks the page's values. q is scaled first, as in the portable loop. Measured on a
// Zen 4 held to AVX2 (30 layers of SmolLM2's heads): one row of 190 tokens 0.90 -> 0.55 ms, 32 rows of 192
// 24.9 -> 21.8 ms; there both paths wait on memory (software prefetch of the next pages, as the bf16 path
// does, measured no faster).
// part: nullptr, or where a task over one span of a split context leaves its unnormalised sums (split_merge)
using FastTaskF32 = void (*)(const float* q, const float* kv, const int64_t* pages, int64_t len,
                             int64_t page_stride, int64_t head_off, int64_t v_off, float scale, float* out,
                             float* part);
#if defined(__AVX2__)
inline __m256 hsum8x8(const __m256 v[8]) {  // lane t = the sum of v[t]'s lanes
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

template <int G, int NV>  // G queries per kv head, NV = head_dim / 8
void fast_task_f32(const float* q, const float* kv, const int64_t* pages, int64_t len, int64_t page_stride,
                   int64_t head_off, int64_t v_off, float scale, float* out, float* part) {
  constexpr int D = 8 * NV, P = 16, CH = NV < 8 ? NV : 8;  // CH: accumulator vectors in registers at a time
  alignas(32) float qs[G][D], acc[G][D], pw[P];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d) {
      qs[g][d] = q[g * D + d] * scale;
      acc[g][d] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int64_t p = 0; p * P < len; ++p) {
    const int n = len - p * P < P ? static_cast<int>(len - p * P) : P;
    const float* kp = kv + pages[p] * page_stride + head_off;
    const float* vp = kp + v_off;
    for (int g = 0; g < G; ++g) {
      alignas(32) float sc[P];
      for (int h = 0; h < P / 8; ++h) {
        __m256 part[8];
        for (int t = 0; t < 8; ++t) part[t] = _mm256_setzero_ps();
        for (int c = 0; c < NV; ++c) {
          const __m256 qv = _mm256_load_ps(qs[g] + 8 * c);
          for (int t = 0; t < 8; ++t)
            part[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + (8 * h + t) * D + 8 * c), part[t]);
        }
        _mm256_store_ps(sc + 8 * h, hsum8x8(part));
      }
      float mx = m[g];
      for (int t = 0; t < n; ++t) mx = sc[t] > mx ? sc[t] : mx;
      const float corr = std::exp(m[g] - mx);
      m[g] = mx;
      float sum = 0.f;
      for (int h = 0; h < P / 8; ++h) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(sc + 8 * h), _mm256_set1_ps(mx)));
        _mm256_store_ps(pw + 8 * h, e);
      }
      for (int t = 0; t < n; ++t) sum += pw[t];
      l[g] = l[g] * corr + sum;
      for (int c0 = 0; c0 < NV; c0 += CH) {
        __m256 a[CH];
        const __m256 cv = _mm256_set1_ps(corr);
        for (int c = 0; c < CH; ++c) a[c] = _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * (c0 + c)), cv);
        for (int t = 0; t < n; ++t) {  // slots >= n: their values are never read
          const __m256 w = _mm256_set1_ps(pw[t]);
          for (int c = 0; c < CH; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + t * D + 8 * (c0 + c)), a[c]);
        }
        for (int c = 0; c < CH; ++c) _mm256_store_ps(acc[g] + 8 * (c0 + c), a[c]);
      }
    }
  }
  if (part != nullptr) {
    leave_part(&acc[0][0], D, m, l, G, D, part);
    return;
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
  }
}

inline FastTaskF32 fast_path(const float*, int64_t group, int64_t dim, int64_t page_size) {
  return for_shape<FastTaskF32>(group, dim, page_size, [](auto g, auto d) {
    return &fast_task_f32<decltype(g)::value, decltype(d)::value / 8>;
  });
}
#else
inline FastTaskF32 fast_path(const float*, int64_t, int64_t, int64_t) { return nullptr; }
#endif

// One (row, kv head) task over len tokens of the given pages, the portable loop: the final output, or with
// part the span's sums for split_merge
template <typename T>
void portable_task(const T* q, const T* kv, const int64_t* pages, int64_t len, int64_t group, int64_t dim,
                   int64_t page_size, int64_t page_stride, int64_t head_off, int64_t v_off, float scale, T* out,
                   float* part) {
  float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], m[kMaxGroup], l[kMaxGroup];
  float s[kMaxGroup][kMaxPage];
  alignas(64) float kbuf[kMaxPage * kMaxDim], vbuf[kMaxPage * kMaxDim];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) {
      qf[g][d] = to_f32(q[g * dim + d]) * scale;
      acc[g][d] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int64_t p = 0; p * page_size < len; ++p) {
    const int64_t n = len - p * page_size < page_size ? len - p * page_size : page_size;
    const T* kp = kv + pages[p] * page_stride + head_off;
    const T* vp = kp + v_off;
    // one page's keys, then values, as fp32 (an fp32 pool's are read where they are): the loops below vectorize
    const float* kf = kp_f32(kp, kbuf, n * dim);
    const float* vf = kp_f32(vp, vbuf, n * dim);
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
      exp_shifted(s[g], n, mx);  // s[g][t] = exp(s[g][t] - mx), vectorized
      float* a = acc[g];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) sum += s[g][t];
      l[g] = l[g] * corr + sum;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
      for (int64_t t = 0; t < n; ++t) {
        const float w = s[g][t];
        const float* v = vf + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
      }
    }
  }
  if (part != nullptr) {
    leave_part(&acc[0][0], kMaxDim, m, l, group, dim, part);
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < dim; ++d) from_f32(acc[g][d] * inv, out + g * dim + d);
  }
}

template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, const T* kv, T* out, const int64_t* pages,
                      const int64_t* lens, int64_t batch, int64_t max_pages, int64_t heads, int64_t kv_heads,
                      int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = page_size * dim;                  // one head's keys (or values) in one page
  const int64_t page_stride = layers * 2 * kv_heads * row;
  const int64_t layer_off = layer * 2 * kv_heads * row;
  const auto fast = fast_path(q, group, dim, page_size);
  // spans: row b's tasks are first[b] .. first[b + 1], kv head by kv head, each head's spans in order
  const int64_t span_pages = sizeof(T) == 4 ? std::max<int64_t>(1, kSpanTokens / page_size)
                                             : std::max<int64_t>(1, max_pages);
  const auto n_pages = [&](int64_t b) { return (lens[b] + page_size - 1) / page_size; };
  // (the caller's buffers, grown and never cleared: every span writes its part whole; the team reads them
  // through the pointers, as a thread_local names each thread's own)
  thread_local std::vector<int64_t> first_buf;
  thread_local std::vector<float> parts_buf;
  first_buf.assign(batch + 1, 0);
  int64_t* first = first_buf.data();
  for (int64_t b = 0; b < batch; ++b)
    first[b + 1] = first[b] + kv_heads * std::max<int64_t>(1, (n_pages(b) + span_pages - 1) / span_pages);
  const int64_t tasks = first[batch];
  const int64_t part_stride = group * dim + 2 * group;
  const bool split = tasks > batch * kv_heads;
  if (split && parts_buf.size() < static_cast<size_t>(tasks * part_stride)) parts_buf.resize(tasks * part_stride);
  float* parts = parts_buf.data();
  // One stream's few tasks: the native layer loop calls this right after the QKV GEMM, while the team still
  // spins, so handing them out costs no wake-up. Served at one stream (Zen 4, interleaved): an fp32 pool
  // gains at every length (128 -> 128 tokens: 78 -> 81 tok/s; 850 -> 128: 37.8 -> 41.7); a bf16 pool's pages
  // are half the work, and it gains from ~128 pages of tasks (850 -> 128: 57 -> 59) but lost 4% below.
  const bool wide = tasks > 1 && (sizeof(T) == 4 || tasks * max_pages >= 128);
#pragma omp parallel if (wide)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = std::upper_bound(first, first + batch + 1, task) - first - 1;
      const int64_t n_spans = (first[b + 1] - first[b]) / kv_heads;
      const int64_t h = (task - first[b]) / n_spans, sp = (task - first[b]) % n_spans;
      // n_spans spans of near-equal page counts
      const int64_t p0 = sp * n_pages(b) / n_spans, p1 = (sp + 1) * n_pages(b) / n_spans;
      const int64_t len = std::min(lens[b], p1 * page_size) - p0 * page_size;
      const T* qp = q + b * q_row_stride + h * group * dim;
      T* op = out + (b * heads + h * group) * dim;
      float* part = n_spans > 1 ? parts + task * part_stride : nullptr;
      const int64_t* pg = pages + b * max_pages + p0;
      if constexpr (sizeof(T) == 4) {
        if (fast != nullptr) {
          fast(qp, kv, pg, len, page_stride, layer_off + h * row, kv_heads * row, scale, op, part);
          continue;
        }
      } else if (fast != nullptr) {
        fast(qp, kv, pg, len, page_stride, layer_off + h * row, kv_heads * row, scale, op);
        continue;
      }
      portable_task(qp, kv, pg, len, group, dim, page_size, page_stride, layer_off + h * row, kv_heads * row,
                    scale, op, part);
    }
    if (split) {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < batch * kv_heads; ++bh) {
        const int64_t b = bh / kv_heads, h = bh % kv_heads;
        const int64_t n_spans = (first[b + 1] - first[b]) / kv_heads;
        if (n_spans > 1) {
          if constexpr (sizeof(T) == 4)
            split_merge(parts + (first[b] + h * n_spans) * part_stride, n_spans, group, dim,
                        out + (b * heads + h * group) * dim);
        }
      }
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
