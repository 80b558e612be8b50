// The kernels against scalar references, without Python: built with the kernel sources at one level's flags
// (natively, or cross-compiled for aarch64 and run under qemu-aarch64), so an architecture this project has no
// machine of still runs its kernel tests (tests/test_native.py). Each check prints one line; the last line is
// "N passed, M failed" and the exit code is the number failed.
//
// The references are written the plain way (one loop per formula, fp32 sums, rounded to the storage type where
// the PyTorch reference rounds); the tolerances are those of tests/test_kernels.py.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../../kvseal/model/csrc/common.h"

extern "C" {
void kvseal_decode_attention_bf16(const uint16_t*, int64_t, const uint16_t*, uint16_t*, const int64_t*, const int64_t*,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
void kvseal_decode_attention_f32(const float*, int64_t, const float*, float*, const int64_t*, const int64_t*, int64_t,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
void kvseal_add_rms_norm_bf16(uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, float);
void kvseal_add_rms_norm_f32(float*, const float*, const float*, float*, int64_t, int64_t, float);
void kvseal_rope_store_bf16(uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
                            const int64_t*, uint16_t*, const int64_t*, int64_t, int64_t, int64_t);
void kvseal_rope_store_f32(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
                           const int64_t*, float*, const int64_t*, int64_t, int64_t, int64_t);
void kvseal_silu_mul_bf16(const uint16_t*, uint16_t*, int64_t, int64_t);
void kvseal_silu_mul_f32(const float*, float*, int64_t, int64_t);
int kvseal_gemm_supported(int64_t, int64_t);
void kvseal_gemm_pack_bf16(const uint16_t*, int64_t, int64_t, uint16_t*);
void kvseal_gemm_bf16(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*);
void kvseal_gemm_f32(const float*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*);
int kvseal_prefill_supported(int64_t, int64_t, int64_t, int64_t);
int kvseal_prefill_attention_bf16(const uint16_t*, int64_t, const uint16_t*, uint16_t*, const int64_t*, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
const char* kvseal_level();
}

namespace {
using kvseal::from_f32;
using kvseal::to_f32;

int passed = 0, failed = 0;

void report(bool ok, const char* what, double err) {
  std::printf("%s %s (max error %.3g)\n", ok ? "PASS" : "FAIL", what, err);
  (ok ? passed : failed) += 1;
}

uint64_t seed = 12345;
float rnd() {  // uniform in [-1, 1)
  seed = seed * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<float>((seed >> 40) & 0xffffff) / 8388608.f - 1.f;
}
template <typename T>
std::vector<T> randoms(size_t n, float scale = 1.f) {
  std::vector<T> v(n);
  for (auto& x : v) from_f32(scale * rnd(), &x);
  return v;
}
template <typename T>
float tol(float f32, float b16) {
  return sizeof(T) == 4 ? f32 : b16;
}
template <typename T>
float rel(float got, float ref) {
  return std::fabs(got - ref) / (std::fabs(ref) + 1e-3f);
}

template <typename T>
void decode_fn(const T* q, int64_t qs, const T* kv, T* out, const int64_t* pages, const int64_t* lens, int64_t b,
               int64_t w, int64_t h, int64_t kvh, int64_t d, int64_t ps, int64_t layers, int64_t layer, float sc) {
  if constexpr (sizeof(T) == 4)
    kvseal_decode_attention_f32(q, qs, kv, out, pages, lens, b, w, h, kvh, d, ps, layers, layer, sc);
  else
    kvseal_decode_attention_bf16(q, qs, kv, out, pages, lens, b, w, h, kvh, d, ps, layers, layer, sc);
}

// softmax(q . k / sqrt(d)) v over a request's first len positions, fp32, pool kv[page, layer, 0|1, kvh, slot, d]
template <typename T>
void attend_ref(const T* q, const T* kv, const int64_t* pages, int64_t len, int64_t kvh, int64_t d, int64_t ps,
                int64_t layers, int64_t layer, int64_t h, float* out) {
  std::vector<float> s(len);
  float mx = -INFINITY;
  auto at = [&](int64_t pos, int kind, int64_t i) {
    return to_f32(kv[((((pages[pos / ps] * layers + layer) * 2 + kind) * kvh + h) * ps + pos % ps) * d + i]);
  };
  for (int64_t t = 0; t < len; ++t) {
    float dot = 0.f;
    for (int64_t i = 0; i < d; ++i) dot += to_f32(q[i]) * at(t, 0, i);
    s[t] = dot / std::sqrt(static_cast<float>(d));
    mx = std::fmax(mx, s[t]);
  }
  float sum = 0.f;
  for (auto& x : s) sum += (x = std::exp(x - mx));
  for (int64_t i = 0; i < d; ++i) {
    float a = 0.f;
    for (int64_t t = 0; t < len; ++t) a += s[t] * at(t, 1, i);
    out[i] = a / sum;
  }
}

template <typename T>
void check_decode(int64_t heads, int64_t kvh, int64_t d, int64_t ps) {
  // 300 tokens: an fp32 pool's rows over 128 tokens run as spans merged after
  const int64_t layers = 2, b = 5, g = heads / kvh;
  const int64_t lens[b] = {1, ps + 1, 5 * ps - 3, 37, 300};
  const int64_t w = (300 + ps - 1) / ps;
  int64_t n_pages = b * w + 1;
  while (n_pages % 7 == 0) ++n_pages;  // so that the pages below are distinct
  std::vector<int64_t> pages(b * w);
  for (int64_t i = 0; i < b * w; ++i) pages[i] = (i * 7 + 3) % n_pages;  // scattered, distinct
  auto kv = randoms<T>(n_pages * layers * 2 * kvh * ps * d);
  auto q = randoms<T>(b * heads * d);
  std::vector<T> out(b * heads * d);
  decode_fn(q.data(), heads * d, kv.data(), out.data(), pages.data(), lens, b, w, heads, kvh, d, ps, layers, 1,
            1.f / std::sqrt(static_cast<float>(d)));
  double err = 0;
  std::vector<float> ref(d);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t hh = 0; hh < heads; ++hh) {
      attend_ref(q.data() + (r * heads + hh) * d, kv.data(), pages.data() + r * w, lens[r], kvh, d, ps, layers, 1,
                 hh / g, ref.data());
      for (int64_t i = 0; i < d; ++i) err = std::fmax(err, std::fabs(to_f32(out[(r * heads + hh) * d + i]) - ref[i]));
    }
  char what[96];
  std::snprintf(what, sizeof what, "decode attention %s heads %lld/%lld dim %lld page %lld", sizeof(T) == 4 ? "f32" : "bf16",
                static_cast<long long>(heads), static_cast<long long>(kvh), static_cast<long long>(d),
                static_cast<long long>(ps));
  report(err <= tol<T>(1e-5f, 2e-2f), what, err);
}

template <typename T>
void check_rms_norm() {
  const int64_t n = 7, hidden = 576;
  auto x = randoms<T>(n * hidden, 2.f), delta = randoms<T>(n * hidden), w = randoms<T>(hidden);
  auto x_ref = x;
  std::vector<T> out(n * hidden);
  if constexpr (sizeof(T) == 4)
    kvseal_add_rms_norm_f32(x.data(), delta.data(), w.data(), out.data(), n, hidden, 1e-5f);
  else
    kvseal_add_rms_norm_bf16(x.data(), delta.data(), w.data(), out.data(), n, hidden, 1e-5f);
  double err = 0;
  for (int64_t i = 0; i < n; ++i) {
    float ss = 0.f;
    for (int64_t j = 0; j < hidden; ++j) {
      T* xr = &x_ref[i * hidden + j];
      from_f32(to_f32(*xr) + to_f32(delta[i * hidden + j]), xr);
      ss += to_f32(*xr) * to_f32(*xr);
      err = std::fmax(err, std::fabs(to_f32(x[i * hidden + j]) - to_f32(*xr)));  // the in-place residual add
    }
    const float r = 1.f / std::sqrt(ss / hidden + 1e-5f);
    for (int64_t j = 0; j < hidden; ++j) {
      const float xn = kvseal::rounded(to_f32(x_ref[i * hidden + j]) * r, &x_ref[0]);
      err = std::fmax(err, rel<T>(to_f32(out[i * hidden + j]), to_f32(w[j]) * xn));
    }
  }
  report(err <= tol<T>(1e-5f, 1e-2f), sizeof(T) == 4 ? "add + rms_norm f32" : "add + rms_norm bf16", err);
}

template <typename T>
void check_silu_mul() {
  const int64_t n = 3, inter = 1544;  // a tail past every vector width
  auto gu = randoms<T>(n * 2 * inter, 4.f);
  std::vector<T> out(n * inter);
  if constexpr (sizeof(T) == 4)
    kvseal_silu_mul_f32(gu.data(), out.data(), n, inter);
  else
    kvseal_silu_mul_bf16(gu.data(), out.data(), n, inter);
  double err = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < inter; ++j) {
      const float g = to_f32(gu[i * 2 * inter + j]), u = to_f32(gu[i * 2 * inter + inter + j]);
      const float ref = kvseal::rounded(g / (1.f + std::exp(-g)), &gu[0]) * u;
      err = std::fmax(err, rel<T>(to_f32(out[i * inter + j]), ref));
    }
  report(err <= tol<T>(1e-5f, 1e-2f), sizeof(T) == 4 ? "silu * up f32" : "silu * up bf16", err);
}

// x * cos + roll(x, dim / 2) * signed_sin for query and key heads, each product rounded, then K/V stored
template <typename T>
void check_rope_store() {
  const int64_t n = 5, heads = 9, kvh = 3, d = 64, ps = 16, layers = 2, positions_max = 64, n_pages = 4;
  const int64_t row = (heads + 2 * kvh) * d;
  auto qkv = randoms<T>(n * row, 3.f), cs = randoms<T>(positions_max * d), sn = randoms<T>(positions_max * d);
  auto kv = randoms<T>(n_pages * layers * 2 * kvh * ps * d);
  const int64_t pos[n] = {0, 3, 17, 40, 63}, slots[n] = {5, 16, 33, 62, 1};
  auto ref = qkv;
  auto kv_ref = kv;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads + kvh; ++h) {
      const T* x = &qkv[i * row + h * d];
      for (int64_t j = 0; j < d; ++j) {
        const T c = cs[pos[i] * d + j], s = sn[pos[i] * d + j];
        const float a = kvseal::rounded(to_f32(x[j]) * to_f32(c), x);
        const float b = kvseal::rounded(to_f32(x[(j + d / 2) % d]) * to_f32(s), x);
        from_f32(a + b, &ref[i * row + h * d + j]);
      }
    }
    for (int64_t h = 0; h < kvh; ++h)
      for (int64_t kind = 0; kind < 2; ++kind)
        for (int64_t j = 0; j < d; ++j)
          kv_ref[((((slots[i] / ps) * layers + 1) * 2 + kind) * kvh + h) * ps * d + (slots[i] % ps) * d + j] =
              ref[i * row + (heads + kind * kvh + h) * d + j];
  }
  if constexpr (sizeof(T) == 4)
    kvseal_rope_store_f32(qkv.data(), n, row, heads, kvh, d, cs.data(), sn.data(), pos, kv.data(), slots, layers, 1, ps);
  else
    kvseal_rope_store_bf16(qkv.data(), n, row, heads, kvh, d, cs.data(), sn.data(), pos, kv.data(), slots, layers, 1,
                           ps);
  const bool same = std::memcmp(qkv.data(), ref.data(), qkv.size() * sizeof(T)) == 0 &&
                    std::memcmp(kv.data(), kv_ref.data(), kv.size() * sizeof(T)) == 0;
  report(same, sizeof(T) == 4 ? "rope + store f32 (bit for bit)" : "rope + store bf16 (bit for bit)", same ? 0 : 1);
}

