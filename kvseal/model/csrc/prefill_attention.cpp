// Paged causal attention for a prefill chunk, reading K/V in place from kvseal's page-major pool (no gather).
//
// A chunk is n query rows at positions pos0 .. pos0 + n - 1 of one request; its own keys and values are
// already in the pool (the forward stores them before attention), so every key comes from the request's
// pages: query row i sees positions 0 .. pos0 + i. One task is (16 query rows, kv head): for each page of 16
// keys, the keys are transposed once into 32-bit columns (bf16 pairs), each of the G x 16 queries scores the
// page with vdpbf16ps (16 scores per vector, bf16 products exact, fp32 sums), runs an online softmax in fp32
// and accumulates the page's values, widened once to fp32. Output is rounded once to bf16.
//
// The fast path needs AVX-512 BF16, bf16 pools, 16-slot pages, head_dim 32/64/128 and G <= 8; anything else
// returns 0 and the caller takes the plain PyTorch path (gather + SDPA), which is also the reference
// (kvseal.model.attention; tests/test_kernels.py holds the two equal).
#include "common.h"

namespace {
using namespace kvseal;

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
  constexpr int D = 32 * C, NV = D / 16, P = 16;
  alignas(64) float acc[G][16][D];
  float m[G][16], l[G][16];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 16; ++i) {
      m[g][i] = -INFINITY;
      l[g][i] = 0.f;
      for (int d = 0; d < D; ++d) acc[g][i][d] = 0.f;
    }
  // two pages (32 keys) per softmax update: half the reductions, rescales and scalar work per key
  constexpr int SP = 2;
  alignas(64) __m512i kt[SP][16 * C];
  alignas(64) float vf[SP * P][D];
  alignas(64) float pw[SP * P];
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
    for (int e = 0; e < np; ++e) {
      const uint16_t* kp = kv + pages[p + e] * page_stride + head_off;
      const uint16_t* vp = kp + v_off;
      for (int c = 0; c < C; ++c) {
        __m512i r[16];
        for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(kp + t * D + 32 * c);
        transpose16(r, kt[e] + 16 * c);
      }
      // slots past the chunk's last position hold whatever the page holds: masked, their values never read
      const int64_t valid = last_pos - (p + e) * P + 1 < P ? last_pos - (p + e) * P + 1 : P;
      for (int t = 0; t < valid; ++t)
        for (int v = 0; v < NV; ++v) _mm512_store_ps(&vf[e * P + t][16 * v], widen16(vp + t * D + 16 * v));
    }
    const int64_t i0 = p * P - first_pos > 0 ? p * P - first_pos : 0;  // rows before i0 see none of these
    for (int64_t i = i0; i < rows; ++i) {
      const int64_t seen_all = first_pos + i - p * P + 1;  // keys of these pages that row i sees
      const int n = seen_all < np * P ? static_cast<int>(seen_all) : np * P;
      const int n0 = n < P ? n : P, n1 = n - n0;
      const __mmask16 live0 = n0 == P ? 0xffff : static_cast<__mmask16>((1u << n0) - 1);
      const __mmask16 live1 = n1 == P ? 0xffff : static_cast<__mmask16>((1u << n1) - 1);
      for (int g = 0; g < G; ++g) {
        const uint32_t* qd = reinterpret_cast<const uint32_t*>(q + i * q_row_stride + g * D);
        __m512 s0 = _mm512_set1_ps(-INFINITY), s1 = _mm512_set1_ps(-INFINITY);
        {
          // independent chains: vdpbf16ps latency, not throughput, would bound a single one
          __m512 a4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          __m512 b4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int j = 0; j < 16 * C; j += 4)
            for (int k = 0; k < 4; ++k) {
              const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qd[j + k]));
              a4[k] = _mm512_dpbf16_ps(a4[k], (__m512bh)kt[0][j + k], qv);
              if (n1 > 0) b4[k] = _mm512_dpbf16_ps(b4[k], (__m512bh)kt[1][j + k], qv);
            }
          const __m512 sc = _mm512_set1_ps(scale);
          s0 = _mm512_mask_mov_ps(s0, live0, _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a4[0], a4[1]),
                                                                          _mm512_add_ps(a4[2], a4[3])), sc));
          if (n1 > 0)
            s1 = _mm512_mask_mov_ps(s1, live1, _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(b4[0], b4[1]),
                                                                            _mm512_add_ps(b4[2], b4[3])), sc));
        }
        const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
        const float mx = step_max > m[g][i] ? step_max : m[g][i];
        const __m512 mv = _mm512_set1_ps(mx);
        const __m512 p0 = _mm512_maskz_mov_ps(live0, exp16(_mm512_sub_ps(s0, mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(live1, exp16(_mm512_sub_ps(s1, mv)));
        const float corr = std::exp(m[g][i] - mx);
        m[g][i] = mx;
        l[g][i] = l[g][i] * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        _mm512_store_ps(pw, p0);
        _mm512_store_ps(pw + P, p1);
        __m512 a[NV], b[NV];  // even and odd keys: two chains per vector
        const __m512 cv = _mm512_set1_ps(corr);
        for (int v = 0; v < NV; ++v) {
          a[v] = _mm512_mul_ps(_mm512_load_ps(&acc[g][i][16 * v]), cv);
          b[v] = _mm512_setzero_ps();
        }
        int t = 0;
        for (; t + 1 < n; t += 2) {
          const __m512 w0 = _mm512_set1_ps(pw[t]), w1 = _mm512_set1_ps(pw[t + 1]);
          for (int v = 0; v < NV; ++v) {
            a[v] = _mm512_fmadd_ps(w0, _mm512_load_ps(&vf[t][16 * v]), a[v]);
            b[v] = _mm512_fmadd_ps(w1, _mm512_load_ps(&vf[t + 1][16 * v]), b[v]);
          }
        }
        if (t < n) {
          const __m512 w0 = _mm512_set1_ps(pw[t]);
          for (int v = 0; v < NV; ++v) a[v] = _mm512_fmadd_ps(w0, _mm512_load_ps(&vf[t][16 * v]), a[v]);
        }
        for (int v = 0; v < NV; ++v) _mm512_store_ps(&acc[g][i][16 * v], _mm512_add_ps(a[v], b[v]));
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(1.f / l[g][i]);
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * out_row_stride + g * D + 16 * v),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[g][i][16 * v]), inv)));
    }
}

