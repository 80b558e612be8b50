// Paged causal attention for a prefill chunk, reading K/V in place from kvseal's page-major pool (no gather).
//
// A chunk is n query rows at positions pos0 .. pos0 + n - 1 of one request; its own keys and values are
// already in the pool (the forward stores them before attention), so every key comes from the request's
// pages: query row i sees positions 0 .. pos0 + i. One task is (16 query rows, kv head), and its vectors run
// across the 16 rows: the queries are transposed once per task into 32-bit columns (bf16 pairs), and each
// key's pairs are broadcast into vdpbf16ps, giving that key's 16 scores (bf16 products exact, fp32 sums).
// Keys come two pages (32) at a time; the online softmax's maxima, sums and corrections are then vertical
// ops over 16 rows at once (no horizontal reductions, no scalar exp). For P.V the probabilities are rounded
// to bf16, as bf16 SDPA and flash attention round them, and keys are paired (P of two keys per row, V of the
// same two keys per dimension) so vdpbf16ps does the products, exact, with fp32 sums. The sums that
// normalize stay fp32, and the output is rounded once to bf16. Measured against fp32 attention from the same
// inputs: 1.09x the error of rounding that result once, where bf16 SDPA gives 1.12x (tests/test_kernels.py).
// Keeping P in fp32 (fp32 FMAs for P.V, the same error as rounding once) made attention ~1.3x slower.
//
// The fast path needs AVX-512 BF16, bf16 pools, 16-slot pages, head_dim 32/64/128 and G <= 8; anything else
// returns 0 and the caller takes the plain PyTorch path (gather + SDPA), which is also the reference
// (kvseal.model.attention; tests/test_kernels.py holds the two equal).
//
// fp32 pools (the fp32 compute of --dtype auto on a CPU without bf16 dot products) have their own path at the
// AVX2 and AVX-512 levels: the same tasks and online softmax with lanes as query rows (8 on AVX2, 16 on
// AVX-512), fp32 FMAs with each key's (and each value's) element broadcast, probabilities kept in fp32.
#include "common.h"

namespace {
using namespace kvseal;

#if defined(__AVX2__)
// A chunk of n query rows as tasks of (block of `block` rows, kv head), on the OpenMP threads; later blocks
// see more keys, so they start first.
template <typename T, typename Task>
void run_blocks(Task task, int64_t block, const T* q, int64_t q_row_stride, const T* kv, T* out,
                const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads, int64_t dim,
                int64_t page_size, int64_t layers, int64_t layer, float scale) {
  const int64_t group = heads / kv_heads, row = page_size * dim, page_stride = layers * 2 * kv_heads * row;
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < blocks * kv_heads; ++t) {
    const int64_t blk = blocks - 1 - t / kv_heads, h = t % kv_heads;
    const int64_t i0 = blk * block, rows = n - i0 < block ? n - i0 : block;
    task(q + i0 * q_row_stride + h * group * dim, q_row_stride, kv, pages, rows, pos0 + i0, page_stride,
         layer * 2 * kv_heads * row + h * row, kv_heads * row, scale, out + i0 * heads * dim + h * group * dim,
         heads * dim);
  }
}
#endif

#if defined(__AVX512BF16__)
using PrefillTask = void (*)(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, const int64_t* pages,
                             int64_t rows, int64_t first_pos, int64_t page_stride, int64_t head_off,
                             int64_t v_off, float scale, uint16_t* out, int64_t out_row_stride);

