// Linear layers, y = x @ W.T, with the weight packed once at load (bf16) and the work handed out dynamically.
//
// The weight [N, K] is packed into blocks of 16 output columns: block b holds, for each pair of input
// features (2k, 2k + 1), the 16 columns' two weights side by side, which is the operand vdpbf16ps takes.
// The same layout serves every level:
// - AVX-512 BF16 (bf16 activations): one task is a panel of up to 3 blocks (48 columns) for all rows, in
//   chunks of 8 rows: 24 accumulators, 3 weight loads and 8 broadcast rows per pair of features. Each output
//   sums its K products in order, two at a time, in fp32, and is rounded once to bf16: what F.linear
//   computes, except that oneDNN orders some sums differently, so a rare element (2e-5 to 2e-3 of them) lands
//   one bf16 step away (tests/test_quant.py).
// - AVX2 + FMA and AVX-512 F ("wide"): a pair's dword holds w[c][2k] in its low half and w[c][2k+1] in its
//   high half, so a shift and a mask widen one load into the two fp32 vectors, exact; fp32 FMAs then add the
//   products one at a time, in order. Activations are bf16 (rounded output, as above) or fp32 (fp32 output:
//   the fp32 compute of --dtype auto on CPUs without bf16 dot products, weights still read as bf16).
// The result is the same whatever the number of rows (a row's result does not depend on what shares its
// step), which oneDNN does not guarantee.
//
// Why not oneDNN: it splits each GEMM into a fixed share per thread, so when another process (an HTTP
// thread, a client) takes one core for a moment, the other core waits at the end of every GEMM. Panels are
// handed out one at a time (OpenMP dynamic schedule), so the free core takes the work. It is also faster for
// few rows (batch-1 decode: 1.6x, memory-bound, it streams each weight once with no reorder).
//
// Needs AVX2 + FMA (any level from avx2 up), N a multiple of 16 and K even; otherwise kvseal_gemm_supported()
// is 0 and the caller keeps PyTorch (kvseal.model.quant).
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"

namespace {
// Hands out the panels of up to nbm (1 to 3) blocks of 16 columns one at a time, and calls
// f(first block, std::integral_constant<int, blocks in this panel>) for each.
template <typename F>
inline void each_panel(int64_t blocks, int64_t nbm, F&& f) {
  const int64_t panels = (blocks + nbm - 1) / nbm;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t b0 = nbm * p, nb = blocks - b0 < nbm ? blocks - b0 : nbm;
    if (nb == 3)
      f(b0, std::integral_constant<int, 3>{});
    else if (nb == 2)
      f(b0, std::integral_constant<int, 2>{});
    else
      f(b0, std::integral_constant<int, 1>{});
  }
}

#if defined(__AVX512BF16__)
template <int R, int NB>
inline void micro(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t pairs, int64_t block, uint16_t* out,
                  int64_t ldo) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_load_si512(wp + j * block + k * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][k]));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <int NB>
void panel(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* wp, int64_t pairs, uint16_t* out, int64_t ldo) {
  const int64_t block = pairs * 32;
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) micro<8, NB>(x + i * ldx, ldx, wp, pairs, block, out + i * ldo, ldo);
  const uint16_t* xi = x + i * ldx;
  uint16_t* oi = out + i * ldo;
  switch (m - i) {
    case 1: micro<1, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 2: micro<2, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 3: micro<3, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 4: micro<4, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 5: micro<5, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 6: micro<6, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    case 7: micro<7, NB>(xi, ldx, wp, pairs, block, oi, ldo); break;
    default: break;
  }
}

