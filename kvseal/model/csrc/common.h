// Helpers shared by kvseal's kernels: bf16 <-> fp32 as PyTorch rounds, and a vectorized exp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvseal {

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

// x[i] = exp(x[i] - shift) for i < n. The softmax's exponentials were most of the kernel's time as scalar
// std::exp calls; with AVX-512 this is Cephes' expf (Cody-Waite reduction by ln 2, degree-5 polynomial, about
// 1 ulp) on 16 lanes, scaled by 2^k with vscalefps; with AVX2 the same on 8 lanes, scaled through the
// exponent bits (inputs clamped to [-87, 88], where 2^k stays a normal float: below, exp is < 2e-38 and the
// softmax term is nothing next to its maximum's 1). Elsewhere, the scalar std::exp.
#if defined(__AVX2__)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));  // exp underflows to 0 below here anyway
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// 16 fp32 values rounded to bf16 exactly as from_f32 rounds them (nearest even, NaN kept NaN), as bf16 bit
// patterns in the high halves of the lanes (the low halves zero): the fp32 value of the rounded bf16
inline __m512i round_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i q = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  // NaN: quiet, not rounded
  return _mm512_and_si512(q, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}
// ... and stored as 16 bf16
inline void store_bf16_16(uint16_t* dst, __m512i rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// 16 bf16 values widened to fp32 (exact)
inline __m512 widen16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
inline __m512 widen16(const uint16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// SiLU(gate) * up for 16 bf16 values of each, widened: round(round(silu(gate)) * up) as 16 bf16, rounded as
// F.silu(gate) * up rounds (fused.cpp's silu_mul, and the gate/up GEMM's fused epilogue in gemm.cpp)
#if defined(__AVX512BF16__)
inline __m256i silu_mul16(__m512 gv, __m512 uv) {
  const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
  const __m512 sr = widen16((__m256i)_mm512_cvtneps_pbh(sv));  // rounded to bf16, as F.silu's output is
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, uv));
}
#endif

inline void exp_shifted(float* x, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    _mm512_mask_storeu_ps(x + i, live, exp16(_mm512_sub_ps(v, sh)));
  }
}
#elif defined(__AVX2__)
inline void exp_shifted(float* x, int64_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh)));
  for (; i < n; ++i) x[i] = std::exp(x[i] - shift);
}
#else
inline void exp_shifted(float* x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}
#endif


// The kernel instance for G query heads per kv head and head dimension D on 16-slot pages (G <= 8, D of 32, 64
// or 128), or nullptr: make(g, d) returns the instance for the constants g and d (std::integral_constant).
template <typename Task, typename Make>
Task for_shape(int64_t group, int64_t dim, int64_t page_size, Make make) {
  if (page_size != 16) return nullptr;
  const auto by_group = [&](auto d) -> Task {
    switch (group) {
      case 1: return make(std::integral_constant<int, 1>{}, d);
      case 2: return make(std::integral_constant<int, 2>{}, d);
      case 3: return make(std::integral_constant<int, 3>{}, d);
      case 4: return make(std::integral_constant<int, 4>{}, d);
      case 5: return make(std::integral_constant<int, 5>{}, d);
      case 6: return make(std::integral_constant<int, 6>{}, d);
      case 7: return make(std::integral_constant<int, 7>{}, d);
      case 8: return make(std::integral_constant<int, 8>{}, d);
      default: return nullptr;
    }
  };
  switch (dim) {
    case 32: return by_group(std::integral_constant<int, 32>{});
    case 64: return by_group(std::integral_constant<int, 64>{});
    case 128: return by_group(std::integral_constant<int, 128>{});
    default: return nullptr;
  }
}

// x rounded to T and back, as a PyTorch op with a T output rounds its fp32 result
inline float rounded(float x, const float*) { return x; }
inline float rounded(float x, const uint16_t*) {
  uint16_t b;
  from_f32(x, &b);
  return to_f32(b);
}

}  // namespace kvseal