// 16 rows of 16 dwords -> 16 columns (col[j] lane t = row t's dword j)
inline void transpose16(const __m512i r[16], __m512i col[16]) {
  __m512i u[4][4];
  for (int i = 0; i < 4; ++i) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[4 * i], r[4 * i + 1]), t1 = _mm512_unpackhi_epi32(r[4 * i], r[4 * i + 1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[4 * i + 2], r[4 * i + 3]);
    const __m512i t3 = _mm512_unpackhi_epi32(r[4 * i + 2], r[4 * i + 3]);
    u[i][0] = _mm512_unpacklo_epi64(t0, t2);  // lane (L, r): row 4i + r, dword 4L + k
    u[i][1] = _mm512_unpackhi_epi64(t0, t2);
    u[i][2] = _mm512_unpacklo_epi64(t1, t3);
    u[i][3] = _mm512_unpackhi_epi64(t1, t3);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0x88), a1 = _mm512_shuffle_i32x4(u[0][k], u[1][k], 0xDD);
    const __m512i b0 = _mm512_shuffle_i32x4(u[2][k], u[3][k], 0x88), b1 = _mm512_shuffle_i32x4(u[2][k], u[3][k], 0xDD);
    col[k] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    col[8 + k] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    col[4 + k] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    col[12 + k] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
}

template <int G, int C>  // G queries per kv head, C = head_dim / 32
void prefill_task(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, const int64_t* pages, int64_t rows,
                  int64_t first_pos, int64_t page_stride, int64_t head_off, int64_t v_off, float scale,
                  uint16_t* out, int64_t out_row_stride) {
  // Lanes are query rows: a vector holds one key's scores (or one dimension's output) for the task's 16 rows.
  // Row maxima and sums are then plain vertical ops, one exp16 corrects 16 rows at once, and keys need no
  // transpose: each key's bf16 pair is broadcast into vdpbf16ps against the queries, transposed once per task.
  constexpr int D = 32 * C, DP = D / 2, P = 16, SP = 2, KB = SP * P;
  alignas(64) __m512i qt[G][DP];      // qt[g][j] lane r: row r's dword j (dims 2j, 2j + 1) of head g
  alignas(64) float o[G][D][16];      // unnormalized output, o[g][d] lane r
  alignas(64) uint32_t vp[KB / 2][D];  // this block's values, keys paired: (key 2i, key 2i + 1) per dimension
  alignas(64) __m512 pw[KB];           // this block's probabilities, one vector of rows per key
  __m512 m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t)
        r[t] = t < rows ? _mm512_loadu_si512(q + t * q_row_stride + g * D + 32 * c) : _mm512_setzero_si512();
      transpose16(r, qt[g] + 16 * c);
    }
    m[g] = _mm512_set1_ps(-INFINITY);
    l[g] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) _mm512_store_ps(o[g][d], _mm512_setzero_ps());
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 sc = _mm512_set1_ps(scale);
  const int64_t last_pos = first_pos + rows - 1, n_pages = last_pos / P + 1;
  for (int64_t p = 0; p < n_pages; p += SP) {
    const int np = n_pages - p < SP ? static_cast<int>(n_pages - p) : SP;
    for (int64_t nxt = p + SP; nxt < p + 2 * SP && nxt < n_pages; ++nxt) {
      const char* nk = reinterpret_cast<const char*>(kv + pages[nxt] * page_stride + head_off);
      for (int i = 0; i < P * D * 2; i += 64) {
        _mm_prefetch(nk + i, _MM_HINT_T0);
        _mm_prefetch(nk + v_off * 2 + i, _MM_HINT_T0);
      }
    }
    // keys of this block that some row sees; slots past the chunk's last position are never read
    const int64_t kbase = p * P;
    const int nk = last_pos - kbase + 1 < np * P ? static_cast<int>(last_pos - kbase + 1) : np * P;
    const uint16_t* kp[SP];
    for (int e = 0; e < SP; ++e) kp[e] = kv + pages[p + (e < np ? e : 0)] * page_stride + head_off;
    for (int t = 0; t < nk; t += 2)
      for (int v = 0; v < D / 16; ++v) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(kp[t / P] + v_off + (t % P) * D + 16 * v)));
        // an odd block's last pair takes a zero value (its probability is zero too; 0 * garbage could be NaN)
        const __m512i hi = t + 1 < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                            kp[(t + 1) / P] + v_off + ((t + 1) % P) * D + 16 * v)))
                                      : _mm512_setzero_si512();
        _mm512_store_si512(&vp[t / 2][16 * v], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    for (int g = 0; g < G; ++g) {
      __m512 s[KB];
      for (int k0 = 0; k0 < nk; k0 += 8) {
        const uint32_t* kd[8];
        for (int j = 0; j < 8; ++j) {
          const int t = k0 + j < nk ? k0 + j : 0;
          kd[j] = reinterpret_cast<const uint32_t*>(kp[t / P] + (t % P) * D);
        }
        __m512 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
        for (int j2 = 0; j2 < DP; ++j2) {
          const __m512bh qv = (__m512bh)qt[g][j2];
          for (int j = 0; j < 8; ++j)
            a[j] = _mm512_dpbf16_ps(a[j], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kd[j][j2])));
        }
        for (int j = 0; j < 8; ++j) s[k0 + j] = _mm512_mul_ps(a[j], sc);
      }
      // row r sees key kbase + t when kbase + t <= first_pos + r
      __mmask16 live[KB];
      __m512 bm = _mm512_set1_ps(-INFINITY);
      for (int t = 0; t < nk; ++t) {
        const int64_t need = kbase + t - first_pos;  // the first row that sees this key
        live[t] = need <= 0 ? 0xffff : _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(need)));
        bm = _mm512_mask_max_ps(bm, live[t], bm, s[t]);
      }
      const __m512 mx = _mm512_max_ps(m[g], bm);
      const __m512 corr = exp16(_mm512_sub_ps(m[g], mx));
      m[g] = mx;
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < nk; ++t) {
        pw[t] = _mm512_maskz_mov_ps(live[t], exp16(_mm512_sub_ps(s[t], mx)));
        sum = _mm512_add_ps(sum, pw[t]);
      }
      l[g] = _mm512_fmadd_ps(l[g], corr, sum);
      // probabilities rounded to bf16, keys paired per row (as vp pairs the values): P.V in vdpbf16ps
      const int npair = (nk + 1) / 2;
      __m512bh pp[KB / 2];
      if (nk % 2) pw[nk] = _mm512_setzero_ps();
      for (int i = 0; i < npair; ++i) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(pw[2 * i]));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(pw[2 * i + 1]));
        pp[i] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = _mm512_mul_ps(_mm512_load_ps(o[g][d0 + j]), corr);
        for (int i = 0; i < npair; ++i) {
          const __m512bh pt = pp[i];
          for (int j = 0; j < 16; ++j)
            a[j] = _mm512_dpbf16_ps(a[j], pt, (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[i][d0 + j])));
        }
        for (int j = 0; j < 16; ++j) _mm512_store_ps(o[g][d0 + j], a[j]);
      }
    }
  }
  alignas(64) uint16_t ob[D][16];
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[g]);
    for (int d = 0; d < D; ++d)
      _mm256_store_si256(reinterpret_cast<__m256i*>(ob[d]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[g][d]), inv)));
    for (int64_t r = 0; r < rows; ++r)
      for (int d = 0; d < D; ++d) out[r * out_row_stride + g * D + d] = ob[d][r];
  }
}