void check_gemm() {
  const int64_t n = 160, k = 96;
  if (!kvseal_gemm_supported(n, k)) {
    std::printf("SKIP gemm (not built at level %s)\n", kvseal_level());
    return;
  }
  auto w = randoms<uint16_t>(n * k, 0.1f);
  std::vector<uint16_t> packed(n * k + 32);
  uint16_t* p = packed.data();
  while (reinterpret_cast<uintptr_t>(p) % 64) ++p;  // the kernel loads packed blocks aligned
  kvseal_gemm_pack_bf16(w.data(), n, k, p);
  for (int64_t m : {1, 5, 13}) {
    auto xb = randoms<uint16_t>(m * k);
    auto xf = randoms<float>(m * k);  // full fp32 values: products not exact, so FMA and mul + add differ
    std::vector<float> outf(m * n);
    std::vector<uint16_t> outb(m * n);
    kvseal_gemm_bf16(xb.data(), k, m, p, n, k, outb.data());
    kvseal_gemm_f32(xf.data(), k, m, p, n, k, outf.data());
    double eb = 0, ef = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float rb = 0.f, mb = 0.f, rf = 0.f, mf = 0.f;
        for (int64_t t = 0; t < k; ++t) {
          rb += to_f32(xb[i * k + t]) * to_f32(w[j * k + t]);
          mb += std::fabs(to_f32(xb[i * k + t]) * to_f32(w[j * k + t]));
          rf += xf[i * k + t] * to_f32(w[j * k + t]);
          mf += std::fabs(xf[i * k + t] * to_f32(w[j * k + t]));
        }
        eb = std::fmax(eb, std::fabs(to_f32(outb[i * n + j]) - rb) / (std::fabs(rb) * 0.0079 + mb * 1e-6));
        ef = std::fmax(ef, std::fabs(outf[i * n + j] - rf) / (mf * 1e-6 + 1e-30));
      }
    report(eb <= 1.0, "gemm bf16 (error in bf16 steps)", eb);
    report(ef <= 1.0, "gemm f32 (error in millionths of the sum of |products|)", ef);
  }
}