template <int C>
PrefillTask prefill_for_group(int64_t group) {
  switch (group) {
    case 1: return prefill_task<1, C>;
    case 2: return prefill_task<2, C>;
    case 3: return prefill_task<3, C>;
    case 4: return prefill_task<4, C>;
    case 5: return prefill_task<5, C>;
    case 6: return prefill_task<6, C>;
    case 7: return prefill_task<7, C>;
    case 8: return prefill_task<8, C>;
    default: return nullptr;
  }
}

PrefillTask prefill_path(int64_t group, int64_t dim, int64_t page_size) {
  if (page_size != 16) return nullptr;
  switch (dim) {
    case 32: return prefill_for_group<1>(group);
    case 64: return prefill_for_group<2>(group);
    case 128: return prefill_for_group<4>(group);
    default: return nullptr;
  }
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
  if (heads % kv_heads != 0) return 0;
  const int64_t group = heads / kv_heads;
  const PrefillTask task = prefill_path(group, dim, page_size);
  if (task == nullptr) return 0;
  const int64_t row = page_size * dim, page_stride = layers * 2 * kv_heads * row, blocks = (n + 15) / 16;
  // later blocks see more keys: start them first
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t t = 0; t < blocks * kv_heads; ++t) {
    const int64_t blk = blocks - 1 - t / kv_heads, h = t % kv_heads;
    const int64_t i0 = blk * 16, rows = n - i0 < 16 ? n - i0 : 16;
    task(q + i0 * q_row_stride + h * group * dim, q_row_stride, kv, pages, rows, pos0 + i0, page_stride,
         layer * 2 * kv_heads * row + h * row, kv_heads * row, scale, out + i0 * heads * dim + h * group * dim,
         heads * dim);
  }
  return 1;
#else
  (void)q, (void)q_row_stride, (void)kv, (void)out, (void)pages, (void)n, (void)pos0, (void)heads;
  (void)kv_heads, (void)dim, (void)page_size, (void)layers, (void)layer, (void)scale;
  return 0;
#endif
}

}  // extern "C"