PrefillTask prefill_path(int64_t group, int64_t dim, int64_t page_size) {
  return kvseal::for_shape<PrefillTask>(group, dim, page_size, [](auto g, auto d) {
    return &prefill_task<decltype(g)::value, decltype(d)::value / 32>;
  });
}
#endif

#if defined(__AVX2__)
// The fp32 path: one vector = one value for each of W query rows.
#if defined(__AVX512F__)
constexpr int W = 16;
using V = __m512;
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vexp(V x) { return exp16(x); }
inline void vstore(float* p, V a) { _mm512_store_ps(p, a); }
// lanes (rows) r >= need keep x; the rest get `other` (row r sees key position first_pos + need.. only from r)
inline V vfrom(V x, int64_t need, V other) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_mask_mov_ps(other, _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(need))), x);
}
#else
constexpr int W = 8;
using V = __m256;
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vexp(V x) { return exp8(x); }
inline void vstore(float* p, V a) { _mm256_store_ps(p, a); }
inline V vfrom(V x, int64_t need, V other) {
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i keep = _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(need) - 1));
  return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(keep));
}
#endif

using PrefillTaskF32 = void (*)(const float* q, int64_t q_row_stride, const float* kv, const int64_t* pages,
                                int64_t rows, int64_t first_pos, int64_t page_stride, int64_t head_off,
                                int64_t v_off, float scale, float* out, int64_t out_row_stride);