// The gate/up projection with SiLU(gate) * up in its epilogue: each task takes NB blocks of gate columns and
// the same NB blocks of up columns (block j of the gate half pairs with block j of the up half), 6 rows at a
// time (6 x 2NB accumulators), and writes round(round(silu(g)) * u) where g and u are the outputs the plain
// GEMM would store, rounded the same way: the result equals gemm + silu_mul bit for bit, without writing and
// re-reading the [rows, 2 * inter] product.
template <int R, int NB>
inline void micro_silu(const uint16_t* x, int64_t ldx, const uint16_t* wg, const uint16_t* wu, int64_t pairs,
                       int64_t block, uint16_t* out, int64_t ldo) {
  __m512 g[R][NB], u[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) g[r][j] = u[r][j] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh a[NB], b[NB];
    for (int j = 0; j < NB; ++j) {
      a[j] = (__m512bh)_mm512_load_si512(wg + j * block + k * 32);
      b[j] = (__m512bh)_mm512_load_si512(wu + j * block + k * 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][k]));
      for (int j = 0; j < NB; ++j) {
        g[r][j] = _mm512_dpbf16_ps(g[r][j], xb, a[j]);
        u[r][j] = _mm512_dpbf16_ps(u[r][j], xb, b[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) {
      const __m512 gv = kvseal::widen16((__m256i)_mm512_cvtneps_pbh(g[r][j]));
      const __m512 uv = kvseal::widen16((__m256i)_mm512_cvtneps_pbh(u[r][j]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + 16 * j), kvseal::silu_mul16(gv, uv));
    }
}

template <int NB>
void panel_silu(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* wg, const uint16_t* wu, int64_t pairs,
                uint16_t* out, int64_t ldo) {
  const int64_t block = pairs * 32;
  int64_t i = 0;
  for (; i + 6 <= m; i += 6) micro_silu<6, NB>(x + i * ldx, ldx, wg, wu, pairs, block, out + i * ldo, ldo);
  const uint16_t* xi = x + i * ldx;
  uint16_t* oi = out + i * ldo;
  switch (m - i) {
    case 1: micro_silu<1, NB>(xi, ldx, wg, wu, pairs, block, oi, ldo); break;
    case 2: micro_silu<2, NB>(xi, ldx, wg, wu, pairs, block, oi, ldo); break;
    case 3: micro_silu<3, NB>(xi, ldx, wg, wu, pairs, block, oi, ldo); break;
    case 4: micro_silu<4, NB>(xi, ldx, wg, wu, pairs, block, oi, ldo); break;
    case 5: micro_silu<5, NB>(xi, ldx, wg, wu, pairs, block, oi, ldo); break;
    default: break;
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (the amx_bf16 level: Xeon Sapphire Rapids and later). The packed layout is already tdpbf16ps's B operand:
// 16 pairs of features of one block are 16 rows of 64 bytes (16 columns x 2), one tile, contiguous. A tile of x
// is up to 16 rows x 32 features, read in place. Every row goes through the tiles, one row as much as 512, so a
// row's result is the same whatever shares its step, as at the other levels: each output adds its 32-feature
// steps in order in fp32 and is rounded once (on a Xeon with AMX this is F.linear bit for bit at 32 rows and
// fewer: oneDNN computes with AMX too). Rows come in chunks of 32 (two row tiles); the last chunk's tiles are
// configured to its rows only, so a one-row step does one row's work.
// Tiles: 0-3 the sums (row tile 0 with column blocks 0 and 1, then row tile 1), 4-5 x, 6-7 the weights.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  // rows0: the rows of row tile 0 (tiles 0, 1 and 4); rows1: of row tile 1 (tiles 2, 3 and 5)
  TileConfig(int rows0, int rows1) {
    for (int t = 0; t < 8; ++t) colsb[t] = 64;
    rows[0] = rows[1] = rows[4] = static_cast<uint8_t>(rows0);
    rows[2] = rows[3] = rows[5] = static_cast<uint8_t>(rows1);
    rows[6] = rows[7] = 16;
  }
};

// Linux lends the 8 KB of tile state only to a process that asks (5.16 and later). kvseal.model.cpu asks first
// and does not load this level where Linux refuses; this second guard, asked once, keeps vdpbf16ps for the whole
// process if the answer were ever no here (results still do not depend on the step).
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// c[t * 256 ..] = the fp32 sums of row tile t / 2 and column block t % 2, as many rows as configured
template <int RT, int NB>
inline void amx_sums(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1, int64_t steps, float* c) {
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && NB == 2) _tile_zero(3);
  const uint16_t* a1 = a + 16 * lda;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, b0 + s * 512, 64);
    if constexpr (NB == 2) _tile_loadd(7, b1 + s * 512, 64);
    _tile_loadd(4, a + s * 32, 2 * lda);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, a1 + s * 32, 2 * lda);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (RT == 2 && NB == 2) _tile_stored(3, c + 768, 64);
}