void check_prefill() {
  const int64_t heads = 9, kvh = 3, d = 64, ps = 16, layers = 1, pos0 = 20, n = 30, n_pages = 8;
  if (!kvseal_prefill_supported(heads, kvh, d, ps)) {
    std::printf("SKIP prefill attention (not built at level %s)\n", kvseal_level());
    return;
  }
  std::vector<int64_t> pages = {5, 2, 7, 0};
  auto kv = randoms<uint16_t>(n_pages * layers * 2 * kvh * ps * d);
  auto q = randoms<uint16_t>(n * heads * d);
  std::vector<uint16_t> out(n * heads * d);
  kvseal_prefill_attention_bf16(q.data(), heads * d, kv.data(), out.data(), pages.data(), n, pos0, heads, kvh, d, ps,
                                layers, 0, 1.f / std::sqrt(static_cast<float>(d)));
  double err = 0;
  std::vector<float> ref(d);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t hh = 0; hh < heads; ++hh) {
      attend_ref(q.data() + (r * heads + hh) * d, kv.data(), pages.data(), pos0 + r + 1, kvh, d, ps, layers, 0,
                 hh / (heads / kvh), ref.data());
      for (int64_t i = 0; i < d; ++i) err = std::fmax(err, std::fabs(to_f32(out[(r * heads + hh) * d + i]) - ref[i]));
    }
  report(err <= 2e-2, "prefill attention bf16", err);
}
}  // namespace

int main() {
  std::printf("kernels built for level %s\n", kvseal_level());
  for (auto [h, kvh, d, ps] : {std::array<int64_t, 4>{9, 3, 64, 16}, {8, 8, 32, 16}, {12, 2, 128, 16},
                               {8, 8, 32, 4}, {18, 2, 64, 16}}) {
    check_decode<float>(h, kvh, d, ps);
    check_decode<uint16_t>(h, kvh, d, ps);
  }
  check_rms_norm<float>();
  check_rms_norm<uint16_t>();
  check_rope_store<float>();
  check_rope_store<uint16_t>();
  check_silu_mul<float>();
  check_silu_mul<uint16_t>();
  check_gemm();
  check_prefill();
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed;
}