template <int G, int D>  // G queries per kv head, D = head_dim
void prefill_task_f32(const float* q, int64_t q_row_stride, const float* kv, const int64_t* pages, int64_t rows,
                      int64_t first_pos, int64_t page_stride, int64_t head_off, int64_t v_off, float scale,
                      float* out, int64_t out_row_stride) {
  // P slots per page; KG keys scored at once (one query load feeds KG FMAs), DG output dimensions at once (one
  // probability load feeds DG FMAs). Measured on Zen 4 cores, one 512-row chunk over 1024 positions: AVX2 90 ->
  // 130 GFLOP/s going from (4, 1) to (8, 8); AVX-512 170-180 for (4, 1), (4, 2) and (4, 4), 120 for (8, 8).
  constexpr int P = 16, KG = W == 8 ? 8 : 4, DG = W == 8 ? 8 : 4;
  alignas(64) float qt[G][D][W];  // qt[g][d] lane r: row r's query element d of head g, times the scale
  alignas(64) float o[G][D][W];   // unnormalized output
  V m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d)
      for (int r = 0; r < W; ++r) {
        qt[g][d][r] = r < rows ? q[r * q_row_stride + g * D + d] * scale : 0.f;
        o[g][d][r] = 0.f;
      }
    m[g] = vset(-INFINITY);
    l[g] = vset(0.f);
  }
  const V neg = vset(-INFINITY), zero = vset(0.f);
  const int64_t last_pos = first_pos + rows - 1, n_pages = last_pos / P + 1;
  for (int64_t p = 0; p < n_pages; ++p) {
    if (p + 1 < n_pages) {
      const char* nk = reinterpret_cast<const char*>(kv + pages[p + 1] * page_stride + head_off);
      for (int i = 0; i < P * D * 4; i += 64) {
        _mm_prefetch(nk + i, _MM_HINT_T0);
        _mm_prefetch(nk + v_off * 4 + i, _MM_HINT_T0);
      }
    }
    // keys of this page that some row sees; slots past the chunk's last position are never read
    const int64_t kbase = p * P;
    const int nk = last_pos - kbase + 1 < P ? static_cast<int>(last_pos - kbase + 1) : P;
    const float* kp = kv + pages[p] * page_stride + head_off;
    const float* vp = kp + v_off;
    for (int g = 0; g < G; ++g) {
      V s[P];
      for (int t0 = 0; t0 < nk; t0 += KG) {
        const float* kd[KG];
        for (int j = 0; j < KG; ++j) kd[j] = kp + (t0 + j < nk ? t0 + j : 0) * D;
        V a[KG];
        for (int j = 0; j < KG; ++j) a[j] = zero;
        for (int d = 0; d < D; ++d) {
          const V qv = *reinterpret_cast<const V*>(qt[g][d]);
          for (int j = 0; j < KG; ++j) a[j] = vfma(qv, vset(kd[j][d]), a[j]);
        }
        for (int j = 0; j < KG && t0 + j < nk; ++j) s[t0 + j] = a[j];
      }
      V bm = neg;
      for (int t = 0; t < nk; ++t) {
        s[t] = vfrom(s[t], kbase + t - first_pos, neg);  // row r sees key kbase + t when kbase + t <= first_pos + r
        bm = vmax(bm, s[t]);
      }
      const V mx = vmax(m[g], bm);
      const V corr = vexp(vsub(m[g], mx));
      m[g] = mx;
      V sum = zero;
      for (int t = 0; t < nk; ++t) {
        s[t] = vfrom(vexp(vsub(s[t], mx)), kbase + t - first_pos, zero);  // AVX2's exp8 never gives exactly 0
        sum = vadd(sum, s[t]);
      }
      l[g] = vfma(l[g], corr, sum);
      for (int d = 0; d < D; d += DG) {  // DG dimensions at once: one probability load feeds DG FMAs
        V acc[DG];
        for (int j = 0; j < DG; ++j) acc[j] = vmul(*reinterpret_cast<const V*>(o[g][d + j]), corr);
        for (int t = 0; t < nk; ++t) {
          const V pt = s[t];
          for (int j = 0; j < DG; ++j) acc[j] = vfma(pt, vset(vp[t * D + d + j]), acc[j]);
        }
        for (int j = 0; j < DG; ++j) vstore(o[g][d + j], acc[j]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float inv[W];
    vstore(inv, vdiv(vset(1.f), l[g]));
    for (int64_t r = 0; r < rows; ++r)
      for (int d = 0; d < D; ++d) out[r * out_row_stride + g * D + d] = o[g][d][r] * inv[r];
  }
}

PrefillTaskF32 prefill_path_f32(int64_t group, int64_t dim, int64_t page_size) {
  return kvseal::for_shape<PrefillTaskF32>(group, dim, page_size, [](auto g, auto d) {
    return &prefill_task_f32<decltype(g)::value, decltype(d)::value>;
  });
}
#endif

}  // namespace

extern "C" {

// 1 when the fast path takes this shape (else the caller must use its own path)
int kvseal_prefill_supported(int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size) {
#if defined(__AVX512BF16__)
  return heads % kv_heads == 0 && prefill_path(heads / kv_heads, dim, page_size) != nullptr;
#else
  (void)heads, (void)kv_heads, (void)dim, (void)page_size;
  return 0;
#endif
}

// q rows [n] of `heads` x dim (row stride q_row_stride), positions pos0 .. pos0 + n - 1; pages: the
// request's page table (covering pos0 + n positions); out [n, heads * dim] contiguous. Returns 0 if the
// shape is not supported (nothing written).
int kvseal_prefill_attention_bf16(const uint16_t* q, int64_t q_row_stride, const uint16_t* kv, uint16_t* out,
                                  const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads,
                                  int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale) {
#if defined(__AVX512BF16__)
  const PrefillTask task = heads % kv_heads ? nullptr : prefill_path(heads / kv_heads, dim, page_size);
  if (task == nullptr) return 0;
  run_blocks(task, 16, q, q_row_stride, kv, out, pages, n, pos0, heads, kv_heads, dim, page_size, layers, layer,
             scale);
  return 1;
#else
  (void)q, (void)q_row_stride, (void)kv, (void)out, (void)pages, (void)n, (void)pos0, (void)heads;
  (void)kv_heads, (void)dim, (void)page_size, (void)layers, (void)layer, (void)scale;
  return 0;
#endif
}

// The same for fp32 pools (the AVX2 and AVX-512 levels; none at the generic level).
int kvseal_prefill_f32_supported(int64_t heads, int64_t kv_heads, int64_t dim, int64_t page_size) {
#if defined(__AVX2__)
  return heads % kv_heads == 0 && prefill_path_f32(heads / kv_heads, dim, page_size) != nullptr;
#else
  (void)heads, (void)kv_heads, (void)dim, (void)page_size;
  return 0;
#endif
}

int kvseal_prefill_attention_f32(const float* q, int64_t q_row_stride, const float* kv, float* out,
                                 const int64_t* pages, int64_t n, int64_t pos0, int64_t heads, int64_t kv_heads,
                                 int64_t dim, int64_t page_size, int64_t layers, int64_t layer, float scale) {
#if defined(__AVX2__)
  const PrefillTaskF32 task = heads % kv_heads ? nullptr : prefill_path_f32(heads / kv_heads, dim, page_size);
  if (task == nullptr) return 0;
  run_blocks(task, W, q, q_row_stride, kv, out, pages, n, pos0, heads, kv_heads, dim, page_size, layers, layer,
             scale);
  return 1;
#else
  (void)q, (void)q_row_stride, (void)kv, (void)out, (void)pages, (void)n, (void)pos0, (void)heads;
  (void)kv_heads, (void)dim, (void)page_size, (void)layers, (void)layer, (void)scale;
  return 0;
#endif
}

}  // extern "C"