// Hands out the tasks (each reads one or two packed blocks: blocks(t, b0, b1) sets them and says how many) one
// at a time, and for each, every chunk of up to 32 rows: f(t, first row, rows, blocks, the sums as amx_sums
// writes them).
template <typename B, typename F>
void amx_each(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, int64_t tasks, B&& blocks, F&& f) {
  const int64_t steps = k / 32, full = m - m % 32, rest = m % 32;
  const TileConfig whole(16, 16), last(rest < 16 ? rest : 16, rest > 16 ? rest - 16 : 16);
#pragma omp parallel
  {
    const TileConfig* loaded = nullptr;
    auto use = [&](const TileConfig& cfg) {
      if (loaded != &cfg) _tile_loadconfig(&cfg);
      loaded = &cfg;
    };
    alignas(64) float c[4 * 256];
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const uint16_t *b0, *b1;
      const int nb = blocks(t, b0, b1);
      for (int64_t r0 = 0; r0 < m; r0 += 32) {
        const int64_t rows = r0 < full ? 32 : rest;
        use(r0 < full ? whole : last);
        const uint16_t* a = x + r0 * ldx;
        if (rows > 16 && nb == 2)
          amx_sums<2, 2>(a, ldx, b0, b1, steps, c);
        else if (rows > 16)
          amx_sums<2, 1>(a, ldx, b0, b1, steps, c);
        else if (nb == 2)
          amx_sums<1, 2>(a, ldx, b0, b1, steps, c);
        else
          amx_sums<1, 1>(a, ldx, b0, b1, steps, c);
        f(t, r0, rows, nb, c);
      }
    }
    if (loaded != nullptr) _tile_release();
  }
}

inline __m256i rounded(const float* c) { return (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c)); }

void amx_gemm(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k, uint16_t* out) {
  const int64_t blocks = n / 16, block = k * 16;
  amx_each(x, ldx, m, k, (blocks + 1) / 2,
           [&](int64_t t, const uint16_t*& b0, const uint16_t*& b1) {
             b0 = packed + 2 * t * block;
             b1 = b0 + block;
             return blocks - 2 * t >= 2 ? 2 : 1;
           },
           [&](int64_t t, int64_t r0, int64_t rows, int nb, const float* c) {
             for (int64_t r = 0; r < rows; ++r)
               for (int j = 0; j < nb; ++j)
                 _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * n + 32 * t + 16 * j),
                                     rounded(c + ((r / 16) * 2 + j) * 256 + (r % 16) * 16));
           });
}

// act = silu(x @ Wg.T) * (x @ Wu.T): a task is block t of the gate half and block t of the up half
void amx_gemm_silu(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t inter, int64_t k,
                   uint16_t* out) {
  const int64_t blocks = inter / 16, block = k * 16;
  amx_each(x, ldx, m, k, blocks,
           [&](int64_t t, const uint16_t*& b0, const uint16_t*& b1) {
             b0 = packed + t * block;
             b1 = packed + (blocks + t) * block;
             return 2;
           },
           [&](int64_t t, int64_t r0, int64_t rows, int, const float* c) {
             for (int64_t r = 0; r < rows; ++r) {
               const float* g = c + ((r / 16) * 2) * 256 + (r % 16) * 16;
               _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * inter + 16 * t),
                                   kvseal::silu_mul16(kvseal::widen16(rounded(g)), kvseal::widen16(rounded(g + 256))));
             }
           });
}
#endif
}  // namespace

