// The small per-layer ops of the forward, fused: residual add + RMSNorm, RoPE + K/V store into the pool, and
// SiLU(gate) * up. Each replaces 4-10 PyTorch ops (and their temporaries) with one pass over the rows.
//
// They reproduce the PyTorch reference's rounding step by step (kvseal.model.llama: rms_norm, apply_rope,
// F.silu(gate) * up): every intermediate that PyTorch rounds to the model dtype is rounded here too, so
// bf16 results equal the reference's except where a sum is taken in another order (the RMS) or exp differs
// by an ulp. -ffp-contract=off (setup.py) keeps a * b + c from becoming one fused multiply-add, which would
// round once where PyTorch rounds twice. tests/test_kernels.py holds them equal to the reference.
#include "common.h"

namespace {
using namespace kvseal;

template <typename T>
void add_rms_norm(T* x, const T* delta, const T* weight, T* out, int64_t n, int64_t hidden, float eps) {
#pragma omp parallel for if (n * hidden >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    T* xr = x + i * hidden;
    float sum = 0.f;
    if (delta != nullptr) {
      const T* dr = delta + i * hidden;
      for (int64_t d = 0; d < hidden; ++d) from_f32(to_f32(xr[d]) + to_f32(dr[d]), xr + d);
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < hidden; ++d) sum += to_f32(xr[d]) * to_f32(xr[d]);
    const float r = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    T* o = out + i * hidden;
    for (int64_t d = 0; d < hidden; ++d) from_f32(to_f32(weight[d]) * rounded(to_f32(xr[d]) * r, xr), o + d);
  }
}

// qkv rows [n, row_stride]: heads query heads, then kv_heads keys, then kv_heads values, each dim wide.
// Queries and keys are rotated in place (x * cos + roll(x, dim/2) * signed_sin); keys and values are then
// written to their slots of `layer` in the page-major pool kv[page, layer, 0|1, kv_head, slot, dim].
template <typename T>
void rope_store(T* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads, int64_t dim,
                const T* cos, const T* sin, const int64_t* positions, T* kv, const int64_t* slots, int64_t layers,
                int64_t layer, int64_t page_size) {
  const int64_t half = dim / 2, head_rows = page_size * dim;
#pragma omp parallel for if (n >= 64)
  for (int64_t i = 0; i < n; ++i) {
    T* row = qkv + i * row_stride;
    const T* c = cos + positions[i] * dim;
    const T* s = sin + positions[i] * dim;
    float tmp[512];
    int64_t h = 0;
#if defined(__AVX512F__)
    // bf16 with dim a multiple of 32: 16 dimensions at a time, the partner (roll by dim / 2) a whole vector
    // away, each step rounded as the scalar loop below rounds it
    if constexpr (sizeof(T) == 2) {
      if (dim % 32 == 0 && dim <= 256) {
        const int64_t nb = dim / 16, hb = nb / 2;
        const auto* cb = reinterpret_cast<const uint16_t*>(c);
        const auto* sb = reinterpret_cast<const uint16_t*>(s);
        for (; h < heads + kv_heads; ++h) {
          auto* x = reinterpret_cast<uint16_t*>(row + h * dim);
          __m512 xv[16];
          for (int64_t j = 0; j < nb; ++j) xv[j] = widen16(x + 16 * j);
          for (int64_t j = 0; j < nb; ++j) {
            const __m512i a = round_bf16_16(_mm512_mul_ps(xv[j], widen16(cb + 16 * j)));
            const __m512i b = round_bf16_16(_mm512_mul_ps(xv[(j + hb) % nb], widen16(sb + 16 * j)));
            store_bf16_16(x + 16 * j, round_bf16_16(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b))));
          }
        }
      }
    }