#if defined(__AVX2__)
// The wide kernel: bf16 weights widened in registers, fp32 FMAs, VW lanes (8 with AVX2, 16 with AVX-512 F).
namespace wide {
#if defined(__AVX512F__)
constexpr int VW = 16, RM = 8, NBM = 3;  // lanes, rows per micro-tile, blocks per panel (32 registers)
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf bcast(float v) { return _mm512_set1_ps(v); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void pairs(const uint16_t* p, vf& lo, vf& hi) {
  const __m512i d = _mm512_load_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store(float* o, vf v) { _mm512_storeu_ps(o, v); }
inline void store(uint16_t* o, vf v) { kvseal::store_bf16_16(o, kvseal::round_bf16_16(v)); }
#else
constexpr int VW = 8, RM = 4, NBM = 1;  // 16 registers: 8 accumulators, 4 widened weights, a broadcast
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf bcast(float v) { return _mm256_set1_ps(v); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void pairs(const uint16_t* p, vf& lo, vf& hi) {
  const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(d, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store(float* o, vf v) { _mm256_storeu_ps(o, v); }
inline void store(uint16_t* o, vf v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < 8; ++i) kvseal::from_f32(t[i], o + i);
}
#endif
constexpr int VB = 16 / VW;  // vectors per 16-column block

// Calls f(first row, std::integral_constant<int, rows>) for m rows in micro-tiles: tiles of RM rows, then one of
// the rest.
template <int R, typename F>
inline void rest_tile(int64_t left, int64_t i, F& f) {
  if constexpr (R > 0) {
    if (left == R) return f(i, std::integral_constant<int, R>{});
    rest_tile<R - 1>(left, i, f);
  }
}

template <typename F>
inline void each_tile(int64_t m, F&& f) {
  int64_t i = 0;
  for (; i + RM <= m; i += RM) f(i, std::integral_constant<int, RM>{});
  rest_tile<RM - 1>(m - i, i, f);
}

inline float xval(const float* x, int64_t i) { return x[i]; }
inline float xval(const uint16_t* x, int64_t i) { return kvseal::to_f32(x[i]); }

template <int R, int NB, typename TX, typename TO>
inline void micro(const TX* x, int64_t ldx, const uint16_t* wp, int64_t npairs, int64_t block, TO* out,
                  int64_t ldo) {
  constexpr int C = NB * VB;
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t k = 0; k < npairs; ++k) {
    vf lo[C], hi[C];
    for (int j = 0; j < NB; ++j)
      for (int v = 0; v < VB; ++v) pairs(wp + j * block + k * 32 + v * 2 * VW, lo[j * VB + v], hi[j * VB + v]);
    for (int r = 0; r < R; ++r) {
      const vf a = bcast(xval(x + r * ldx, 2 * k));
      for (int c = 0; c < C; ++c) acc[r][c] = fma(a, lo[c], acc[r][c]);
      const vf b = bcast(xval(x + r * ldx, 2 * k + 1));
      for (int c = 0; c < C; ++c) acc[r][c] = fma(b, hi[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + r * ldo + VW * c, acc[r][c]);
}

// int8 weights (weight-only, a scale per output column): block b holds, for each input feature, its 16 columns'
// int8 weights side by side ([n / 16][k][16] bytes, then the n fp32 scales). Each weight is widened to fp32 in
// registers; a column's sum runs over k in order, in fp32, and is scaled once at the end.
#if defined(__AVX512F__)
inline vf widen_q8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf mul(vf a, const float* s) { return _mm512_mul_ps(a, _mm512_loadu_ps(s)); }
#else
inline vf widen_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf mul(vf a, const float* s) { return _mm256_mul_ps(a, _mm256_loadu_ps(s)); }
#endif

template <int R, int NB, typename TX, typename TO>
inline void micro_q8(const TX* x, int64_t ldx, const int8_t* wp, int64_t k, const float* scales, TO* out,
                     int64_t ldo) {
  constexpr int C = NB * VB;
  const int64_t block = k * 16;
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t i = 0; i < k; ++i) {
    vf w[C];
    for (int j = 0; j < NB; ++j)
      for (int v = 0; v < VB; ++v) w[j * VB + v] = widen_q8(wp + j * block + i * 16 + v * VW);
    for (int r = 0; r < R; ++r) {
      const vf a = bcast(xval(x + r * ldx, i));
      for (int c = 0; c < C; ++c) acc[r][c] = fma(a, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + r * ldo + VW * c, mul(acc[r][c], scales + VW * c));
}

// One row (batch-1 decode) with 8 lanes: panels of 3 blocks, so that 6 independent sums hide the FMA latency
// (one block's 2 would wait on it); more rows fill the registers with rows instead.
template <typename TX, typename TO>
void gemm_q8(const TX* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k, TO* out) {
  const float* scales = reinterpret_cast<const float*>(packed + n * k);
  each_panel(n / 16, (NBM == 3 || m == 1) ? 3 : 1, [&](int64_t b0, auto nb) {
    each_tile(m, [&](int64_t i, auto r) {
      micro_q8<decltype(r)::value, decltype(nb)::value>(x + i * ldx, ldx, packed + b0 * k * 16, k, scales + b0 * 16,
                                                        out + i * n + b0 * 16, n);
    });
  });
}

// With 8 lanes, one or two rows take panels of 3 blocks for the same reason as gemm_q8 (a block's 2 sums a row
// would wait on the FMA latency; measured at one row: 18 -> 28 GB/s of weights on a Zen 4 held to AVX2). The
// sums are the same whatever the panel: each output still adds its products in order of k.
template <typename TX, typename TO>
void gemm(const TX* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k, TO* out) {
  const int64_t npairs = k / 2;
  each_panel(n / 16, (NBM == 3 || m <= 2) ? 3 : 1, [&](int64_t b0, auto nb) {
    each_tile(m, [&](int64_t i, auto r) {
      micro<decltype(r)::value, decltype(nb)::value>(x + i * ldx, ldx, packed + b0 * npairs * 32, npairs,
                                                     npairs * 32, out + i * n + b0 * 16, n);
    });
  });
}

// int4 weights (weight-only, groups of 32 along k, GGUF Q4_1's grid: w = code * scale + min, code 0..15, scale
// and min bf16 per group and column). Block b of 16 columns holds, for each group, 32 rows of 8 bytes (byte j:
// column j's code in its low nibble, column j + 8's in its high one), then the 16 scales and the 16 mins:
// [n / 16][k / 32][256 + 64] bytes. A column's sum over a group adds x * code in order of k in fp32 (codes are
// exact in fp32), then adds scale * that + min * (the group's sum of x), group after group: the same for any
// number of rows.
#if defined(__AVX512F__)
inline void widen_q4(const uint8_t* p, vf* w) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(15);
  const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both));
}
inline void widen_bf16(const uint16_t* p, vf* w) { w[0] = kvseal::widen16(p); }
#else
inline void widen_q4(const uint8_t* p, vf* w) {
  const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
  w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
}
inline void widen_bf16(const uint16_t* p, vf* w) {
  for (int v = 0; v < 2; ++v)
    w[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * v))), 16));
}
#endif
constexpr int64_t Q4_GROUP = 32, Q4_GROUP_BYTES = Q4_GROUP * 8 + 64;

// xsum [m][groups]: each row's sum of x over each group, made once per call (in order, so a row's sums do not
// depend on the other rows)
template <int R, int NB, typename TX, typename TO>
inline void micro_q4(const TX* x, int64_t ldx, const float* xsum, const uint8_t* wp, int64_t groups, TO* out,
                     int64_t ldo) {
  constexpr int C = NB * VB;
  const int64_t block = groups * Q4_GROUP_BYTES;
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    vf part[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) part[r][c] = zero();
    const uint8_t* wg = wp + g * Q4_GROUP_BYTES;
    for (int64_t i = 0; i < Q4_GROUP; ++i) {
      vf w[C];
      for (int j = 0; j < NB; ++j) widen_q4(wg + j * block + i * 8, w + j * VB);
      for (int r = 0; r < R; ++r) {
        const vf a = bcast(xval(x + r * ldx, g * Q4_GROUP + i));
        for (int c = 0; c < C; ++c) part[r][c] = fma(a, w[c], part[r][c]);
      }
    }
    vf scale[C], mins[C];
    for (int j = 0; j < NB; ++j) {
      const uint16_t* sz = reinterpret_cast<const uint16_t*>(wg + j * block + Q4_GROUP * 8);
      widen_bf16(sz, scale + j * VB);
      widen_bf16(sz + 16, mins + j * VB);
    }
    for (int r = 0; r < R; ++r) {
      const vf s = bcast(xsum[r * groups + g]);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(mins[c], s, fma(part[r][c], scale[c], acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(out + r * ldo + VW * c, acc[r][c]);
}

// One row: panels of 3 blocks, as gemm_q8 (with 8 lanes, one row at 2 blocks measured 17.0 against 19.3
// Gweights/s); more rows one block (each row keeps a group's partial sums beside its accumulators).
template <typename TX, typename TO>
void gemm_q4(const TX* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n, int64_t k, TO* out) {
  const int64_t groups = k / Q4_GROUP;
  std::vector<float> sums(static_cast<size_t>(m * groups));
  float* xsum = sums.data();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < Q4_GROUP; ++i) s += xval(x + r * ldx, g * Q4_GROUP + i);
      xsum[r * groups + g] = s;
    }
  each_panel(n / 16, (NBM == 3 || m == 1) ? 3 : 1, [&](int64_t b0, auto nb) {
    each_tile(m, [&](int64_t i, auto r) {
      micro_q4<decltype(r)::value, decltype(nb)::value>(x + i * ldx, ldx, xsum + i * groups,
                                                        packed + b0 * groups * Q4_GROUP_BYTES, groups,
                                                        out + i * n + b0 * 16, n);
    });
  });
}
}  // namespace wide
#endif

extern "C" {

int kvseal_gemm_supported(int64_t n, int64_t k) {
#if defined(__AVX2__)
  return n > 0 && k > 0 && n % 16 == 0 && k % 2 == 0;
#else
  (void)n, (void)k;
  return 0;
#endif
}

// w [n, k] row-major bf16 -> packed [n / 16][k / 2][16][2] (the caller allocates n * k values, 64-byte aligned)
void kvseal_gemm_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t pairs = k / 2;
#pragma omp parallel for
  for (int64_t b = 0; b < n / 16; ++b)
    for (int64_t p = 0; p < pairs; ++p)
      for (int c = 0; c < 16; ++c) {
        uint16_t* dst = packed + ((b * pairs + p) * 16 + c) * 2;
        const uint16_t* src = w + (b * 16 + c) * k + 2 * p;
        dst[0] = src[0];
        dst[1] = src[1];
      }
}

// out [m, n] = x [m, k] (row stride ldx) @ W.T, W packed by kvseal_gemm_pack_bf16
void kvseal_gemm_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k,
                      uint16_t* out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (k % 32 == 0 && amx_ready()) return amx_gemm(x, ldx, m, packed, n, k, out);
#endif
#if defined(__AVX512BF16__)
  const int64_t pairs = k / 2;
  each_panel(n / 16, 3, [&](int64_t b0, auto nb) {
    panel<decltype(nb)::value>(x, ldx, m, packed + b0 * pairs * 32, pairs, out + b0 * 16, n);
  });
#elif defined(__AVX2__)
  wide::gemm(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

// out [m, n] fp32 = x [m, k] fp32 (row stride ldx) @ W.T, W bf16 packed by kvseal_gemm_pack_bf16: fp32 compute
// with the weights read as bf16
void kvseal_gemm_f32(const float* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t n, int64_t k,
                     float* out) {
#if defined(__AVX2__)
  wide::gemm(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

// int8 weights: q [n, k] int8 row-major and scales [n] fp32 -> packed [n / 16][k][16] int8, then the n scales
// (the caller allocates n * k + 4 n bytes, 64-byte aligned). Same shapes as kvseal_gemm_supported.
void kvseal_gemm_pack_q8(const int8_t* q, const float* scales, int64_t n, int64_t k, int8_t* packed) {
#pragma omp parallel for
  for (int64_t b = 0; b < n / 16; ++b)
    for (int64_t i = 0; i < k; ++i)
      for (int c = 0; c < 16; ++c) packed[(b * k + i) * 16 + c] = q[(b * 16 + c) * k + i];
  std::memcpy(packed + n * k, scales, static_cast<size_t>(n) * sizeof(float));
}

// out [m, n] = x [m, k] @ (q * scales).T, q packed by kvseal_gemm_pack_q8: each weight widened to fp32, fp32
// FMAs in order of k, the column's scale applied once; bf16 x gives a bf16 out (rounded once), fp32 x fp32
void kvseal_gemm_q8_bf16(const uint16_t* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k,
                         uint16_t* out) {
#if defined(__AVX2__)
  wide::gemm_q8(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

void kvseal_gemm_q8_f32(const float* x, int64_t ldx, int64_t m, const int8_t* packed, int64_t n, int64_t k,
                        float* out) {
#if defined(__AVX2__)
  wide::gemm_q8(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

// act [m, inter] = silu(x @ Wg.T) * (x @ Wu.T), rounded as gemm then silu_mul round, where the packed weight
// (kvseal_gemm_pack_bf16) is [gate; up], [2 inter, k]. Needs inter a multiple of 16 (kvseal_gemm_silu_supported).
int kvseal_gemm_silu_supported(int64_t inter, int64_t k) {
#if defined(__AVX512BF16__)
  return inter > 0 && k > 0 && inter % 16 == 0 && k % 2 == 0;
#else
  (void)inter, (void)k;
  return 0;
#endif
}

void kvseal_gemm_silu_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* packed, int64_t inter,
                           int64_t k, uint16_t* out) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (k % 32 == 0 && amx_ready()) return amx_gemm_silu(x, ldx, m, packed, inter, k, out);
#endif
#if defined(__AVX512BF16__)
  const int64_t blocks = inter / 16, panels = (blocks + 1) / 2, pairs = k / 2;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t b0 = 2 * p;
    const uint16_t* wg = packed + b0 * pairs * 32;
    const uint16_t* wu = packed + (blocks + b0) * pairs * 32;
    if (blocks - b0 >= 2)
      panel_silu<2>(x, ldx, m, wg, wu, pairs, out + b0 * 16, inter);
    else
      panel_silu<1>(x, ldx, m, wg, wu, pairs, out + b0 * 16, inter);
  }
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)inter, (void)k, (void)out;
#endif
}

// int4 weights: the shapes the int4 kernel takes (n a multiple of 16, k of 32)
int kvseal_gemm_q4_supported(int64_t n, int64_t k) {
#if defined(__AVX2__)
  return n > 0 && k > 0 && n % 16 == 0 && k % 32 == 0;
#else
  (void)n, (void)k;
  return 0;
#endif
}

// codes [n, k] uint8 (0..15), scales and mins [n, k / 32] bf16 -> packed [n / 16][k / 32][256 + 64] bytes (the
// layout of wide::micro_q4; the caller allocates n * k / 2 + n * k / 8 bytes, 64-byte aligned)
void kvseal_gemm_pack_q4(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, int64_t n, int64_t k,
                         uint8_t* packed) {
  const int64_t groups = k / 32, group_bytes = 32 * 8 + 64;
#pragma omp parallel for
  for (int64_t b = 0; b < n / 16; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* dst = packed + (b * groups + g) * group_bytes;
      for (int64_t i = 0; i < 32; ++i)
        for (int c = 0; c < 8; ++c) {
          const int64_t col = b * 16 + c, at = g * 32 + i;
          dst[i * 8 + c] = static_cast<uint8_t>((codes[col * k + at] & 15) | (codes[(col + 8) * k + at] & 15) << 4);
        }
      uint16_t* sz = reinterpret_cast<uint16_t*>(dst + 32 * 8);
      for (int c = 0; c < 16; ++c) {
        sz[c] = scales[(b * 16 + c) * groups + g];
        sz[16 + c] = mins[(b * 16 + c) * groups + g];
      }
    }
}

// out [m, n] = x [m, k] @ W.T, W the int4 weights packed by kvseal_gemm_pack_q4; bf16 x gives a bf16 out
// (rounded once), fp32 x fp32
void kvseal_gemm_q4_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n, int64_t k,
                         uint16_t* out) {
#if defined(__AVX2__)
  wide::gemm_q4(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

void kvseal_gemm_q4_f32(const float* x, int64_t ldx, int64_t m, const uint8_t* packed, int64_t n, int64_t k,
                        float* out) {
#if defined(__AVX2__)
  wide::gemm_q4(x, ldx, m, packed, n, k, out);
#else
  (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)out;
#endif
}

}  // extern "C"