#endif
    for (; h < heads + kv_heads; ++h) {
      T* x = row + h * dim;
      for (int64_t d = 0; d < dim; ++d) tmp[d] = to_f32(x[d]);
      // the two halves apart (each one's partner is the other half), so the compiler vectorizes both loops
      for (int64_t d = 0; d < half; ++d)
        from_f32(rounded(tmp[d] * to_f32(c[d]), x) + rounded(tmp[d + half] * to_f32(s[d]), x), x + d);
      for (int64_t d = half; d < dim; ++d)
        from_f32(rounded(tmp[d] * to_f32(c[d]), x) + rounded(tmp[d - half] * to_f32(s[d]), x), x + d);
    }
    const int64_t page = slots[i] / page_size, off = slots[i] % page_size;
    T* dst = kv + (page * layers + layer) * 2 * kv_heads * head_rows + off * dim;
    for (int64_t j = 0; j < kv_heads; ++j) {
      std::memcpy(dst + j * head_rows, row + (heads + j) * dim, dim * sizeof(T));
      std::memcpy(dst + (kv_heads + j) * head_rows, row + (heads + kv_heads + j) * dim, dim * sizeof(T));
    }
  }
}

// gate_up rows [n, 2 * inter] (gate, then up) -> out [n, inter] = round(round(silu(gate)) * up)
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t inter) {
#pragma omp parallel for if (n * inter >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    const T* g = gate_up + i * 2 * inter;
    const T* u = g + inter;
    T* o = out + i * inter;
    int64_t d = 0;
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2) {
      for (; d + 16 <= inter; d += 16) {
        const __m512 gv = widen16(reinterpret_cast<const uint16_t*>(g + d));
        const __m512 uv = widen16(reinterpret_cast<const uint16_t*>(u + d));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), silu_mul16(gv, uv));
      }
    } else {
      for (; d + 16 <= inter; d += 16) {
        const __m512 gv = _mm512_loadu_ps(reinterpret_cast<const float*>(g + d));
        const __m512 uv = _mm512_loadu_ps(reinterpret_cast<const float*>(u + d));
        const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_storeu_ps(reinterpret_cast<float*>(o + d), _mm512_mul_ps(sv, uv));
      }
    }
#elif defined(__AVX2__)
    if constexpr (sizeof(T) == 4) {  // fp32 (--dtype auto without bf16 dot products): 8 lanes, exp8
      for (; d + 8 <= inter; d += 8) {
        const __m256 gv = _mm256_loadu_ps(reinterpret_cast<const float*>(g + d));
        const __m256 uv = _mm256_loadu_ps(reinterpret_cast<const float*>(u + d));
        const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(reinterpret_cast<float*>(o + d), _mm256_mul_ps(sv, uv));
      }
    }
#endif
    for (; d < inter; ++d) {
      const float gf = to_f32(g[d]);
      from_f32(rounded(gf / (1.f + std::exp(-gf)), g) * to_f32(u[d]), o + d);
    }
  }
}

}  // namespace

extern "C" {

void kvseal_add_rms_norm_bf16(uint16_t* x, const uint16_t* delta, const uint16_t* weight, uint16_t* out, int64_t n,
                              int64_t hidden, float eps) {
  add_rms_norm(x, delta, weight, out, n, hidden, eps);
}
void kvseal_add_rms_norm_f32(float* x, const float* delta, const float* weight, float* out, int64_t n,
                             int64_t hidden, float eps) {
  add_rms_norm(x, delta, weight, out, n, hidden, eps);
}

void kvseal_rope_store_bf16(uint16_t* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads,
                            int64_t dim, const uint16_t* cos, const uint16_t* sin, const int64_t* positions,
                            uint16_t* kv, const int64_t* slots, int64_t layers, int64_t layer, int64_t page_size) {
  rope_store(qkv, n, row_stride, heads, kv_heads, dim, cos, sin, positions, kv, slots, layers, layer, page_size);
}
void kvseal_rope_store_f32(float* qkv, int64_t n, int64_t row_stride, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float* cos, const float* sin, const int64_t* positions, float* kv,
                           const int64_t* slots, int64_t layers, int64_t layer, int64_t page_size) {
  rope_store(qkv, n, row_stride, heads, kv_heads, dim, cos, sin, positions, kv, slots, layers, layer, page_size);
}

void kvseal_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t n, int64_t inter) {
  silu_mul(gate_up, out, n, inter);
}
void kvseal_silu_mul_f32(const float* gate_up, float* out, int64_t n, int64_t inter) {
  silu_mul(gate_up, out, n, inter);
}

}  // extern "C"
