// The CPU backend's fused ops (float32 and bfloat16; bf16 values are computed in float32 and
// rounded where the torch refs round, nearest-even): each replaces a chain of small torch ops whose
// dispatch, not arithmetic, dominated a decode step (kernels/cpu_native.py says why and
// when each is used). Built once per machine with -O3 -march=native; loops are written with
// OpenMP simd reductions where a sum must be reordered to vectorize, never -ffast-math (which
// would also assume no infinities, and attention masks with them).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// sum(x[i] * y[i]). `omp simd reduction` lets the compiler reorder this one sum into vector
// lanes (built with -fopenmp); everything else keeps IEEE order.
inline float dot(const float* __restrict__ x, const float* __restrict__ y, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

// e^x for float32, Cephes' range reduction and polynomial: within 2 ulp of expf over the
// range where it is finite, -inf -> 0. Branch-free so that loops over it vectorize.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3365f), 88.7228f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e * two_n;
}

using bf16 = c10::BFloat16;
using f16 = c10::Half;  // a float16 KV cache beside float32 activations (--kv-cache-dtype float16)

// The float32 vector the tile matmul, decode attention and the elementwise ops are written in: a zmm (16 lanes) on
// AVX-512 builds, a ymm (8 lanes) on AVX2 + FMA ones (PAGEBUS_SIMD: either). AVX2 has 16 vector
// registers where AVX-512 has 32, so the kernels' blockings depend on which (kTileVecs, HC).
#if defined(__AVX512F__)
#define PAGEBUS_SIMD 1
using vf = __m512;
constexpr int64_t kLanes = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEBUS_SIMD 1
using vf = __m256;
constexpr int64_t kLanes = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
#else
constexpr int64_t kLanes = 16;  // no kernel of this file vectorises by hand; only the tile size
#endif

// A float16 cache's values as float32 vectors (exact) and float32 vectors rounded to float16
// (nearest even): one F16C/AVX-512 instruction each way, so a half-size cache costs the
// attention kernels a conversion per load where it halves the bytes they stream from DRAM.
#if defined(PAGEBUS_SIMD) && (defined(__AVX512F__) || defined(__F16C__))
#define PAGEBUS_F16 1
#ifdef __AVX512F__
inline vf vload(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore(f16* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
inline vf vload(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void vstore(f16* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
// n float32 values into a float16 row (the cache writes).
inline void store_f16_row(const float* src, f16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = static_cast<f16>(src[i]);
}
#endif

#ifdef PAGEBUS_SIMD
// e^x lane by lane: fast_exp's range reduction and polynomial. (fast_exp's own loops stay scalar:
// GCC does not vectorise its nearbyint and bit cast, so softmax and SiLU call this.)
inline vf vexp(vf x) {
#ifdef __AVX512F__
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.7228f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const vf two_n = _mm512_castsi512_ps(bits);
#else
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.7228f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const vf two_n = _mm256_castsi256_ps(bits);
#endif
  const vf r = vfmadd(n, vset1(2.12194440e-4f), vfmadd(n, vset1(-0.693359375f), x));
  vf p = vset1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = vfmadd(p, r, vset1(c));
  return vmul(vadd(vfmadd(vmul(p, r), r, r), vset1(1.0f)), two_n);
}

// v materialised in a register here. Where RB rows each multiply one loaded vector, GCC folds
// the load into every row's FMA as a memory operand: RB loads of it, and a loop of 8 FMAs with
// 12 loads is bound by the 2 vector loads a cycle of AVX2 cores (Zen 3) rather than by the FMAs.
inline void in_register(vf& v) { asm("" : "+x"(v)); }

inline float hsum(vf v) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, v);
  float s = 0.f;
  for (float x : lanes) s += x;
  return s;
}
#endif  // PAGEBUS_SIMD


inline float f32(float x) { return x; }
inline float f32(bf16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x) {
  return static_cast<T>(x);  // c10::BFloat16's constructor rounds to nearest even
}

#ifdef __AVX512F__
// 16 bf16 values as float32 (exact: the bits shifted into the high half).
inline __m512 widen16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// v rounded to bf16 as c10::BFloat16's constructor rounds (nearest even, a NaN to 0x7FC0), bit
// for bit, denormals included (vcvtneps2bf16 flushes those), held as float32.
inline __m512 round_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
// 16 values round_bf16 gave, stored as bf16.
inline void store_rounded16(bf16* p, __m512 rounded) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif

// float32 and bfloat16 CPU tensors, all of one dtype, are the compiled ops' cases.
torch::ScalarType check_dtype(std::initializer_list<const torch::Tensor*> ts, const char* what) {
  const auto st = (*ts.begin())->scalar_type();
  for (const torch::Tensor* t : ts)
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == st &&
                    (st == torch::kFloat32 || st == torch::kBFloat16),
                what, ": float32 or bfloat16 CPU tensors of one dtype expected");
  return st;
}

#define DISPATCH(st, ...)                   \
  if ((st) == torch::kFloat32) {            \
    using T = float;                        \
    __VA_ARGS__;                            \
  } else {                                  \
    using T = bf16;                         \
    __VA_ARGS__;                            \
  }

// Whether this build holds float16 beside float32 activations: KV caches it reads and writes
// (--kv-cache-dtype float16) and weight tiles it multiplies (--quantization fp16).
bool f16_built() {
#ifdef PAGEBUS_F16
  return true;
#else
  return false;
#endif
}

// K and V caches of the activations' dtype st, or float16 beside float32 (where this build has
// F16C); true for the latter.
bool check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, torch::ScalarType st, const char* what) {
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && v_cache.scalar_type() == ct, what,
              ": K and V caches must be CPU tensors of one dtype");
  if (ct == st) return false;
  TORCH_CHECK(ct == torch::kHalf && st == torch::kFloat32 && f16_built(), what,
              ": caches must have the activations' dtype, or float16 beside float32 (on CPUs with F16C)");
  return true;
}

// Row r of `x` as float32 (bf16 widened into `buf`; float32 read in place).
inline const float* as_f32(const float* x, int64_t, float*) { return x; }
inline const float* as_f32(const bf16* x, int64_t n, float* buf) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(buf + i, widen16(x + i));
#endif
  for (; i < n; ++i) buf[i] = static_cast<float>(x[i]);
  return buf;
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps), rounded to T, times w (rms_norm_ref's order).
template <typename T>
void norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(std::is_same<T, float>::value ? 0 : static_cast<size_t>(h));  // float32 is read in place
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = as_f32(x + r * x_stride, h, buf.data());
      const float inv = 1.0f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + eps);
      T* o = out + r * h;
      int64_t i = 0;
#ifdef __AVX512F__
      if constexpr (std::is_same_v<T, bf16>)  // the loop below, 16 at a time (GCC leaves it scalar)
        for (const __m512 iv = _mm512_set1_ps(inv); i + 16 <= h; i += 16)
          store_rounded16(o + i, round_bf16(_mm512_mul_ps(round_bf16(_mm512_mul_ps(_mm512_loadu_ps(xr + i), iv)),
                                                          widen16(w + i))));
#endif
      for (; i < h; ++i) o[i] = from_f32<T>(f32(from_f32<T>(xr[i] * inv)) * f32(w[i]));
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const auto st = check_dtype({&x, &w}, "rms_norm");
  const int64_t h = x.size(-1);
  auto x2 = x.reshape({-1, h});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto wc = w.contiguous();
  auto out = torch::empty({x2.size(0), h}, x.options());
  DISPATCH(st, norm_rows<T>(x2.data_ptr<T>(), x2.stride(0), wc.data_ptr<T>(), out.data_ptr<T>(), x2.size(0), h,
                            static_cast<float>(eps)));
  return out.view(x.sizes());
}

namespace {
// sum = x + residual (rounded to T), out = norm(sum) * w, over `rows` contiguous rows of h (sum
// may be residual itself: each element is read before it is written).
template <typename T>
void add_norm_rows(const T* xp, const T* rp, const T* w, T* sp, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows * h, 1 << 14, [&](int64_t a, int64_t b) {
    int64_t i = a;
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, bf16>)
      for (; i + 16 <= b; i += 16) store_rounded16(sp + i, round_bf16(_mm512_add_ps(widen16(xp + i), widen16(rp + i))));
#endif
    for (; i < b; ++i) sp[i] = from_f32<T>(f32(xp[i]) + f32(rp[i]));
  });
  norm_rows<T>(sp, h, w, out, rows, h, eps);
}
}  // namespace

// (norm(x + residual) * w, x + residual): the decoder's pre-norm with its residual stream.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const auto st = check_dtype({&x, &residual, &w}, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  const int64_t h = x.size(-1);
  auto x2 = x.reshape({-1, h}).contiguous();
  auto r2 = residual.reshape({-1, h}).contiguous();
  auto wc = w.contiguous();
  const int64_t rows = x2.size(0);
  auto sum = torch::empty({rows, h}, x.options());
  auto out = torch::empty({rows, h}, x.options());
  DISPATCH(st, add_norm_rows<T>(x2.data_ptr<T>(), r2.data_ptr<T>(), wc.data_ptr<T>(), sum.data_ptr<T>(),
                                out.data_ptr<T>(), rows, h, static_cast<float>(eps)));
  return {out.view(x.sizes()), sum.view(x.sizes())};
}

// silu_and_mul's row in whole vectors (float32 on PAGEBUS_SIMD builds: the scalar loop does not
// vectorise, fast_exp); returns how many elements it did.
template <typename T>
inline int64_t silu_and_mul_vectors(const T*, const T*, T*, int64_t) { return 0; }
#ifdef PAGEBUS_SIMD
inline int64_t silu_and_mul_vectors(const float* g, const float* u, float* o, int64_t d) {
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    const vf gv = vload(g + i);
    vstore(o + i, vmul(vdiv(gv, vadd(vset1(1.0f), vexp(vsub(vzero(), gv)))), vload(u + i)));
  }
  return i;
}
#ifdef __AVX512F__
// bf16: the same in float32, silu's result and the product rounded to bf16 as the scalar loop rounds.
inline int64_t silu_and_mul_vectors(const bf16* g, const bf16* u, bf16* o, int64_t d) {
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const __m512 gv = widen16(g + i);
    const __m512 sv = round_bf16(vdiv(gv, vadd(vset1(1.0f), vexp(vsub(vzero(), gv)))));
    store_rounded16(o + i, round_bf16(vmul(sv, widen16(u + i))));
  }
  return i;
}
#endif
#endif

// out[r] = silu(x[r, :d]) * x[r, d:] for rows of stride xs; silu's result rounded to T before
// the product.
template <typename T>
void silu_and_mul_rows(const T* xp, int64_t xs, T* op, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict__ g = xp + r * xs;
      const T* __restrict__ u = g + d;
      T* __restrict__ o = op + r * d;
      for (int64_t i = silu_and_mul_vectors(g, u, o, d); i < d; ++i) {
        const float gi = f32(g[i]);
        o[i] = from_f32<T>(f32(from_f32<T>(gi / (1.0f + fast_exp(-gi)))) * f32(u[i]));
      }
    }
  });
}

// x [T, 2d] -> silu(x[:, :d]) * x[:, d:].
torch::Tensor silu_and_mul(torch::Tensor x) {
  const auto st = check_dtype({&x}, "silu_and_mul");
  const int64_t d = x.size(-1) / 2;
  auto x2 = x.reshape({-1, 2 * d});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t rows = x2.size(0), xs = x2.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  DISPATCH(st, silu_and_mul_rows<T>(x2.data_ptr<T>(), xs, out.data_ptr<T>(), rows, d));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  return out.view(shape);
}

// One head vector x [d] rotated into o: NeoX halves over the first `rot` dims (cos c, sin s of
// the position), the rest copied.
template <typename T>
inline void rotate_head(const T* __restrict__ x, T* __restrict__ o, const float* __restrict__ c,
                        const float* __restrict__ s, int64_t half, int64_t rot, int64_t d) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = f32(x[i]), x2 = f32(x[i + half]);
    o[i] = from_f32<T>(x1 * c[i] - x2 * s[i]);
    o[i + half] = from_f32<T>(x2 * c[i] + x1 * s[i]);
  }
  for (int64_t i = rot; i < d; ++i) o[i] = x[i];
}

// NeoX rotary on q [T, h, d] and k [T, kvh, d] (any row strides, head vectors contiguous):
// new tensors, views of one [T, h + kvh, d] buffer. cos_sin [max_pos, rot] float32: cos then sin.
std::vector<torch::Tensor> rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                  torch::Tensor cos_sin) {
  const auto st = check_dtype({&q, &k}, "rotary");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32, "rotary: float32 cos_sin_cache expected");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "rotary: int64 positions expected");
  const int64_t ntok = q.size(0), h = q.size(1), kvh = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(0) == ntok && k.size(2) == d, "rotary: q and k shapes differ");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == d && k.stride(1) == d,
              "rotary: head vectors must be contiguous");
  auto cs = cos_sin.contiguous();
  const int64_t rot = cs.size(1), half = rot / 2;
  TORCH_CHECK(rot <= d, "rotary: rotary dim exceeds head dim");
  auto pos = positions.contiguous();
  auto out = torch::empty({ntok, h + kvh, d}, q.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0);
  DISPATCH(st, {
    const T* qp = q.data_ptr<T>();
    const T* kp = k.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, ntok, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* __restrict__ c = csp + pp[t] * rot;
        const float* __restrict__ s = c + half;
        for (int64_t j = 0; j < h + kvh; ++j)
          rotate_head(j < h ? qp + t * qs + j * d : kp + t * ks + (j - h) * d, op + (t * (h + kvh) + j) * d, c, s,
                      half, rot, d);
      }
    });
  });
  return {out.narrow(1, 0, h), out.narrow(1, h, kvh)};
}

// A V cache, and a K cache by default, is [blocks, bs, kvh, d]: a slot's head vectors in a row.
// A bf16 K cache may instead hold each block in token pairs, [blocks, kvh, d / 2, bs, 2]: for one
// KV head, dims 2p and 2p + 1 of the block's 16 tokens are one 64-byte vector, so a decode's
// scores come out with tokens in lanes (decode_rows_pairs) instead of needing a transposing sum
// per head (kernels/cpu_native.py k_cache_shape picks it; prefill copies a head's run as its scores'
// transposed K, prefill_rows).
struct CacheDims {
  int64_t bs, kvh, d;
  bool pairs;
};
inline CacheDims cache_dims(const torch::Tensor& c) {
  if (c.dim() == 5) return {c.size(3), c.size(1), 2 * c.size(2), true};
  TORCH_CHECK(c.dim() == 4, "caches are [blocks, block_size, kv_heads, head_dim] (K also in token pairs)");
  return {c.size(1), c.size(2), c.size(3), false};
}

// A token-pairs K cache with its V cache: contiguous bf16, the same blocks, heads and sizes.
inline void check_pairs(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const char* what) {
  const CacheDims kd = cache_dims(k_cache);
  TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16 && k_cache.size(4) == 2 && k_cache.is_contiguous() &&
                  v_cache.dim() == 4 && v_cache.is_contiguous() && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == kd.bs && v_cache.size(2) == kd.kvh && v_cache.size(3) == kd.d,
              what, ": a token-pairs K cache must be contiguous bf16 [blocks, kvh, d / 2, bs, 2] beside a "
              "contiguous V cache [blocks, bs, kvh, d]");
}

// One slot's K head vectors (kvh x d, adjacent) into a token-pairs block: pair p of head g goes to
// 32-bit word (g * d / 2 + p) * bs + o of the block.
inline void put_k_pairs(const void* src, void* block, int64_t o, int64_t kvh, int64_t d, int64_t bs) {
  const uint32_t* s = static_cast<const uint32_t*>(src);
  uint32_t* dst = static_cast<uint32_t*>(block) + o;
  for (int64_t p = 0; p < kvh * d / 2; ++p) dst[p * bs] = s[p];
}

// k/v [T, kvh, d] into caches [blocks, bs, kvh, d] (K also in token pairs) at slot_mapping[t]
// (-1: skip).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  const bool half = check_caches(k_cache, v_cache, check_dtype({&k, &v}, "write_kv"), "write_kv");
  if (k_cache.dim() == 5) {
    check_pairs(k_cache, v_cache, "write_kv");
    const CacheDims kd = cache_dims(k_cache);
    TORCH_CHECK(k.size(1) == kd.kvh && k.size(2) == kd.d && k.stride(2) == 1 && v.stride(2) == 1 &&
                    k.stride(1) == kd.d && v.stride(1) == kd.d && v.sizes() == k.sizes(),
                "write_kv: k/v must be [T, kv_heads, head_dim] with contiguous head vectors");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64, "write_kv: int64 slot_mapping expected");
    auto sl = slots.contiguous();
    const int64_t* sp = sl.data_ptr<int64_t>();
    const int64_t num_slots = k_cache.size(0) * kd.bs, row = kd.kvh * kd.d;
    const bf16* kp = k.data_ptr<bf16>();
    const bf16* vp = v.data_ptr<bf16>();
    bf16* kc = k_cache.data_ptr<bf16>();
    bf16* vc = v_cache.data_ptr<bf16>();
    for (int64_t t = 0; t < k.size(0); ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "write_kv: slot ", slot, " beyond the cache's ", num_slots);
      put_k_pairs(kp + t * k.stride(0), kc + (slot / kd.bs) * row * kd.bs, slot % kd.bs, kd.kvh, kd.d, kd.bs);
      std::memcpy(vc + slot * row, vp + t * v.stride(0), row * sizeof(bf16));
    }
    return;
  }
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "write_kv: int64 slot_mapping expected");
  const int64_t T = k.size(0), kvh = k.size(1), d = k.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "write_kv: head vectors must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "write_kv: caches must hold contiguous head vectors, in one layout");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * bs, esize = k.element_size();
  // rows layout (s2 == d): a slot's heads adjacent, one copy; heads-major: one per head
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  const int64_t runs = s2 == d ? 1 : kvh, run = (s2 == d ? kvh : 1) * d;
  if (half) {
#ifdef PAGEBUS_F16
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    f16* kc = k_cache.data_ptr<f16>();
    f16* vc = v_cache.data_ptr<f16>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "write_kv: slot ", slot, " beyond the cache's ", num_slots);
      const int64_t off = (slot / bs) * s0 + (slot % bs) * s1;
      for (int64_t g = 0; g < runs; ++g) {
        store_f16_row(kp + t * k.stride(0) + g * d, kc + off + g * s2, run);
        store_f16_row(vp + t * v.stride(0) + g * d, vc + off + g * s2, run);
      }
    }
#endif
    return;
  }
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "write_kv: slot ", slot, " beyond the cache's ", num_slots);
    const int64_t off = (slot / bs) * s0 + (slot % bs) * s1;
    for (int64_t g = 0; g < runs; ++g) {
      std::memcpy(kc + (off + g * s2) * esize, kp + (t * k.stride(0) + g * d) * esize, run * esize);
      std::memcpy(vc + (off + g * s2) * esize, vp + (t * v.stride(0) + g * d) * esize, run * esize);
    }
  }
}

// scores[hh] = q[hh] . k for the `group` query heads sharing one K row (heads adjacent in q).
inline void group_dots(const float* __restrict__ q, const float* __restrict__ k, int64_t group, int64_t d,
                       float sc, float* __restrict__ scores, int64_t stride) {
#ifdef __AVX512F__
  if (d % 16 == 0 && d <= 256) {
    __m512 kv[16];
    for (int64_t c = 0; c < d / 16; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
    for (int64_t hh = 0; hh < group; ++hh) {
      const float* qh = q + hh * d;
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
      __m512 a1 = _mm512_setzero_ps();
      for (int64_t c = 1; c < d / 16; c += 2) {  // two chains: FMA latency, not throughput, bound
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), kv[c], a1);
        if (c + 1 < d / 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * (c + 1)), kv[c + 1], a0);
      }
      scores[hh * stride] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * sc;
    }
    return;
  }
#endif
  for (int64_t hh = 0; hh < group; ++hh) scores[hh * stride] = dot(q + hh * d, k, d) * sc;
}

// Softmax of each of the h rows of L scores, in place (float32, max-subtracted); stats (if set):
// each row's max and exp sum, stats[2 * row] and stats[2 * row + 1].
inline void softmax_rows(float* sp, int64_t h, int64_t L, float* stats = nullptr) {
  for (int64_t hh = 0; hh < h; ++hh) {
    float* __restrict__ s = sp + hh * L;
    float m = -std::numeric_limits<float>::infinity();
    int64_t j = 0;
#ifdef PAGEBUS_SIMD  // GCC leaves the max loop below scalar (a vmaxss chain: ~3 cycles a score)
    {
      vf mv = vset1(m);
      for (; j + kLanes <= L; j += kLanes) mv = vmax(vload(s + j), mv);  // a NaN score is skipped, as by std::max
      alignas(64) float lanes[kLanes];
      vstore(lanes, mv);
      for (float x : lanes) m = std::max(m, x);
    }
#endif
    for (; j < L; ++j) m = std::max(m, s[j]);
    float total = 0.f;
    j = 0;
#ifdef PAGEBUS_SIMD  // vexp: fast_exp's loop stays scalar
    vf tv = vzero();
    for (; j + kLanes <= L; j += kLanes) {
      const vf e = vexp(vsub(vload(s + j), vset1(m)));
      vstore(s + j, e);
      tv = vadd(tv, e);
    }
    total = hsum(tv);
#endif
    for (; j < L; ++j) {
      s[j] = fast_exp(s[j] - m);
      total += s[j];
    }
    if (stats != nullptr) stats[2 * hh] = m, stats[2 * hh + 1] = total;
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t j = 0; j < L; ++j) s[j] *= inv;
  }
}

#ifdef PAGEBUS_SIMD
#ifdef __AVX512F__
// The 16 horizontal sums of v[0..15] as one vector, lane i = sum of v[i]: 45 shuffles and
// adds in all, against about 9 for each _mm512_reduce_add_ps.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline vf sum_lanes(const vf* v) { return sum16(v); }
// The first n lanes of v into p.
inline void vstore_first(float* p, vf v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}

// 16 cache values as float32 (bf16 widened exactly: its bits are a float's top half), and 16
// float32 sums stored as the cache's type (bf16 rounded to nearest even, as torch rounds).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#ifdef __AVX512BF16__
inline __m512 load16(const bf16* p) { return widen16(p); }
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline vf vload(const bf16* p) { return load16(p); }
inline void vstore(bf16* p, vf v) { store16(p, v); }
#endif
#else
// The 8 horizontal sums of v[0..7] as one vector, lane i = sum of v[i] (AVX2's sum16).
inline vf sum_lanes(const vf* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // u0 lane i < 4: v[i]'s first half summed, lane 4 + i its second; u1 the same for v[4 + i]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline void vstore_first(float* p, vf v, int64_t n) {
  if (n == kLanes) return vstore(p, v);  // vmaskmovps stores are slow on AMD CPUs
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane), v);
}
#endif  // __AVX512F__

// f(c, next) for the claims c = 0 .. n - 1, each taken by a thread from a shared counter when it
// is ready for one (next: the claim that thread takes after c, n if none; each holds one ahead, so
// it can prefetch for it). A thread slowed by another process (the engine's scheduler and
// frontends share the cores) takes fewer claims, where a fixed share per thread kept the others
// waiting for it at the region's end (the tile matmul, decode attention: see there what it gave).
// Thread i starts on claim i: taking its first claim from the counter too, the first thread to
// arrive held two (its own and the one ahead) while the others were still waking, so 2 claims on
// 2 threads (two decodes, or a single stream's keys in two runs) ran on one.
template <typename F>
static void for_each_claim(int64_t n, F&& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{threads};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t first = t0; first < t1; ++first)  // one claim each, unless fewer threads came
      for (int64_t c = first; c < n;) {
        const int64_t after = std::min(n, next.fetch_add(1, std::memory_order_relaxed));
        f(c, after);
        c = after;
      }
  });
}

// f(i) for the items i = 0 .. n - 1, each thread taking a contiguous share of them front to back,
// so what it reads streams in address order and a prefetch running ahead of one item lands in the
// next; done with its share, a thread takes the others' last items from the back, so one slowed
// by another process holds nobody up. For the GEMV-like matmuls (one or two rows), where
// for_each_claim's claims alternate between the threads and every claim starts its streams cold:
// with the streams' prefetch (two_tiles), Zen 3, float16 weights, one engine per build in one
// process, a single stream's decode step 0.87-0.92x (interleaved runs of 12-14 rounds); regions
// of the layers' sizes alone (0.6-3.4 MB of weights) read 1.03-1.16x as fast.
template <typename F>
static void for_each_run(int64_t n, F&& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  struct alignas(64) Share {
    std::atomic<uint64_t> v;  // (next << 32) | end: the owner and a thief claim by one CAS on both
  };
  std::vector<Share> shares(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t)
    shares[t].v.store(static_cast<uint64_t>(t * n / threads) << 32 | static_cast<uint64_t>((t + 1) * n / threads));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t o = 0; o < threads; ++o) {  // o = 0: its own share, from the front
        std::atomic<uint64_t>& share = shares[(t + o) % threads].v;
        for (uint64_t s = share.load(std::memory_order_relaxed);;) {
          const int64_t lo = static_cast<int64_t>(s >> 32), hi = static_cast<int64_t>(s & 0xffffffffu);
          if (lo >= hi) break;
          if (share.compare_exchange_weak(s, o == 0 ? s + (uint64_t{1} << 32) : s - 1, std::memory_order_relaxed)) {
            f(o == 0 ? lo : hi - 1);
            s = share.load(std::memory_order_relaxed);
          }
        }
      }
  });
}

// f(lo, hi, next) over the items 0 .. n - 1 in spans [lo, hi) of at most `cap` items that shrink
// as the work runs out: (items left) / (kSpanDivisor * threads), at least one, never across a
// multiple of `group` (the tile matmul's row chunks). Thread i starts on span i of equal first
// spans; after that each thread takes its next span from a shared counter as it starts one (next:
// that span's first item, n if none, so it can prefetch for it). Fixed claims ended a region with
// one thread running a whole claim while the other waited at the barrier: at 32-64 rows a region
// lasts 0.05-3 ms and the LM head's claims were 192 tiles. Zen 3, two threads, float16 tiles, 30
// layers' matmuls and the LM head, 40 interleaved rounds (an identical build 0.995-1.006): 64
// rows 0.948, 32 rows 0.874 of the time; 256 and 2,048 rows unchanged (1.015, 0.981; 16 rounds).
// A 64-sequence decode: libgomp's share of the samples 5.3% -> 3.5%.
constexpr int64_t kSpanDivisor = 4;
template <typename F>
static void for_each_span(int64_t n, int64_t group, int64_t cap, F&& f) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t first = std::max<int64_t>(1, std::min({cap, group / threads, n / (kSpanDivisor * threads)}));
  const int64_t statics = std::min(threads, n / first);
  std::atomic<int64_t> cursor{statics * first};
  auto take = [&](int64_t& lo, int64_t& hi) {
    for (int64_t c = cursor.load(std::memory_order_relaxed);;) {
      if (c >= n) {
        lo = hi = n;
        return;
      }
      const int64_t end = std::min({n, (c / group + 1) * group,
                                    c + std::max<int64_t>(1, std::min(cap, (n - c) / (kSpanDivisor * threads)))});
      if (cursor.compare_exchange_weak(c, end, std::memory_order_relaxed)) {
        lo = c, hi = end;
        return;
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t lo = t * first, hi = lo + first;
      if (t >= statics) take(lo, hi);
      while (lo < n) {
        int64_t next_lo = n, next_hi = n;
        take(next_lo, next_hi);
        f(lo, hi, next_lo);
        lo = next_lo, hi = next_hi;
      }
    }
  });
}

// Ask for `bytes` from p on into L1, a cache line at a time.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// The cache lines of one sequence's K or V blocks, asked for into L2 an even share per step of
// the work before they are read, a whole pass ahead: a decode's K pass fetches its V so, its V
// pass the K of the thread's next claim (decode_rows_fast). Blocks sit anywhere in the cache and
// the hardware prefetcher does not run ahead across them; prefetching each row two blocks ahead
// into L1 (the `ahead` rows below) gives a lead of ~0.2 us of work, which did not cover DRAM
// under load where a thread runs through many short sequences. Zen 3, two threads, 30 layers of
// float16 caches from DRAM, decode attention, paired medians of interleaved runs (old / this):
// 64 sequences x 192 tokens 1.09 (five runs, 0.99-1.23), 32 x 192 1.03 (four, 0.94-1.10),
// 16 x 512 1.10; a single stream (split runs, no pass ahead) unchanged.
struct Trickle {
  const char* cache = nullptr;  // nullptr: nothing to fetch
  const int32_t* table = nullptr;
  const char* at = nullptr;  // the block being fetched
  int64_t block_bytes = 0, per_block = 0, lines = 0, steps = 1, done = 0, line = 0, owed = 0;
  Trickle() = default;
  // `blocks` blocks of `block_bytes` bytes at cache + table[i] * block_bytes, over `steps` steps.
  Trickle(const void* c, const int32_t* t, int64_t block_bytes_, int64_t blocks, int64_t steps_)
      : cache(blocks > 0 ? static_cast<const char*>(c) : nullptr), table(t), block_bytes(block_bytes_),
        per_block((block_bytes_ + 63) / 64), lines(blocks * per_block), steps(std::max<int64_t>(1, steps_)) {
    if (cache != nullptr) at = cache + table[0] * block_bytes;
  }
  inline void step() {
    if (cache == nullptr) return;
    for (owed += lines; owed >= steps && done < lines; owed -= steps, ++done) {
      _mm_prefetch(at + line * 64, _MM_HINT_T1);
      if (++line == per_block && done + 1 < lines) line = 0, at = cache + table[(done + 1) / per_block] * block_bytes;
    }
  }
};

// The longest run of K (or V) rows a decode fetches a whole pass ahead: it must stay in L2 (512 KiB
// on Zen 3, 1-2 MiB on later cores) while the pass before it streams as many bytes through.
constexpr int64_t kPassAheadBytes = 192 << 10;

// Blocks of keys below which a decode's context is not split across threads (the merge and a
// second pass's start cost more than half of so few keys). 2 against 4: one 96-token decode on
// two threads, K/V from DRAM (600 layers' caches, AMD Zen 3), 19.7 -> 14.6 us a layer with a
// float32 cache, 13.1 -> 12.5 with a float16 one (a thread alone waits on DRAM for each block).
constexpr int64_t kMinSplitBlocks = 2;
// The same for bf16 caches (decode_rows_pairs), whose arithmetic on bf16 pairs costs a fraction
// of float32's. One sequence on two threads, 30 layers from DRAM (bench/attention_ab.py, Zen 4),
// time split at 8 / unsplit: 256 tokens 0.97-1.0, 512 0.56, 1,024 0.61-0.66, 4,096 0.62; split
// from 2 blocks, 96 tokens took 1.24x the time.
constexpr int64_t kMinSplitBlocksPairs = 8;

// How many runs of whole blocks each decode's keys split into for a split decode (1: none): with
// fewer decodes than threads (a single stream), enough to spread them over the threads, none of
// fewer than min_blocks blocks of the longest sequence, at most 64 (merge_runs's weights).
static int64_t key_runs(int64_t B, const int32_t* lp, const int32_t* qp0, int64_t bs, int64_t min_blocks) {
  int64_t decodes = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b)
    if (qp0[b + 1] - qp0[b] == 1) ++decodes, longest = std::max<int64_t>(longest, lp[b]);
  const int64_t threads = at::get_num_threads();
  if (decodes == 0 || decodes >= threads) return 1;
  return std::max<int64_t>(
      1, std::min({(threads + decodes - 1) / decodes, (longest + bs - 1) / bs / min_blocks, int64_t{64}}));
}

// The claims of a split decode (decode_rows_fast, decode_rows_pairs): run p of each decode b's
// keys, [j_lo, j_hi) in whole 16-token blocks, as f(b, j_lo, j_hi, c), c = b * parts + p being
// the run's index into the outputs and stats ([B * parts, h, 2]) merge_runs reads; the runs of a
// short sequence that fall past its keys get an empty run's stats (max -inf, sum 0) instead.
template <typename F>
static void for_each_key_run(int64_t B, int64_t parts, const int32_t* lp, const int32_t* qp0, int64_t h,
                             float* stats, F&& f) {
  constexpr int64_t bs = 16;
  for_each_claim(B * parts, [&](int64_t c, int64_t) {
    const int64_t b = c / parts, p = c % parts, L = lp[b];
    const int64_t per = ((L + bs - 1) / bs + parts - 1) / parts * bs, j_lo = p * per, j_hi = std::min(L, j_lo + per);
    if (qp0[b + 1] - qp0[b] != 1) return;
    if (j_lo >= j_hi) {
      float* st = stats + c * h * 2;
      for (int64_t hh = 0; hh < h; ++hh) st[2 * hh] = -std::numeric_limits<float>::infinity(), st[2 * hh + 1] = 0.f;
      return;
    }
    f(b, j_lo, j_hi, c);
  });
}

// A split decode's runs merged (flash-decoding): out[qp0[b]] of each decode b = the sum over its
// `parts` runs of each run's normalized output (part_out, [B, parts, h, d]) weighted by the run's
// exp sum rescaled to the common max (stats, [B, parts, h, 2]: max, sum; an empty run's sum 0).
template <typename T>
void merge_runs(T* op0, int64_t os, const int32_t* qp0, int64_t B, int64_t parts, int64_t h, int64_t d,
                const float* part_out, const float* stats) {
  for (int64_t b = 0; b < B; ++b) {
    if (qp0[b + 1] - qp0[b] != 1) continue;
    T* ot = op0 + qp0[b] * os;
    for (int64_t hh = 0; hh < h; ++hh) {
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, stats[((b * parts + p) * h + hh) * 2]);
      float w[64];  // parts <= 64
      for (int64_t p = 0; p < parts; ++p) {
        const float* st = stats + ((b * parts + p) * h + hh) * 2;
        w[p] = st[1] > 0.f ? st[1] * std::exp(st[0] - m) : 0.f;
        total += w[p];
      }
      for (int64_t i = 0; i < d; ++i) {
        float acc = 0.f;
        for (int64_t p = 0; p < parts; ++p) acc += w[p] * part_out[((b * parts + p) * h + hh) * d + i];
        ot[hh * d + i] = static_cast<T>(acc / total);
      }
    }
  }
}

// One query head's scores against a 16-token block of K rows (n <= 16 of them valid), scaled:
// a vector of partial products per token, then one transposing sum per kLanes tokens.
template <int NV, typename T>
inline void block_scores(const float* __restrict__ q, const T* __restrict__ k0, int64_t kstride, int64_t n, float sc,
                         float* __restrict__ out) {
  vf qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = vload(q + kLanes * c);
  for (int64_t o0 = 0; o0 < n; o0 += kLanes) {
    vf acc[kLanes];
    for (int64_t o = 0; o < kLanes; ++o) {
      if (o0 + o >= n) {
        acc[o] = vzero();
        continue;
      }
      const T* k = k0 + (o0 + o) * kstride;
      vf a = vmul(qv[0], vload(k));
      for (int c = 1; c < NV; ++c) a = vfmadd(qv[c], vload(k + kLanes * c), a);
      acc[o] = a;
    }
    vstore_first(out + o0, vmul(sum_lanes(acc), vset1(sc)), std::min<int64_t>(kLanes, n - o0));
  }
}

// HC query heads (adjacent in q, d apart) sharing one KV head against a 16-token block of its K
// rows (n <= 16 of them valid), scaled, into out[i * L + token] for head i: each K row loaded and
// widened once for the HC heads, their q read from L1, then one transposing sum per head and
// kLanes tokens. Each row's slice `ahead` (if set: the same KV head's rows a block or two on) is
// prefetched as the row is scored, and `trickle` (Trickle) is stepped: spread so, the prefetches
// keep pace with the FMAs, where asking for a whole block at once stalled them. AVX2 (Zen 3), d = 64, a float16 cache: 10.2
// core cycles a (token, query head) with q in registers and a K row widened for each of its 3
// heads (bound by the conversions), 6.7 this way (a sequence's 192 tokens in L1); 30 layers of
// 64 sequences x 192 tokens, scores alone: 10.4 -> 9.4 ms (K from DRAM), 8.2 -> 6.4 (in L3).
// Not for float32 caches: 8 q and 24 K loads a row bind it there, no faster than head by head.
template <int NV, int HC, typename T>
inline void group_block_scores(const float* __restrict__ q, const T* __restrict__ k0, int64_t kstride, int64_t n,
                               float sc, float* __restrict__ out, int64_t L, const T* const* ahead, int n_ahead,
                               Trickle* trickle) {
  constexpr int64_t d = kLanes * NV;
  constexpr int CH = NV < 8 ? NV : 8;  // K vectors held at once: 8 of AVX2's 16 registers, 2 HC sums
  for (int64_t o0 = 0; o0 < n; o0 += kLanes) {
    vf acc[HC][kLanes];
    for (int64_t o = 0; o < kLanes; ++o) {
      if (o0 + o >= n) {
        for (int i = 0; i < HC; ++i) acc[i][o] = vzero();
        continue;
      }
      const T* k = k0 + (o0 + o) * kstride;
      for (int i = 0; i < n_ahead; ++i) prefetch_row(ahead[i] + (o0 + o) * kstride, d * static_cast<int64_t>(sizeof(T)));
      trickle->step();
      vf a[HC][2];
      for (int c0 = 0; c0 < NV; c0 += CH) {
        vf kv[CH];
        for (int c = 0; c < CH; ++c) kv[c] = vload(k + kLanes * (c0 + c));
        for (int i = 0; i < HC; ++i)
          for (int c = 0; c < CH; ++c) {  // two chains a head: FMA latency
            const vf x = vload(q + i * d + kLanes * (c0 + c));
            a[i][c % 2] = c0 + c < 2 ? vmul(x, kv[c]) : vfmadd(x, kv[c], a[i][c % 2]);
          }
      }
      for (int i = 0; i < HC; ++i) acc[i][o] = NV > 1 ? vadd(a[i][0], a[i][1]) : a[i][0];
    }
    for (int i = 0; i < HC; ++i)
      vstore_first(out + i * L + o0, vmul(sum_lanes(acc[i]), vset1(sc)), std::min<int64_t>(kLanes, n - o0));
  }
}

// out[hh] = sum_j p[hh, j] V[j] for HC query heads sharing one KV head: the outputs stay in
// registers over every token, and each V row is loaded once for the HC heads. DV < NV: the dims
// in passes of DV vectors (a row's slice read once a pass; later passes find the rows in cache),
// so that HC heads' sums fit AVX2's 16 registers (HC x DV sums, HC p and one V vector): a float16
// row is then widened once for the HC heads, where head by head (HC 1, all NV vectors) it was
// widened HC times and the conversions bound the loop. Each sum adds its tokens in the same order
// either way. Zen 3, two threads, 30 layers of 64 sequences x 192 tokens, decode attention: float16
// cache 15.1 -> 14.1 ms from DRAM, 11.3 -> 10.1 in L3; float32 27.9 -> 27.0, 17.3 -> 15.4.
template <int NV, int HC, int DV, typename C, typename T>
inline void heads_times_v(const float* __restrict__ p, int64_t L, const C* vc, const int32_t* table, int64_t s0,
                          int64_t s1, int64_t bs, T* __restrict__ out, int64_t d, bool fetch_ahead, Trickle* trickle) {
  static_assert(NV % DV == 0, "passes of whole vectors");
  for (int c0 = 0; c0 < NV; c0 += DV) {
    vf acc[HC][DV];
    for (int i = 0; i < HC; ++i)
      for (int c = 0; c < DV; ++c) acc[i][c] = vzero();
    for (int64_t j0 = 0; j0 < L; j0 += bs) {
      const C* base = vc + table[j0 / bs] * s0 + kLanes * c0;
      const int64_t n = std::min(bs, L - j0);
      // With fetch_ahead (V not fetched a pass ahead), this head's rows two blocks ahead (from the
      // first block, block 1 too), one per row now. 30 layers of 32 sequences x 192 tokens (bf16,
      // 141 MB of K/V, two threads): 7.15 ms without, 4.65 with one block ahead, 4.31 as here;
      // 2.78 with the K/V in cache. Later passes find the rows in cache.
      const C* next1 = fetch_ahead && c0 == 0 && j0 == 0 && bs < L ? vc + table[1] * s0 : nullptr;
      const C* next2 = fetch_ahead && c0 == 0 && j0 + 2 * bs < L ? vc + table[j0 / bs + 2] * s0 : nullptr;
      for (int64_t o = 0; o < n; ++o) {
        const C* vr = base + o * s1;
        if (next1 != nullptr) prefetch_row(next1 + o * s1, d * static_cast<int64_t>(sizeof(C)));
        if (next2 != nullptr) prefetch_row(next2 + o * s1, d * static_cast<int64_t>(sizeof(C)));
        trickle->step();  // the next claim's K (decode_rows_fast)
        vf pj[HC];
        for (int i = 0; i < HC; ++i) pj[i] = vset1(p[i * L + j0 + o]);
        for (int c = 0; c < DV; ++c) {  // one V vector at a time: HC x DV sums, HC p and a V vector
          const vf v = vload(vr + kLanes * c);
          for (int i = 0; i < HC; ++i) acc[i][c] = vfmadd(pj[i], v, acc[i][c]);
        }
      }
    }
    for (int i = 0; i < HC; ++i)
      for (int c = 0; c < DV; ++c) vstore(out + i * d + kLanes * (c0 + c), acc[i][c]);
  }
}

#ifdef __AVX512F__
// e^x of 16 floats (AVX-512 code's name for vexp).
inline __m512 exp16(__m512 x) { return vexp(x); }

#ifdef __AVX512BF16__
// One query head against a 16-token block of bf16 K rows (n <= 16 of them valid), scaled:
// q as NV / 2 vectors of bf16 pairs, each K row's pairs multiplied by vdpbf16ps (the products
// of bf16 values are exact in float32), then one transposing sum for the 16 tokens.
template <int NV>
inline void block_scores_pairs(const __m512i* q, const bf16* __restrict__ k0, int64_t kstride, int64_t n, float sc,
                               float* __restrict__ out) {
  __m512 acc[16];
  for (int o = 0; o < 16; ++o) {
    acc[o] = _mm512_setzero_ps();
    if (o >= n) continue;
    const bf16* k = k0 + o * kstride;
    for (int c = 0; c < NV / 2; ++c)
      acc[o] = _mm512_dpbf16_ps(acc[o], (__m512bh)q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  }
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(sc)));
}

// Scores of HC query heads sharing one KV head (q: their bf16 vectors, adjacent) against a
// 16-token block of a token-pairs K cache (kb: this head's [d / 2, 16, 2] run), scaled, into rows
// of stride L (n <= 16 valid): each dim pair's 16 tokens are one vector, times that pair of q
// broadcast, so the sums land with tokens in lanes. Per head and block that is NV / 2 x 2
// vdpbf16ps and no shuffles, against block_scores_pairs' 2 NV plus sum16's 45, and each K
// vector is loaded once for the HC heads. `next`: the same run kKvAhead blocks on, prefetched
// over the loop (nullptr: none).
template <int NV, int HC>
inline void block_scores_tokens(const bf16* __restrict__ q, const bf16* __restrict__ kb, const bf16* next, int64_t n,
                                float sc, float* __restrict__ out, int64_t L, Trickle* tr) {
  constexpr int64_t P = 8 * NV;  // dim pairs
  const int32_t* q32 = reinterpret_cast<const int32_t*>(q);
  __m512 acc[HC][2];
  for (int i = 0; i < HC; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; p += 2) {
    tr->step();
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + p * 32), _MM_HINT_T0),
                         _mm_prefetch(reinterpret_cast<const char*>(next + p * 32 + 32), _MM_HINT_T0);
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * 32);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * 32 + 32);
    for (int i = 0; i < HC; ++i) {
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], k0, (__m512bh)_mm512_set1_epi32(q32[i * P + p]));
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], k1, (__m512bh)_mm512_set1_epi32(q32[i * P + p + 1]));
    }
  }
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  for (int i = 0; i < HC; ++i)
    _mm512_mask_storeu_ps(out + i * L, m, _mm512_mul_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_set1_ps(sc)));
}

// Each of the h rows of L scores -> exp(s - max) rounded to bf16 into pb (row stride Lp, a
// multiple of 16; zeros from L on), and 1 / the row's float32 sum of them into inv; stats (if
// set): each row's max and sum, for merging runs of keys (merge_runs).
inline void softmax_pairs(const float* sp, int64_t h, int64_t L, bf16* pb, int64_t Lp, float* inv,
                          float* stats = nullptr) {
  for (int64_t hh = 0; hh < h; ++hh) {
    const float* s = sp + hh * L;
    bf16* p = pb + hh * Lp;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < L; j += 16) {
      const __mmask16 k = static_cast<__mmask16>(L - j >= 16 ? 0xFFFF : (1u << (L - j)) - 1);
      mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 16) {
      const __mmask16 k = static_cast<__mmask16>(j >= L ? 0 : L - j >= 16 ? 0xFFFF : (1u << (L - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m)));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float sum = _mm512_reduce_add_ps(total);
    inv[hh] = 1.0f / sum;
    if (stats != nullptr) stats[2 * hh] = _mm512_reduce_max_ps(m), stats[2 * hh + 1] = sum;
  }
}

// K/V blocks a decode prefetches ahead of the one it reads: blocks sit anywhere in the cache,
// and the hardware prefetcher does not run ahead across them (4 measured the same as 2).
constexpr int64_t kKvAhead = 2;

// out[i] = inv[i] * sum_j p[i, j] V[j] for HC query heads sharing one KV head, P in bf16 (rows
// of stride Lp, zero past L): two tokens' V rows interleaved into pairs per step, so vdpbf16ps
// adds both tokens at once (flash attention's bf16 P . V). The sums come out with their dims in
// an interleaved order, put back once at the end. This head's V rows kKvAhead blocks ahead are
// prefetched a row per row read (from the first block, the ones before that too).
template <int NV, int HC, typename O>
inline void heads_times_v_pairs(const bf16* pb, int64_t Lp, int64_t L, const bf16* vc, const int32_t* table,
                                int64_t s0, int64_t s1, int64_t bs, const float* inv, O* __restrict__ out,
                                int64_t d, Trickle* tr) {
  __m512 acc[HC][NV];
  for (int i = 0; i < HC; ++i)
    for (int c = 0; c < NV; ++c) acc[i][c] = _mm512_setzero_ps();
  const int32_t* pp = reinterpret_cast<const int32_t*>(pb);  // (p[2j], p[2j + 1]) pairs
  const int64_t nb = (L + bs - 1) / bs;
  for (int64_t j = 0; j < nb; ++j) {
    const bf16* base = vc + table[j] * s0;
    const int64_t j0 = j * bs, n = std::min(bs, L - j0);
    for (int64_t o = 0; o < n; o += 2) {
      tr->step();
      for (int64_t a = j == 0 ? 1 : kKvAhead; a <= kKvAhead && j + a < nb; ++a)
        for (int64_t r = o; r < (o + 2 < n ? o + 2 : bs); ++r) prefetch_row(vc + table[j + a] * s0 + r * s1, d * 2);
      const bf16* va = base + o * s1;
      const bf16* vb = base + (o + 1) * s1;
      __m512i lo[NV / 2], hi[NV / 2];
      for (int c = 0; c < NV / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(va + 32 * c);
        const __m512i y = o + 1 < n ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(x, y);
        hi[c] = _mm512_unpackhi_epi16(x, y);
      }
      for (int i = 0; i < HC; ++i) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(pp[(i * Lp + j0 + o) / 2]);
        for (int c = 0; c < NV / 2; ++c) {
          acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], (__m512bh)lo[c], pj);
          acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], (__m512bh)hi[c], pj);
        }
      }
    }
  }
  // acc[2c] holds dims 32c + {0-3, 8-11, 16-19, 24-27}, acc[2c + 1] the other four of each eight
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < HC; ++i) {
    const __m512 w = _mm512_set1_ps(inv[i]);
    for (int c = 0; c < NV / 2; ++c) {
      store16(out + i * d + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(acc[i][2 * c], first, acc[i][2 * c + 1]), w));
      store16(out + i * d + 32 * c + 16,
              _mm512_mul_ps(_mm512_permutex2var_ps(acc[i][2 * c], second, acc[i][2 * c + 1]), w));
    }
  }
}

// The `heads` query heads of one KV head against a token-pairs K block, HC at a time (the
// first HC prefetch `next`).
template <int NV, int HC>
inline void tokens_scores(const bf16* qt, const bf16* kb, const bf16* next, int64_t n, float sc, float* sp,
                          int64_t L, int64_t heads, Trickle* tr) {
  int64_t i = 0;
  for (; i + HC <= heads; i += HC)
    block_scores_tokens<NV, HC>(qt + i * 16 * NV, kb, next, n, sc, sp + i * L, L, tr), next = nullptr;
  for (; i < heads; ++i) block_scores_tokens<NV, 1>(qt + i * 16 * NV, kb, nullptr, n, sc, sp + i * L, L, tr);
}

// decode_rows_fast for bf16 caches: the same work items and prefetches, with scores and P . V by
// vdpbf16ps on bf16 pairs (q, K and P bf16; float32 sums, softmax in float32, P rounded to bf16
// as flash attention rounds it) instead of widening every K and V element to float32. KP: the K
// cache is in token pairs (block_scores_tokens; ks0 its block stride); s0-s2 are V's strides.
// 30 layers of 32 sequences x 192 tokens on a Zen 4 (two threads): 11.4 -> 9.7 ms from DRAM with KP,
// 4.4 -> 3.8 ms with the K/V in cache; 64 sequences 20.9 -> 17.3 and 8.8 -> 7.5.
template <int NV, bool KP>
void decode_rows_pairs(bf16* op0, int64_t os, const bf16* qp, int64_t qs, const bf16* kc, const bf16* vc, int64_t s0,
                       int64_t s1, int64_t s2, const int32_t* btp, int64_t width, const int32_t* lp, const int32_t* qp0,
                       int64_t B, int64_t h, int64_t kvh, float sc, int64_t ks0) {
  constexpr int64_t d = 16 * NV, bs = 16;
  constexpr int HC = NV <= 4 ? 3 : 2;
  const int64_t group = h / kvh, row_bytes = kvh * d * 2;
  // Trickle steps a KV head takes per K block (block_scores_tokens' dim-pair loop, once per call
  // of tokens_scores) and per pair of V tokens (heads_times_v_pairs, once per call)
  const int64_t k_steps = (group / HC + group % HC) * (4 * NV), v_calls = group / HC + group % HC;
  // Sequence b's keys from block jb on (L of them): scores, softmax and P . V of every head into
  // out (h x d, heads adjacent, normalized over these keys: bf16 rows, or float32 runs to merge);
  // stats (if set): each head's score max and exp sum over them (merge_runs). in_k_pass /
  // in_v_pass: what the K and V passes trickle into L2.
  // Inlined into each claim's loop: called, the same loops ran 1.2x as long (8 x 192 tokens with
  // their K/V in cache).
  auto attend = [&](int64_t b, int64_t jb, int64_t L, auto* out, float* stats, Trickle* in_k_pass,
                    Trickle* in_v_pass) __attribute__((always_inline)) {
    thread_local std::vector<float> scores, inv;
    thread_local std::vector<bf16> probs;
    inv.resize(static_cast<size_t>(h));
    const int64_t t = qp0[b], Lp = (L + 15) / 16 * 16, nb = (L + bs - 1) / bs;
    scores.resize(static_cast<size_t>(h * L));
    probs.resize(static_cast<size_t>(h * Lp));
    float* sp = scores.data();
    const int32_t* table = btp + b * width + jb;
    const bf16* qt = qp + t * qs;  // heads adjacent
    if constexpr (KP) {
      const int64_t run = d * bs;  // one KV head's part of a block
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t j0 = j * bs, n = std::min(bs, L - j0);
        const bf16* kb = kc + table[j] * ks0;
        for (int64_t g = 0; g < kvh; ++g) {
          // this head's run kKvAhead blocks on (from the first block, the ones before that too)
          if (j == 0)
            for (int64_t a = 1; a < kKvAhead && a < nb; ++a) prefetch_row(kc + table[a] * ks0 + g * run, run * 2);
          const bf16* next = j + kKvAhead < nb ? kc + table[j + kKvAhead] * ks0 + g * run : nullptr;
          tokens_scores<NV, NV <= 4 ? 3 : 2>(qt + g * group * d, kb + g * run, next, n, sc, sp + g * group * L + j0,
                                             L, group, in_k_pass);
        }
      }
    }
    for (int64_t j = 0; !KP && j < nb; ++j) {
      const int64_t j0 = j * bs, n = std::min(bs, L - j0);
      const bf16* kb = kc + table[j] * s0;
      for (int64_t hh = 0; hh < h; ++hh) {
        // every KV head's K rows ahead, as for V, a few rows per head scored
        for (int64_t a = j == 0 ? 1 : kKvAhead; a <= kKvAhead && j + a < nb; ++a)
          for (int64_t o = hh; o < bs; o += h) prefetch_row(kc + table[j + a] * s0 + o * s1, row_bytes);
        __m512i qv[NV / 2];
        for (int c = 0; c < NV / 2; ++c) qv[c] = _mm512_loadu_si512(qt + hh * d + 32 * c);
        block_scores_pairs<NV>(qv, kb + (hh / group) * s2, s1, n, sc, sp + hh * L + j0);
      }
    }
    softmax_pairs(sp, h, L, probs.data(), Lp, inv.data(), stats);
    for (int64_t g = 0; g < kvh; ++g) {
      const bf16* vg = vc + g * s2;
      int64_t hh = g * group;
      const int64_t end = hh + group;
      for (; hh + HC <= end; hh += HC)
        heads_times_v_pairs<NV, HC>(probs.data() + hh * Lp, Lp, L, vg, table, s0, s1, bs, inv.data() + hh,
                                    out + hh * d, d, in_v_pass);
      for (; hh < end; ++hh)
        heads_times_v_pairs<NV, 1>(probs.data() + hh * Lp, Lp, L, vg, table, s0, s1, bs, inv.data() + hh,
                                   out + hh * d, d, in_v_pass);
    }
  };
  // Fewer decodes than threads (a single stream): each sequence's keys split into `parts` runs of
  // whole blocks, one claim each, merged by their softmax stats, as decode_rows_fast does, from
  // kMinSplitBlocksPairs blocks on. Each run trickles its own V over its K pass.
  const int64_t parts = key_runs(B, lp, qp0, bs, kMinSplitBlocksPairs);
  if (parts > 1) {
    std::vector<float> part_out(static_cast<size_t>(B * parts * h * d)), stats(static_cast<size_t>(B * parts * h * 2));
    for_each_key_run(B, parts, lp, qp0, h, stats.data(), [&](int64_t b, int64_t j_lo, int64_t j_hi, int64_t c) {
      const int64_t nbr = (j_hi - j_lo + bs - 1) / bs;
      Trickle own_v = KP ? Trickle(vc, btp + b * width + j_lo / bs, s0 * 2, nbr, nbr * kvh * k_steps) : Trickle();
      Trickle none;
      attend(b, j_lo / bs, j_hi - j_lo, part_out.data() + c * h * d, stats.data() + c * h * 2, &own_v, &none);
    });
    merge_runs(op0, os, qp0, B, parts, h, d, part_out.data(), stats.data());
    return;
  }
  for_each_claim(B, [&](int64_t b, int64_t after) {  // a sequence a claim, as decode_rows_fast
    if (qp0[b + 1] - qp0[b] != 1) return;
    // The thread's next claim's K blocks into L2 over this claim's K pass, its V blocks over the V
    // pass, whatever their length (what L2 cannot hold it evicts to L3, still ahead of DRAM). The
    // two-blocks-ahead prefetch into L1 alone did not keep DRAM busy. 30 layers on a Zen 4, two
    // threads, builds interleaved (bench/attention_ab.py), from DRAM, time with / without: 64 x 192
    // tokens 0.71, 32 x 192 0.72, 8 x 2048 0.85; 16 x 512 0.66-0.74, 128 x 160 0.66, 4 x 4096 0.84
    // (capped at 192 KiB a claim there: 0.95). Without the L1 prefetch beside it: 0.74 and 0.86.
    // A thread's last claim (a single stream's only one) fetches its own V over its K pass instead:
    // one sequence of 1,024 tokens 0.72 and 0.82 (two runs), two sequences 0.91; 1.07-1.17x with
    // the K/V in L3, which the weights streaming through between two layers leave no K/V in.
    const bool fetch = KP && after < B && qp0[after + 1] - qp0[after] == 1;
    const int64_t nb_next = fetch ? (lp[after] + bs - 1) / bs : 0, nb_here = (lp[b] + bs - 1) / bs;
    Trickle in_k_pass = fetch ? Trickle(kc, btp + after * width, ks0 * 2, nb_next, nb_here * kvh * k_steps)
                     : KP  ? Trickle(vc, btp + b * width, s0 * 2, nb_here, nb_here * kvh * k_steps)
                           : Trickle();
    Trickle in_v_pass = fetch ? Trickle(vc, btp + after * width, s0 * 2, nb_next, kvh * v_calls * ((lp[b] + 1) / 2))
                           : Trickle();
    attend(b, 0, lp[b], op0 + qp0[b] * os, nullptr, &in_k_pass, &in_v_pass);
  });
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

// decode_rows for float32 caches of 16-token blocks and head_dim kLanes * NV (bf16 caches take
// decode_rows_pairs): the same work items, float32 arithmetic and softmax; scores 16 tokens at a
// time (block_scores) and the V sums in registers (heads_times_v), rounded once into `out`. At
// 32 sequences of ~200 tokens this halved attention's share of a float32 step (AVX-512).
// C: the caches' type, T's or float16 beside float32 activations.

template <int NV, typename T, typename C = T>
void decode_rows_fast(T* op0, int64_t os, const T* qp, int64_t qs, const C* kc, const C* vc, int64_t s0, int64_t s1,
                      int64_t s2, const int32_t* btp, int64_t width, const int32_t* lp, const int32_t* qp0, int64_t B,
                      int64_t h, int64_t kvh, float sc) {
  constexpr int64_t d = kLanes * NV, bs = 16;
  // query heads per pass over V: their sums and a V row in registers (32 on AVX-512, 16 on AVX2)
  constexpr int HC = kLanes == 16 ? (NV <= 4 ? 3 : 2) : 3;
  constexpr int DV = kLanes == 16 ? NV : 4;  // AVX2: 3 heads' sums over half a 64-dim row a pass
  const int64_t group = h / kvh;
  // Sequence b's keys [j_lo, j_hi) (a run of whole blocks but the last): scores, softmax and
  // P . V of every head into out (h x d, heads adjacent); stats (if set): each head's score max
  // and exp sum over the range, for merging ranges.
  // Calls a KV head's query heads take: group_block_scores' (K pass) and heads_times_v's passes
  // over its dims (V pass), in the loops below; each steps a Trickle once a row.
  int64_t k_calls = 0, v_passes = 0;
  for (int64_t hh = 0; hh < group;) {
    const int64_t c = hh + 3 <= group ? 3 : hh + 2 <= group ? 2 : 1;
    hh += c, ++k_calls;
  }
  for (int64_t hh = 0; hh < group;) {
    if (hh + HC <= group) hh += HC, v_passes += NV / DV;
    else if (kLanes == 8 && hh + 2 <= group) hh += 2, v_passes += NV / DV;
    else hh += 1, v_passes += 1;
  }
  const int64_t block_bytes = s0 * static_cast<int64_t>(sizeof(C));
  // AVX2, float16 K: a row widened once for up to 3 heads of its group (group_block_scores)
  constexpr bool grouped = kLanes == 8 && std::is_same_v<C, f16>;
  // Steps of a run of L keys' K pass and V pass (a Trickle's steps).
  auto k_steps = [&](int64_t L) { return grouped ? L * kvh * k_calls : (L + bs - 1) / bs * h; };
  auto v_steps = [&](int64_t L) { return L * kvh * v_passes; };
  // Sequence b's keys [j_lo, j_hi) as a Trickle of their K blocks over `steps` steps.
  auto k_blocks = [&](int64_t b, int64_t j_lo, int64_t j_hi, int64_t steps) {
    return Trickle(kc, btp + b * width + j_lo / bs, block_bytes, (j_hi - j_lo + bs - 1) / bs, steps);
  };
  // Whether a run of L keys' K or V rows is fetched a whole pass ahead (kPassAheadBytes).
  auto pass_ahead = [&](int64_t L) { return L * s1 * static_cast<int64_t>(sizeof(C)) <= kPassAheadBytes; };
  // next: the K blocks this run's V pass fetches (the thread's next claim's, none if this run or
  // that is too long); k_fetched: whether the claim before fetched this run's K; fetch_v: whether
  // the K pass fetches this run's V (if short enough).
  auto attend = [&](int64_t b, int64_t j_lo, int64_t j_hi, auto* out, float* stats, auto&& next, bool k_fetched,
                    bool fetch_v) {
    thread_local std::vector<float> scores, qbuf;
    const int64_t t = qp0[b], L = j_hi - j_lo;
    scores.resize(static_cast<size_t>(h * L));
    qbuf.resize(static_cast<size_t>(h * d));
    float* sp = scores.data();
    const int32_t* table = btp + b * width + j_lo / bs;
    const float* qt = as_f32(qp + t * qs, h * d, qbuf.data());  // heads adjacent
    // K pass: this run's V a pass ahead (a short run), and its own K rows two blocks ahead where
    // no claim fetched them; V pass: the next claim's K, or this run's V rows two blocks ahead (a
    // long run, whose V was not fetched).
    const bool ahead = fetch_v && pass_ahead(L);
    Trickle v_ahead = ahead ? Trickle(vc, table, block_bytes, (L + bs - 1) / bs, k_steps(L)) : Trickle();
    Trickle k_next = ahead ? next(v_steps(L)) : Trickle();
    for (int64_t j0 = 0; j0 < L; j0 += bs) {
      const int64_t n = std::min(bs, L - j0);
      const C* kb = kc + table[j0 / bs] * s0;
      if constexpr (grouped) {
        for (int64_t g = 0; g < kvh; ++g) {
          const C* kg = kb + g * s2;
          const C* ahead_rows[2];  // this KV head's rows two blocks on (from the first block, one block on too)
          int n_ahead = 0;
          for (int64_t a = j0 == 0 ? 1 : 2; !k_fetched && a <= 2 && j0 + a * bs < L; ++a)
            ahead_rows[n_ahead++] = kc + table[j0 / bs + a] * s0 + g * s2;
          int64_t hh = g * group;
          const int64_t end = hh + group;
          for (; hh + 3 <= end; hh += 3, n_ahead = 0)
            group_block_scores<NV, 3>(qt + hh * d, kg, s1, n, sc, sp + hh * L + j0, L, ahead_rows, n_ahead, &v_ahead);
          for (; hh + 2 <= end; hh += 2, n_ahead = 0)
            group_block_scores<NV, 2>(qt + hh * d, kg, s1, n, sc, sp + hh * L + j0, L, ahead_rows, n_ahead, &v_ahead);
          for (; hh < end; ++hh, n_ahead = 0)  // a group of one, or a 3k + 1 group's last head
            group_block_scores<NV, 1>(qt + hh * d, kg, s1, n, sc, sp + hh * L + j0, L, ahead_rows, n_ahead, &v_ahead);
        }
        continue;
      }
      // K rows of every KV head ahead (where no claim fetched them), as for V (heads_times_v), a
      // few tokens per head scored
      const int64_t row_bytes = kvh * d * static_cast<int64_t>(sizeof(C));
      for (int64_t hh = 0; hh < h; ++hh) {
        for (int64_t a = j0 == 0 ? 1 : 2; !k_fetched && a <= 2 && j0 + a * bs < L; ++a) {
          const C* next_block = kc + table[j0 / bs + a] * s0;
          for (int64_t o = hh; o < bs; o += h) prefetch_row(next_block + o * s1, row_bytes);
        }
        block_scores<NV>(qt + hh * d, kb + (hh / group) * s2, s1, n, sc, sp + hh * L + j0);
        v_ahead.step();
      }
    }
    softmax_rows(sp, h, L, stats);
    for (int64_t g = 0; g < kvh; ++g) {
      const C* vg = vc + g * s2;
      int64_t hh = g * group;
      const int64_t end = hh + group;
      for (; hh + HC <= end; hh += HC)
        heads_times_v<NV, HC, DV>(sp + hh * L, L, vg, table, s0, s1, bs, out + hh * d, d, !ahead, &k_next);
      for (; kLanes == 8 && hh + 2 <= end; hh += 2)  // a group of 2 or 5 on AVX2
        heads_times_v<NV, 2, DV>(sp + hh * L, L, vg, table, s0, s1, bs, out + hh * d, d, !ahead, &k_next);
      for (; hh < end; ++hh) heads_times_v<NV, 1, NV>(sp + hh * L, L, vg, table, s0, s1, bs, out + hh * d, d, !ahead, &k_next);
    }
  };
  // Fewer decodes than threads (a single stream): each sequence's keys split into `parts` runs of
  // whole blocks, one claim each, merged by their softmax stats (flash-decoding), so a long
  // context's attention does not run on one thread while the others wait.
  const int64_t parts = std::is_same<T, float>::value ? key_runs(B, lp, qp0, bs, kMinSplitBlocks) : 1;
  if (parts <= 1) {
    // a sequence a claim: their lengths differ, so fixed shares by count would not be even
    auto decode = [&](int64_t b) { return b < B && qp0[b + 1] - qp0[b] == 1; };
    std::vector<int64_t> fetched(static_cast<size_t>(at::get_num_threads()), -1);  // per thread: the claim whose K it fetched
    for_each_claim(B, [&](int64_t b, int64_t after) {
      int64_t& f = fetched[at::get_thread_num()];
      const bool warm = f == b;
      f = decode(b) && decode(after) && pass_ahead(lp[b]) && pass_ahead(lp[after]) ? after : -1;
      if (!decode(b)) return;
      auto next = [&](int64_t steps) { return f < 0 ? Trickle() : k_blocks(f, 0, lp[f], steps); };
      attend(b, 0, lp[b], op0 + qp0[b] * os, nullptr, next, warm, true);
    });
    return;
  }
  std::vector<float> part_out(static_cast<size_t>(B * parts * h * d)), stats(static_cast<size_t>(B * parts * h * 2));
  // A sequence's runs split over the threads: each thread has one or two, so no next claim to
  // fetch; fetching V a pass ahead measured no better here (one stream, 160 and 2,048 tokens).
  auto no_next = [](int64_t) { return Trickle(); };
  for_each_key_run(B, parts, lp, qp0, h, stats.data(), [&](int64_t b, int64_t j_lo, int64_t j_hi, int64_t c) {
    attend(b, j_lo, j_hi, part_out.data() + c * h * d, stats.data() + c * h * 2, no_next, false, false);
  });
  merge_runs(op0, os, qp0, B, parts, h, d, part_out.data(), stats.data());
}
#endif  // PAGEBUS_SIMD

// Attention for the sequences with one query token (decodes), reading the paged caches in
// place: out[t] for t = query_start_loc[b] of every such b; other rows are left untouched.
// One work item per sequence, all its heads: a block's K (then V) rows are read in storage
// order, every KV head of a token before the next token, and each K/V row once for the
// query heads that share it.
template <typename T>
void decode_rows(float* op0, int64_t os, const T* qp, int64_t qs, const T* kc, const T* vc, int64_t s0, int64_t s1,
                 int64_t s2, const int32_t* btp, int64_t width, const int32_t* lp, const int32_t* qp0, int64_t B,
                 int64_t h, int64_t kvh, int64_t d, int64_t bs, float sc, T* out_t) {
  const int64_t group = h / kvh;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores, qbuf(static_cast<size_t>(h * d)), obuf(static_cast<size_t>(h * d)),
        row(static_cast<size_t>(d));
    for (int64_t b = b0; b < b1; ++b) {
      if (qp0[b + 1] - qp0[b] != 1) continue;
      const int64_t t = qp0[b], L = lp[b];
      scores.resize(static_cast<size_t>(h * L));
      float* sp = scores.data();
      const int32_t* table = btp + b * width;
      const float* qt = as_f32(qp + t * qs, h * d, qbuf.data());  // heads adjacent
      for (int64_t j0 = 0; j0 < L; j0 += bs) {  // block by block: no division per key
        const int64_t base = table[j0 / bs] * s0, n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o)
          for (int64_t g = 0; g < kvh; ++g)
            group_dots(qt + g * group * d, as_f32(kc + base + o * s1 + g * s2, d, row.data()), group, d, sc,
                       sp + g * group * L + j0 + o, L);
      }
      softmax_rows(sp, h, L);
      // float32 output accumulates in place; bf16 in a float buffer, rounded once at the end
      float* ot = out_t == nullptr ? op0 + t * os : obuf.data();
      std::fill(ot, ot + h * d, 0.f);
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const int64_t base = table[j0 / bs] * s0, n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o)
          for (int64_t g = 0; g < kvh; ++g) {
            const float* __restrict__ vr = as_f32(vc + base + o * s1 + g * s2, d, row.data());
            for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
              const float p = sp[hh * L + j0 + o];
              float* __restrict__ oh = ot + hh * d;
#pragma omp simd
              for (int64_t i = 0; i < d; ++i) oh[i] += p * vr[i];
            }
          }
      }
      if (out_t != nullptr)
        for (int64_t i = 0; i < h * d; ++i) out_t[t * os + i] = from_f32<T>(ot[i]);
    }
  });
}

// The checks both paged attentions make of their arguments; the element type they share.
torch::ScalarType check_paged_args(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                   const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                   const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                                   const char* what) {
  const auto st = check_dtype({&out, &q}, what);
  check_caches(k_cache, v_cache, st, what);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              what, ": int32 block tables, lengths and query starts expected");
  const CacheDims kd = cache_dims(k_cache);
  const int64_t h = q.size(1), d = q.size(2), kvh = kd.kvh;
  TORCH_CHECK(h % kvh == 0 && kd.d == d, what, ": head counts or sizes disagree");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && out.stride(2) == 1 && out.stride(1) == d,
              what, ": head vectors must be contiguous");
  if (kd.pairs)
    check_pairs(k_cache, v_cache, what);
  else
    TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
                what, ": caches must hold contiguous head vectors, in one layout");
  return st;
}

// Attention for the sequences with one query token (decodes), reading the paged caches in
// place: out[t] for t = query_start_loc[b] of every such b; other rows are left untouched.
// One work item per sequence, all its heads: a block's K (then V) rows are read in storage
// order, every KV head of a token before the next token, and each K/V row once for the
// query heads that share it. Scores, softmax and sums in float32 (the ref's upcast).
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                      double scale) {
  const auto st = check_paged_args(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, "decode_attention");
  const CacheDims kd = cache_dims(k_cache);
  const int64_t h = q.size(1), d = q.size(2), bs = kd.bs, kvh = kd.kvh;
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t B = lens.size(0), width = bt.size(1);
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qp0 = qsl.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    if (qp0[b + 1] - qp0[b] == 1) TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "decode_attention: bad length");
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (kd.pairs) {
    TORCH_CHECK(bs == 16 && (d == 64 || d == 128), "decode_attention: a token-pairs K cache needs 16-token blocks "
                "of head_dim 64 or 128");
    (d == 64 ? decode_rows_pairs<4, true> : decode_rows_pairs<8, true>)(
        out.data_ptr<bf16>(), out.stride(0), q.data_ptr<bf16>(), q.stride(0), k_cache.data_ptr<bf16>(),
        v_cache.data_ptr<bf16>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), btp, width, lp, qp0, B, h,
        kvh, sc, k_cache.stride(0));
    return;
  }
#endif
  TORCH_CHECK(!kd.pairs, "decode_attention: this build has no kernel for a token-pairs K cache (AVX-512 BF16)");
  const bool half = k_cache.scalar_type() != st;  // float16 beside float32 (check_caches)
#ifdef PAGEBUS_F16
  if (half) {
    TORCH_CHECK(bs == 16 && (d == 64 || d == 128), "decode_attention: a float16 cache needs 16-token blocks of "
                "head_dim 64 or 128");
    (d == 64 ? decode_rows_fast<64 / kLanes, float, f16> : decode_rows_fast<128 / kLanes, float, f16>)(
        out.data_ptr<float>(), out.stride(0), q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<f16>(),
        v_cache.data_ptr<f16>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), btp, width, lp, qp0, B, h,
        kvh, sc);
    return;
  }
#endif
  TORCH_CHECK(!half, "decode_attention: this build has no kernel for a float16 cache");
#ifdef PAGEBUS_SIMD
  if (bs == 16 && (d == 64 || d == 128)) {
#define FAST(T)                                                                                                   \
  (d == 64 ? decode_rows_fast<64 / kLanes, T> : decode_rows_fast<128 / kLanes, T>)(                               \
      out.data_ptr<T>(), out.stride(0), q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), \
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), btp, width, lp, qp0, B, h, kvh, sc)
    if (st == torch::kFloat32) {
      FAST(float);
      return;
    }
#ifdef __AVX512BF16__
    (d == 64 ? decode_rows_pairs<4, false> : decode_rows_pairs<8, false>)(
        out.data_ptr<bf16>(), out.stride(0), q.data_ptr<bf16>(), q.stride(0), k_cache.data_ptr<bf16>(),
        v_cache.data_ptr<bf16>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), btp, width, lp, qp0, B, h,
        kvh, sc, k_cache.stride(0));
    return;
#endif
#undef FAST
  }
#endif
  DISPATCH(st, {
    const bool f = st == torch::kFloat32;
    decode_rows<T>(f ? reinterpret_cast<float*>(out.data_ptr()) : nullptr, out.stride(0), q.data_ptr<T>(),
                   q.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0),
                   k_cache.stride(1), k_cache.stride(2), btp, width, lp, qp0, B, h, kvh, d, bs, sc,
                   f ? nullptr : out.data_ptr<T>());
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Xeon since Sapphire Rapids): 8 tile registers of up to 16 rows x 64 bytes, and
// tdpbf16ps, a 16 x 32 bf16 tile times a 32 x 16 one (16 pairs of k, each column's pair
// adjacent) into 16 x 16 fp32 sums: 16x the products of a vdpbf16ps. The bf16 matmul
// (amx_tiles_kernel) and prefill attention (prefill_item_amx) use it.
#define PAGEBUS_AMX 1

// Linux gives a process the 8 KiB tile state only when it asks (arch_prctl); without it the
// first tile instruction faults, so every AMX path checks this first.
bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every register 16 rows of 64 bytes: sums (16 fp32), x (32 bf16) and W (16 pairs of bf16).
inline void amx_configure() {
  AmxConfig c;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

#endif

#ifdef PAGEBUS_SIMD
#ifdef __AVX512F__
// 16 rows of 16 floats -> 16 columns: r[i] lane j becomes r[j] lane i.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], _MM_SHUFFLE(2, 0, 2, 0));
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], _MM_SHUFFLE(3, 1, 3, 1));
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(2, 0, 2, 0));
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], _MM_SHUFFLE(3, 1, 3, 1));
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(2, 0, 2, 0));
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], _MM_SHUFFLE(3, 1, 3, 1));
  }
}
inline void transpose_lanes(vf* r) { transpose16(r); }
inline float max_lanes(vf v) { return _mm512_reduce_max_ps(v); }
inline float add_lanes(vf v) { return _mm512_reduce_add_ps(v); }
// v's first n lanes (n clamped to 0..16), `other`'s in the rest.
inline vf vfirst(vf v, int64_t n, vf other) {
  const int64_t k = std::min<int64_t>(std::max<int64_t>(n, 0), 16);
  return _mm512_mask_blend_ps(static_cast<__mmask16>((1u << k) - 1), other, v);
}
#else
// 8 rows of 8 floats -> 8 columns (AVX2's transpose16).
inline void transpose_lanes(vf* r) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
inline float max_lanes(vf v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float add_lanes(vf v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline vf vfirst(vf v, int64_t n, vf other) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(std::max<int64_t>(n, 0), 8))), lane);
  return _mm256_blendv_ps(other, v, _mm256_castsi256_ps(keep));
}
#endif  // __AVX512F__

// Whether prefill scores multiply bf16 pairs (vdpbf16ps) rather than float32 values.
template <typename T>
constexpr bool kPairScores = false;
#ifdef __AVX512BF16__
template <>
constexpr bool kPairScores<bf16> = true;
#endif

// Keys a flash step takes (two cache blocks): the softmax's per-step work (a max, a sum, one
// rescale of the outputs) is paid once per 32 keys, while K and V of the step (8 KiB each at
// d = 64) stay in L1 beside the rows' q and sums. AVX2 (Zen 3), 1,024-token prompt, one
// thread: 16 keys a step 36 GFLOP/s, 32 keys 48-55, 64 keys 40-41 (L1 misses).
constexpr int64_t kFlashKeys = 32;

// RB query rows (float32, pre-scaled; `valid[r]` of the keys visible to row r, <= 0: none)
// against one step's keys, `groups` 16-key groups of them: kt [d][kFlashKeys] (K transposed),
// vb [kFlashKeys][d] (V), both float32. Updates each row's running max m, sum l and
// unnormalised output o (flash attention's online softmax). RB rows at once share every K and
// V load and keep independent FMA chains in flight: a 16-key group's scores are KV vectors (1 on
// AVX-512, 2 on AVX2), each summed in CH chains over the dims, so RB * KV * CH chains (8 in
// every blocking used); the V sums go DC vectors of the d dims at a time (all of them on
// AVX-512, 8 / RB on AVX2: its 16 registers).
// float32 caches: q float32, pre-scaled, kt [d][keys]. bf16 caches (T = bf16): q the raw bf16
// rows and kt [d / 2][keys] pairs of K, multiplied by vdpbf16ps (products of bf16 values are
// exact in float32, as the float path's are), the scale applied to the sums: half the
// instructions of the float path for the scores; and vb [kFlashKeys / 2][d] pairs of keys' V
// (stage_v_pairs), times P rounded to bf16 in pairs of keys, as flash attention rounds P (and
// the decode kernel, softmax_pairs): half the instructions of the float path for P . V too.
// One layer of a 1,024-token prompt on a Zen 4, two threads, interleaved medians: head_dim 64
// 7.6-9.5 -> 5.8-7.3 ms (128-159 -> 166-210 GFLOP/s), head_dim 128 17.7 -> 10.5 ms.
template <int NV, int RB, typename T>
inline void flash_rows(const void* qv, const float* kt, const void* vb, int64_t groups, const int64_t* valid,
                       float* m, float* l, float* o, float sc) {
  constexpr int64_t d = 16 * NV, KB = kFlashKeys;
  constexpr int KV = 16 / kLanes, CH = KV == 1 ? 2 : 1, DV = static_cast<int>(d / kLanes);
  constexpr int DC = kLanes == 16 ? DV : std::min(DV, std::max(1, 8 / RB));
  // The scores leave their registers once per group: with the softmax below reading them by a
  // runtime row index, GCC kept the sums in memory and stored all of them on every step of the
  // loop over d (AVX2: 24 -> 38 GFLOP/s for a 1,024-token prompt on one thread).
  alignas(64) float scores[RB][KB];
  for (int64_t g = 0; g < groups; ++g) {
    const float* kg = kt + 16 * g;
    vf acc[RB][KV * CH];
    for (int r = 0; r < RB; ++r)
      for (int a = 0; a < KV * CH; ++a) acc[r][a] = vzero();
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, bf16>) {
      const int32_t* q = static_cast<const int32_t*>(qv);  // pairs of bf16
      for (int64_t c = 0; c < d / 2; c += 2) {
        const __m512 k0 = _mm512_loadu_ps(kg + c * KB), k1 = _mm512_loadu_ps(kg + (c + 1) * KB);
        for (int r = 0; r < RB; ++r) {
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_set1_epi32(q[r * d / 2 + c]), (__m512bh)k0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)_mm512_set1_epi32(q[r * d / 2 + c + 1]), (__m512bh)k1);
        }
      }
      for (int r = 0; r < RB; ++r) acc[r][0] = _mm512_mul_ps(acc[r][0], _mm512_set1_ps(sc));
      for (int r = 0; r < RB; ++r) acc[r][1] = _mm512_mul_ps(acc[r][1], _mm512_set1_ps(sc));
    } else
#endif
    {
      const float* q = static_cast<const float*>(qv);
      for (int64_t c = 0; c < d; c += CH)
        for (int u = 0; u < CH; ++u)
          for (int kv = 0; kv < KV; ++kv) {
            vf kk = vload(kg + (c + u) * KB + kv * kLanes);
            in_register(kk);
            for (int r = 0; r < RB; ++r) acc[r][u * KV + kv] = vfmadd(vset1(q[r * d + c + u]), kk, acc[r][u * KV + kv]);
          }
    }
    for (int r = 0; r < RB; ++r)
      for (int kv = 0; kv < KV; ++kv) {
        vf s = acc[r][kv];
        for (int u = 1; u < CH; ++u) s = vadd(s, acc[r][u * KV + kv]);
        vstore(scores[r] + 16 * g + kv * kLanes, s);
      }
  }
  const int64_t vecs = groups * KV;  // score vectors of this step
  alignas(64) float pj[RB][KB];
  float alpha[RB];
  int64_t kmax = 0;
  const vf minus_inf = vset1(-std::numeric_limits<float>::infinity());
  bool full = true;  // every row sees every key of the step: all but the diagonal's steps
  for (int r = 0; r < RB; ++r) full = full && valid[r] >= 16 * groups;
  if (full) {
    // no masks, and each phase for all the rows before the next, so the rows' max and exp chains
    // overlap: bitwise the masked path's values; a 1,024-token prompt's prefill 0.97x (Zen 3,
    // two interleaved runs of 12 and 16 rounds)
    kmax = 16 * groups;
    vf top[RB];
    for (int r = 0; r < RB; ++r) {
      top[r] = vload(scores[r]);
      for (int64_t i = 1; i < vecs; ++i) top[r] = vmax(top[r], vload(scores[r] + i * kLanes));
    }
    float mnew[RB];
    for (int r = 0; r < RB; ++r) {
      mnew[r] = std::max(m[r], max_lanes(top[r]));
      alpha[r] = fast_exp(m[r] - mnew[r]);
    }
    for (int r = 0; r < RB; ++r) {
      const vf mv = vset1(mnew[r]);
      vf total = vzero();
      for (int64_t i = 0; i < vecs; ++i) {
        const vf p = vexp(vsub(vload(scores[r] + i * kLanes), mv));
        total = vadd(total, p);
        vstore(pj[r] + i * kLanes, p);
      }
      l[r] = l[r] * alpha[r] + add_lanes(total);
      m[r] = mnew[r];
    }
  }
  for (int r = 0; r < RB && !full; ++r) {
    if (valid[r] <= 0) {  // every key of this step is after row r's position
      for (int64_t i = 0; i < vecs; ++i) vstore(pj[r] + i * kLanes, vzero());
      alpha[r] = 1.f;
      continue;
    }
    const int64_t n = std::min<int64_t>(16 * groups, valid[r]);
    kmax = std::max(kmax, n);
    vf top = minus_inf;
    for (int64_t i = 0; i < vecs; ++i) {
      const vf s = vfirst(vload(scores[r] + i * kLanes), n - i * kLanes, minus_inf);
      vstore(scores[r] + i * kLanes, s);
      top = vmax(top, s);
    }
    const float mnew = std::max(m[r], max_lanes(top));
    alpha[r] = fast_exp(m[r] - mnew);
    const vf mv = vset1(mnew);
    vf total = vzero();
    for (int64_t i = 0; i < vecs; ++i) {
      const vf p = vfirst(vexp(vsub(vload(scores[r] + i * kLanes), mv)), n - i * kLanes, vzero());
      total = vadd(total, p);
      vstore(pj[r] + i * kLanes, p);
    }
    l[r] = l[r] * alpha[r] + add_lanes(total);
    m[r] = mnew;
  }
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, bf16>) {
    alignas(64) int32_t pp[RB][KB / 2];  // (p[2i], p[2i + 1]) rounded to bf16
    for (int r = 0; r < RB; ++r)
      for (int64_t i = 0; i < vecs; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r] + 8 * i), (__m256i)_mm512_cvtneps_pbh(vload(pj[r] + 16 * i)));
    const int32_t* vp = static_cast<const int32_t*>(vb);
    __m512 out[RB][DV];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < DV; ++c) out[r][c] = vmul(vload(o + r * d + 16 * c), vset1(alpha[r]));
    for (int64_t i = 0; i < (kmax + 1) / 2; ++i) {
      __m512i vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = _mm512_load_si512(vp + i * d + 16 * c);
      for (int r = 0; r < RB; ++r) {
        const __m512bh pk = (__m512bh)_mm512_set1_epi32(pp[r][i]);
        for (int c = 0; c < DV; ++c) out[r][c] = _mm512_dpbf16_ps(out[r][c], (__m512bh)vv[c], pk);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < DV; ++c) vstore(o + r * d + 16 * c, out[r][c]);
    return;
  }
#endif
  for (int c0 = 0; c0 < DV; c0 += DC) {
    vf out[RB][DC];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < DC; ++c) out[r][c] = vmul(vload(o + r * d + kLanes * (c0 + c)), vset1(alpha[r]));
    for (int64_t k = 0; k < kmax; ++k) {
      vf vv[DC];
      for (int c = 0; c < DC; ++c) {
        vv[c] = vload(static_cast<const float*>(vb) + k * d + kLanes * (c0 + c));
        in_register(vv[c]);
      }
      for (int r = 0; r < RB; ++r) {
        const vf pk = vset1(pj[r][k]);
        for (int c = 0; c < DC; ++c) out[r][c] = vfmadd(pk, vv[c], out[r][c]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < DC; ++c) vstore(o + r * d + kLanes * (c0 + c), out[r][c]);
  }
}

#ifdef __AVX512BF16__
// 16 V rows of a block (bf16, `nk` of them valid: the rest zeros, as 0 x NaN is NaN) as 8 pairs
// of keys for flash_rows: out[i][c] = (v[2i][c], v[2i + 1][c]) in one int32, d of them a pair.
template <int NV>
inline void stage_v_pairs(const bf16* v, int64_t stride, int64_t nk, int32_t* out) {
  constexpr int64_t d = 16 * NV;
  alignas(64) static const int16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const int16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i a = 2 * i < nk ? _mm512_loadu_si512(v + 2 * i * stride + c) : _mm512_setzero_si512();
      const __m512i b = 2 * i + 1 < nk ? _mm512_loadu_si512(v + (2 * i + 1) * stride + c) : _mm512_setzero_si512();
      _mm512_store_si512(out + i * d + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(out + i * d + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
}
#endif

// A prefill work item's outputs: row r of query head j (o [group][16][d], float32 sums) times 1 /
// its softmax total l[j * 16 + r], into out + r * os + j * d.
template <int NV, typename T>
inline void store_normalized(const float* o, const float* l, int64_t group, int64_t rows, T* out, int64_t os) {
  constexpr int64_t d = 16 * NV, QB = 16;
  for (int64_t j = 0; j < group; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const vf inv = vset1(1.0f / l[j * QB + r]);
      const float* orow = o + (j * QB + r) * d;
      for (int64_t c = 0; c < d; c += kLanes) vstore(out + r * os + j * d + c, vmul(vload(orow + c), inv));
    }
}

#ifdef PAGEBUS_AMX
// One prefill work item (prefill_rows: `rows` <= 16 query positions from t0, the `group` query
// heads of KV head g) on AMX, 32 keys (two cache blocks) a step, with the online softmax of
// flash_rows in float32 between the two products:
//   S = Q K^T   A: a head's 16 query rows, 32 dims a step; B: K transposed into pairs of dims x
//               16 keys (the kt layout flash_rows's bf16 scores use), one tile per block and step;
//   O += P V    A: P rounded to bf16, 16 rows x 32 keys; B: V with two keys' rows interleaved
//               (pairs of keys x 16 dims), one tile per 16 dims; the sums come out per step and
//               are added to O in float32 after O is rescaled by the softmax's correction.
// Rows past `rows`, keys past L: zeros (a key's V must be zero, not the cache's garbage, as 0 x
// NaN is NaN). Tiles (amx_configure's 16 x 64 bytes): 0 scores, 1 A, 2 B, 3-6 P V sums.
template <int NV>
void prefill_item_amx(bf16* op0, int64_t os, const bf16* qp, int64_t qs, const bf16* kc, const bf16* vc, int64_t s0,
                      int64_t s1, int64_t s2, const int32_t* table, int64_t L, int64_t ctx, int64_t i0, int64_t rows,
                      int64_t t0, int64_t g, int64_t group, float sc, bf16* qb, float* o, float* m, float* l) {
  constexpr int64_t d = 16 * NV, bs = 16, QB = 16, KS = 32;
  alignas(64) int32_t kt[2][NV / 2][16 * 16];  // per block, per 32 dims: [dim pair][key]
  alignas(64) bf16 vp[NV][16 * 32];            // per 16 dims: [key pair][dim][2]
  alignas(64) float sv[QB * KS], pv[QB * 64];
  alignas(64) bf16 pb[QB * KS];
  std::memset(qb, 0, sizeof(bf16) * group * QB * d);
  for (int64_t j = 0; j < group; ++j)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(qb + (j * QB + r) * d, qp + (t0 + r) * qs + (g * group + j) * d, d * sizeof(bf16));
  std::fill(o, o + group * QB * d, 0.f);
  std::fill(m, m + group * QB, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group * QB, 0.f);
  alignas(64) static const int16_t kPairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i pair_idx = _mm512_load_si512(kPairs);  // dim i of key a, then of key b
  const int64_t last = ctx + i0 + rows - 1;
  for (int64_t j0 = 0; j0 <= last; j0 += KS) {
    const int64_t nk = std::min(KS, L - j0);  // keys that exist in this step
    for (int blk = 0; blk < 2; ++blk) {
      const int64_t n = std::max<int64_t>(0, std::min(bs, nk - blk * bs));
      const bf16* kb = n > 0 ? kc + table[(j0 + blk * bs) / bs] * s0 + g * s2 : nullptr;
      for (int c = 0; c < NV / 2; ++c) {
        __m512 r16[16];
        for (int64_t k = 0; k < 16; ++k)
          r16[k] = k < n ? _mm512_castsi512_ps(_mm512_loadu_si512(kb + k * s1 + 32 * c)) : _mm512_setzero_ps();
        transpose16(r16);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(kt[blk][c] + 16 * i), r16[i]);
      }
    }
    for (int64_t kp = 0; kp < KS / 2; ++kp) {  // keys 2kp, 2kp + 1, interleaved per 16 dims
      const int64_t k0 = 2 * kp, k1 = k0 + 1;
      const bf16* va = k0 < nk ? vc + table[(j0 + k0) / bs] * s0 + ((j0 + k0) % bs) * s1 + g * s2 : nullptr;
      const bf16* vb = k1 < nk ? vc + table[(j0 + k1) / bs] * s0 + ((j0 + k1) % bs) * s1 + g * s2 : nullptr;
      for (int c = 0; c < NV; ++c) {
        const __m512i a = va ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 16 * c)))
                             : _mm512_setzero_si512();
        const __m512i b = vb ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 16 * c)))
                             : _mm512_setzero_si512();
        _mm512_store_si512(vp[c] + kp * 32, _mm512_permutex2var_epi16(a, pair_idx, b));
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      const bf16* qj = qb + j * QB * d;
      for (int blk = 0; blk < 2; ++blk) {
        _tile_zero(0);
        for (int c = 0; c < NV / 2; ++c) {
          _tile_loadd(1, qj + 32 * c, d * static_cast<int64_t>(sizeof(bf16)));
          _tile_loadd(2, kt[blk][c], 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sv + 16 * blk, KS * sizeof(float));
      }
      float alpha[QB];
      for (int64_t r = 0; r < QB; ++r) {
        const int64_t valid = r < rows ? std::min(nk, ctx + i0 + r - j0 + 1) : 0;  // keys <= this position
        float* mr = m + j * QB + r;
        float* lr = l + j * QB + r;
        if (valid <= 0) {
          _mm512_store_si512(pb + r * KS, _mm512_setzero_si512());
          alpha[r] = 1.f;
          continue;
        }
        const __mmask16 k0 = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
        const __mmask16 k1 = static_cast<__mmask16>(valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
        const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), scv = _mm512_set1_ps(sc);
        const __m512 a0 = _mm512_mask_blend_ps(k0, ninf, _mm512_mul_ps(_mm512_load_ps(sv + r * KS), scv));
        const __m512 a1 = _mm512_mask_blend_ps(k1, ninf, _mm512_mul_ps(_mm512_load_ps(sv + r * KS + 16), scv));
        const float mnew = std::max(*mr, _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
        alpha[r] = fast_exp(*mr - mnew);
        const __m512 mv = _mm512_set1_ps(mnew);
        const __m512 p0 = _mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(a0, mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(a1, mv)));
        *lr = *lr * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        *mr = mnew;
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * KS), (__m256i)_mm512_cvtneps_pbh(p0));
        _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * KS + 16), (__m256i)_mm512_cvtneps_pbh(p1));
      }
      for (int half = 0; half < NV / 4; ++half) {  // 64 dims at a time: 4 sum tiles
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_loadd(1, pb, KS * sizeof(bf16));
        _tile_loadd(2, vp[4 * half], 64);
        _tile_dpbf16ps(3, 1, 2);
        _tile_loadd(2, vp[4 * half + 1], 64);
        _tile_dpbf16ps(4, 1, 2);
        _tile_loadd(2, vp[4 * half + 2], 64);
        _tile_dpbf16ps(5, 1, 2);
        _tile_loadd(2, vp[4 * half + 3], 64);
        _tile_dpbf16ps(6, 1, 2);
        constexpr int64_t ps = 64 * sizeof(float);
        _tile_stored(3, pv, ps);
        _tile_stored(4, pv + 16, ps);
        _tile_stored(5, pv + 32, ps);
        _tile_stored(6, pv + 48, ps);
        for (int64_t r = 0; r < rows; ++r) {
          float* orow = o + (j * QB + r) * d + 64 * half;
          const __m512 al = _mm512_set1_ps(alpha[r]);
          for (int c = 0; c < 4; ++c)
            _mm512_storeu_ps(orow + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * c), al, _mm512_load_ps(pv + r * 64 + 16 * c)));
        }
      }
    }
  }
  store_normalized<NV>(o, l, group, rows, op0 + t0 * os + g * group * d, os);
}
#endif

// Prefill chunks (sequences with several query tokens), reading the paged caches in place:
// causal attention with an online softmax (flash attention's), one work item per (sequence,
// KV head, 16 query positions) for all the query heads sharing that KV head. Each step's
// kFlashKeys keys (whole 16-token blocks) of K are transposed and V widened once per item into
// float32 buffers (bf16: K into pairs of dims, V into pairs of keys); query rows then score 16
// keys per vector or pair of vectors (no horizontal sums) and add the V rows (flash_rows).
// AVX-512 and AVX2 (float32 only) builds.
// Rows at position p see keys 0..p (the chunk's own and the cached context before it).
// torch's SDPA, which this replaces for bf16/fp32 caches of 16-token blocks, ran these shapes
// at 80-145 GFLOP/s on two threads, after a gather and an upcast of each sequence's K/V.
// KP: K is a token-pairs cache (ks0 its block stride; s0-s2 are V's strides), whose head runs
// [d / 2][16] pairs are already the bf16 scores' transposed layout: copied, not transposed, and
// read in place, where a row copy of the chunk's blocks was gathered for every layer before.
template <int NV, typename T, bool KP = false, typename C = T>
void prefill_rows(T* op0, int64_t os, const T* qp, int64_t qs, const C* kc, const C* vc, int64_t s0, int64_t s1,
                  int64_t s2, const int32_t* btp, int64_t width, const int32_t* lp, const int32_t* qp0, int64_t B,
                  int64_t h, int64_t kvh, float sc, int64_t ks0) {
  static_assert(!KP || kPairScores<T>, "a token-pairs K cache is read by the bf16 pair scores only");
  constexpr int64_t d = 16 * NV, bs = 16, QB = 16, KB = kFlashKeys;
  const int64_t group = h / kvh;
  std::vector<int64_t> first(static_cast<size_t>(B + 1), 0);  // first work item of each sequence
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qp0[b + 1] - qp0[b];
    first[b + 1] = first[b] + (n > 1 ? kvh * ((n + QB - 1) / QB) : 0);
  }
  // Work items cost their count of keys (causal: the later query blocks see more), so the
  // threads split the items by that cost, not by count: for one 1,024-token prompt an even
  // split by count gave one thread 1.4x the other's keys, and it waited 29% of the time.
  std::vector<int64_t> cost(static_cast<size_t>(first[B] + 1), 0);  // keys of the items before each
  for (int64_t b = 0, w = 0; b < B; ++b) {
    const int64_t qlen = qp0[b + 1] - qp0[b], blocks_q = (qlen + QB - 1) / QB, ctx = lp[b] - qlen;
    for (int64_t i = 0; i < first[b + 1] - first[b]; ++i, ++w)
      cost[w + 1] = cost[w] + ctx + std::min(qlen, (i % blocks_q + 1) * QB);
  }
  const auto items = [&](int64_t w0, int64_t w1) {
    // 64-byte aligned scratch: every vector load and store of it stays within one cache line
    // (16 x 128-token prompts, one layer: 2.41 -> 2.14 ms with them aligned)
    alignas(64) float kt[d * KB], vb[KB * d];
    std::vector<float> qo(static_cast<size_t>(2 * group * QB * d + 16)), m(static_cast<size_t>(group * QB)),
        l(static_cast<size_t>(group * QB));
    float* qf = qo.data() + (16 - reinterpret_cast<uintptr_t>(qo.data()) / 4 % 16) % 16;
    float* o = qf + group * QB * d;
#ifdef PAGEBUS_AMX
    const bool amx = !KP && std::is_same_v<T, bf16> && amx_usable();  // prefill_item_amx reads K rows
    if (amx) amx_configure();
#endif
    int64_t b = 0;
    for (int64_t w = w0; w < w1; ++w) {
      while (first[b + 1] <= w) ++b;
      const int64_t qlen = qp0[b + 1] - qp0[b], L = lp[b], ctx = L - qlen, blocks_q = (qlen + QB - 1) / QB;
      const int64_t g = (w - first[b]) / blocks_q, i0 = (w - first[b]) % blocks_q * QB;
      const int64_t rows = std::min(QB, qlen - i0), t0 = qp0[b] + i0;
      const int32_t* table = btp + b * width;
#ifdef PAGEBUS_AMX
      if constexpr (std::is_same_v<T, bf16>) {
        if (amx) {
          prefill_item_amx<NV>(op0, os, qp, qs, kc, vc, s0, s1, s2, table, L, ctx, i0, rows, t0, g, group, sc,
                               reinterpret_cast<bf16*>(qf), o, m.data(), l.data());
          continue;
        }
      }
#endif
      constexpr bool pairs = kPairScores<T>;  // bf16 scores by vdpbf16ps (flash_rows)
      for (int64_t j = 0; j < group; ++j)
        for (int64_t r = 0; r < rows; ++r) {
          const T* src = qp + (t0 + r) * qs + (g * group + j) * d;
          if constexpr (pairs) {
            std::memcpy(reinterpret_cast<T*>(qf) + (j * QB + r) * d, src, d * sizeof(T));
          } else {
            float* dst = qf + (j * QB + r) * d;
            for (int64_t c = 0; c < d; ++c) dst[c] = f32(src[c]) * sc;
          }
        }
      std::fill(o, o + group * QB * d, 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t last = ctx + i0 + rows - 1;  // the last position of these rows
      for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        const int64_t n = std::min({KB, L - j0, last + 1 - j0});  // keys one of these rows sees
        const int64_t groups = (n + bs - 1) / bs;
        for (int64_t gi = 0; gi < groups; ++gi) {
          const int64_t nk = std::min(bs, n - gi * bs);
          const C* kb = KP ? kc + table[j0 / bs + gi] * ks0 + g * d * bs : kc + table[j0 / bs + gi] * s0 + g * s2;
          const C* vbk = vc + table[j0 / bs + gi] * s0 + g * s2;
          if constexpr (pairs) {
#ifdef __AVX512BF16__
            stage_v_pairs<NV>(vbk, s1, nk, reinterpret_cast<int32_t*>(vb) + gi * (bs / 2) * d);
#endif
          } else {
            for (int64_t k = 0; k < bs; ++k)  // V widened
              for (int64_t c = 0; c < d; c += kLanes)
                vstore(vb + (gi * bs + k) * d + c, k < nk ? vload(vbk + k * s1 + c) : vzero());
          }
          if constexpr (KP) {
#ifdef __AVX512BF16__
            const __mmask16 keys = static_cast<__mmask16>(nk >= 16 ? 0xFFFF : (1u << nk) - 1);
            for (int64_t c = 0; c < d / 2; ++c)
              _mm512_store_si512(reinterpret_cast<int32_t*>(kt) + c * KB + gi * bs,
                                 _mm512_maskz_loadu_epi32(keys, reinterpret_cast<const int32_t*>(kb) + c * bs));
#endif
            continue;
          }
          // K transposed kLanes keys x kLanes columns (bf16: pairs of columns) at a time
          for (int64_t k0 = 0; k0 < bs; k0 += kLanes)
            for (int64_t c = 0; c < (pairs ? d / 2 : d) / kLanes; ++c) {
              vf kr16[kLanes];
              for (int64_t k = 0; k < kLanes; ++k) {
                const C* kr = kb + (k0 + k) * s1;
                if (k0 + k >= nk) {
                  kr16[k] = vzero();
                } else if constexpr (pairs) {
#ifdef __AVX512BF16__
                  kr16[k] = _mm512_castsi512_ps(_mm512_loadu_si512(kr + 32 * c));
#endif
                } else {
                  kr16[k] = vload(kr + kLanes * c);
                }
              }
              transpose_lanes(kr16);
              for (int64_t i = 0; i < kLanes; ++i) vstore(kt + (kLanes * c + i) * KB + gi * bs + k0, kr16[i]);
            }
        }
        // rows a call: 8 score chains (flash_rows), and as many V sums as the registers hold
        constexpr int RB = kLanes == 16 && NV > 4 ? 2 : 4;
        auto qrow = [&](int64_t i) -> const void* {
          if constexpr (pairs) return reinterpret_cast<const T*>(qf) + i * d;
          return qf + i * d;
        };
        int64_t valid[QB];
        for (int64_t r = 0; r < rows; ++r) valid[r] = ctx + i0 + r - j0 + 1;  // keys <= this position
        for (int64_t j = 0; j < group; ++j) {
          const int64_t at = j * QB;
          int64_t r = 0;
          for (; r + RB <= rows; r += RB)
            flash_rows<NV, RB, T>(qrow(at + r), kt, vb, groups, valid + r, m.data() + at + r, l.data() + at + r,
                                  o + (at + r) * d, sc);
          for (; r < rows; ++r)
            flash_rows<NV, 1, T>(qrow(at + r), kt, vb, groups, valid + r, m.data() + at + r, l.data() + at + r,
                                 o + (at + r) * d, sc);
        }
      }
      store_normalized<NV>(o, l.data(), group, rows, op0 + t0 * os + g * group * d, os);
    }
#ifdef PAGEBUS_AMX
    if (amx) _tile_release();
#endif
  };
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), first[B]));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {  // part p: the items whose keys start in its share
      const auto at_share = [&](int64_t q) {
        return static_cast<int64_t>(std::lower_bound(cost.begin(), cost.end() - 1, cost.back() * q / parts) - cost.begin());
      };
      items(at_share(p), at_share(p + 1));
    }
  });
}
#endif  // PAGEBUS_SIMD

// The prefill chunks' attention (sequences with several query tokens) into their rows of out;
// other rows are left untouched. False (nothing done: the caller runs torch's) unless the
// caches hold 16-token blocks of head_dim 64 or 128 in float32 (or bf16 on AVX-512 BF16 builds).
bool prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                       double scale) {
  const auto st = check_paged_args(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, "prefill_attention");
  const CacheDims kd = cache_dims(k_cache);
  const int64_t h = q.size(1), d = q.size(2), bs = kd.bs, kvh = kd.kvh;
#ifdef PAGEBUS_SIMD
  if (bs != 16 || (d != 64 && d != 128)) return false;
#ifdef PAGEBUS_AMX
  // a token-pairs K cache on AMX goes through a gathered row copy (kernels/cpu_native.py): the
  // AMX item reads K rows
  if (kd.pairs && amx_usable()) return false;
#endif
#ifndef __AVX512BF16__
  if (st != torch::kFloat32) return false;
#endif
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t B = lens.size(0), width = bt.size(1);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qp0 = qsl.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qp0[b + 1] - qp0[b];
    if (n > 1) TORCH_CHECK(lp[b] >= n && lp[b] <= width * bs, "prefill_attention: bad length");
  }
  const float sc = static_cast<float>(scale);
#ifdef __AVX512BF16__
  if (kd.pairs) {
    (d == 64 ? prefill_rows<4, bf16, true> : prefill_rows<8, bf16, true>)(
        out.data_ptr<bf16>(), out.stride(0), q.data_ptr<bf16>(), q.stride(0), k_cache.data_ptr<bf16>(),
        v_cache.data_ptr<bf16>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.data_ptr<int32_t>(),
        width, lp, qp0, B, h, kvh, sc, k_cache.stride(0));
    return true;
  }
#endif
  if (kd.pairs) return false;
  if (k_cache.scalar_type() != st) {  // float16 beside float32 (check_caches)
#ifdef PAGEBUS_F16
    (d == 64 ? prefill_rows<4, float, false, f16> : prefill_rows<8, float, false, f16>)(
        out.data_ptr<float>(), out.stride(0), q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<f16>(),
        v_cache.data_ptr<f16>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.data_ptr<int32_t>(), width,
        lp, qp0, B, h, kvh, sc, 0);
    return true;
#else
    return false;
#endif
  }
#define ROWS(T)                                                                                                  \
  (d == 64 ? prefill_rows<4, T> : prefill_rows<8, T>)(                                                           \
      out.data_ptr<T>(), out.stride(0), q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), \
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.data_ptr<int32_t>(), width, lp, qp0, B, h, kvh, sc, 0)
  if (st == torch::kFloat32) {
    ROWS(float);
    return true;
  }
#ifdef __AVX512BF16__
  ROWS(bf16);
  return true;
#endif
#undef ROWS
#endif
  return false;
}

// n values into a cache row: copied, or float32 rounded to float16.
template <typename T>
inline void put_row(const T* src, T* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(T));
}
#ifdef PAGEBUS_F16
inline void put_row(const float* src, f16* dst, int64_t n) { store_f16_row(src, dst, n); }
#endif

// Tokens a thread rotates at least: below this a parallel region's start costs more than it saves.
constexpr int64_t kRotateGrain = 8;

// qkv_decode_attention's first half: every token's q heads rotated into `out`, its K heads rotated
// and its V heads copied into their cache slot (caches of C: T's, or float16 beside float32; K in
// token pairs where `pairs`; a slot's head g at g * s2 from its start). K is rotated straight into
// the slot where it needs no conversion.
template <typename T, typename C>
void rotate_into_caches(const torch::Tensor& qkv, torch::Tensor& out, torch::Tensor& k_cache, torch::Tensor& v_cache,
                        int64_t h, int64_t kvh, const float* csp, const int64_t* pp, const int64_t* sp, int64_t rot,
                        int64_t ld, int64_t s0, int64_t s1, int64_t s2, bool pairs) {
  const int64_t d = out.size(2), bs = v_cache.size(1), half = rot / 2;
  const T* x = qkv.data_ptr<T>();
  T* op = out.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  // tokens over the threads (each writes only its own rows and slots): on one thread this was
  // ~0.8% of a 64-sequence decode step's samples while the other waited. Zen 3, two threads, 30
  // layers' qkv_decode_attention, 40 interleaved rounds: 64 sequences 0.975, 16 0.987 of the time.
  at::parallel_for(0, qkv.size(0), kRotateGrain, [&](int64_t t0, int64_t t1) {
    std::vector<T> krow(static_cast<size_t>(kvh * d));  // rotated K, then into pairs or float16
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = csp + pp[t] * rot;
      const T* xt = x + t * ld;
      for (int64_t j = 0; j < h; ++j) rotate_head(xt + j * d, op + (t * h + j) * d, c, c + half, half, rot, d);
      if (sp[t] < 0) continue;
      const int64_t off = (sp[t] / bs) * s0 + (sp[t] % bs) * s1;
      for (int64_t g = 0; g < kvh; ++g) {
        T* kdst = krow.data() + g * d;
        if constexpr (std::is_same_v<T, C>)
          if (!pairs) kdst = kc + off + g * s2;
        rotate_head(xt + (h + g) * d, kdst, c, c + half, half, rot, d);
      }
      if constexpr (std::is_same_v<T, C>) {
        if (pairs) put_k_pairs(krow.data(), kc + (sp[t] / bs) * k_cache.stride(0), sp[t] % bs, kvh, d, bs);
      } else {
        for (int64_t g = 0; g < kvh; ++g) put_row(krow.data() + g * d, kc + off + g * s2, d);
      }
      for (int64_t g = 0; g < kvh; ++g) put_row(xt + (h + kvh + g) * d, vc + off + g * s2, d);
    }
  });
}

// A decode step's whole attention from the fused QKV projection, in one call: q rotated into
// the output rows, k rotated and v copied straight into their cache slots, then
// decode_attention in place (each sequence reads its own q row before writing that row).
// Every sequence must have one query token. qkv [T, (h + 2 kvh) d] -> [T, h d]. Saves the
// six calls, three views and the argument checks per layer that the separate ops cost from
// Python, and their intermediate tensors (about a tenth of a decode step of the default model).
torch::Tensor qkv_decode_attention(torch::Tensor qkv, int64_t h, int64_t kvh, torch::Tensor positions,
                                   torch::Tensor cos_sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                                   torch::Tensor query_start_loc, double scale) {
  const auto st = check_dtype({&qkv}, "qkv_decode_attention");
  const bool f16_cache = check_caches(k_cache, v_cache, st, "qkv_decode_attention");
  const CacheDims kd = cache_dims(k_cache);
  const int64_t ntok = qkv.size(0), d = kd.d, bs = kd.bs;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (h + 2 * kvh) * d && qkv.stride(1) == 1 && kd.kvh == kvh,
              "qkv_decode_attention: qkv must be [T, (h + 2 kvh) d] with contiguous rows, caches [.., kvh, d]");
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == ntok + 1,
              "qkv_decode_attention: int32 query starts, one query token per sequence expected");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() &&
                  positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "qkv_decode_attention: float32 cos_sin_cache, int64 positions and slot_mapping expected");
  if (kd.pairs)
    check_pairs(k_cache, v_cache, "qkv_decode_attention");
  else
    TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
                "qkv_decode_attention: caches must hold contiguous head vectors, in one layout");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  for (int64_t b = 0; b <= ntok; ++b) TORCH_CHECK(qsl[b] == b, "qkv_decode_attention: a sequence has other than one query token");
  const int64_t rot = cos_sin.size(1), num_slots = k_cache.size(0) * bs;
  TORCH_CHECK(rot <= d, "qkv_decode_attention: rotary dim exceeds head dim");
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < ntok; ++t)
    TORCH_CHECK(sp[t] < num_slots, "qkv_decode_attention: slot ", sp[t], " beyond the cache's ", num_slots);
  const float* csp = cos_sin.data_ptr<float>();
  auto out = torch::empty({ntok, h, d}, qkv.options());
  const int64_t s0 = v_cache.stride(0), s1 = v_cache.stride(1), s2 = v_cache.stride(2), ld = qkv.stride(0);
  if (f16_cache) {  // float32 activations, float16 caches
#ifdef PAGEBUS_F16
    rotate_into_caches<float, f16>(qkv, out, k_cache, v_cache, h, kvh, csp, pp, sp, rot, ld, s0, s1, s2, false);
#endif
  } else {
    DISPATCH(st,
             rotate_into_caches<T, T>(qkv, out, k_cache, v_cache, h, kvh, csp, pp, sp, rot, ld, s0, s1, s2, kd.pairs));
  }
  decode_attention(out, out, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale);
  return out.view({ntok, h * d});
}

// ---------------------------------------------------------------- matmul on column tiles
// W [N, K] is held as column tiles: each tile's kTile output columns over all of K are one
// contiguous run, so a tile streams from memory in order and the next tile can be prefetched
// while the current one is reused from cache by later row blocks of x.
//   float32:  [N / kTile, K, kTile]        one k a step (FMA: a vector's products an instruction)
//   bfloat16: [N / kTile, K / 2, kTile, 2] a pair of k a step, each column's pair adjacent, as
//             vdpbf16ps multiplies them (AVX-512 BF16: 32 products an instruction, fp32 sums)
// A step reads kTileVecs vectors of a tile for kTile columns: on AVX-512 3 (48 columns) for row
// blocks of 8 (24 sums + 3 W + x in the 32 registers), on AVX2 2 (16 columns) for blocks of 6
// (12 + 2 + 1 of 16: the 6 x 16 block of BLIS's and OpenBLAS's Haswell sgemm kernels).
#ifdef __AVX512F__
constexpr int64_t kTileVecs = 3, kRowBlock = 8, kFewRows = 4;
#else
constexpr int64_t kTileVecs = 2, kRowBlock = 6, kFewRows = 2;
#endif
constexpr int64_t kTile = kLanes * kTileVecs;

torch::Tensor pack_tiles(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % kTile == 0, "pack_tiles: [N, K] with N a multiple of ", kTile);
  const int64_t N = w.size(0), K = w.size(1);
  if (w.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(K % 2 == 0, "pack_tiles: bfloat16 tiles need an even K");
    return w.reshape({N / kTile, kTile, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return w.reshape({N / kTile, kTile, K}).transpose(1, 2).contiguous();
}

// Rows `ids` of the [N, K] matrix pack_tiles holds (a tied embedding's lookup) -> [*ids, K]:
// float16 tiles' rows widened to float32, the others' in their dtype. A row's K values lie a
// tile row apart, each in its own cache line; torch's advanced indexing took ~36 us for one row
// from cache, this ~1.
torch::Tensor embed_rows(const torch::Tensor& tiles, const torch::Tensor& ids) {
  const bool b16 = tiles.scalar_type() == torch::kBFloat16, h = tiles.scalar_type() == torch::kHalf;
  TORCH_CHECK(tiles.is_contiguous() && tiles.dim() == (b16 ? 4 : 3) && tiles.size(2) == kTile &&
                  (b16 || h || tiles.scalar_type() == torch::kFloat32) &&
                  (ids.scalar_type() == torch::kInt64 || ids.scalar_type() == torch::kInt32),
              "embed_rows: pack_tiles' tiles and integer ids expected");
  const int64_t NT = tiles.size(0), K = b16 ? 2 * tiles.size(1) : tiles.size(1), N = NT * kTile;
  auto flat = ids.reshape({-1}).to(torch::kInt64).contiguous();
  const int64_t n = flat.size(0);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "embed_rows: id ", id[i], " not in [0, ", N, ")");
  auto out = torch::empty({n, K}, tiles.options().dtype(h ? torch::kFloat32 : tiles.scalar_type()));
  // element (r, k) of the matrix: tile r / kTile, then k (bf16: k's pair, then k's half of it)
  auto gather = [&](auto* src, auto* dst) {
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = id[i], t = r / kTile, c = r % kTile;
        for (int64_t k = 0; k < K; ++k)
          dst[i * K + k] = static_cast<std::remove_pointer_t<decltype(dst)>>(
              b16 ? src[((t * (K / 2) + k / 2) * kTile + c) * 2 + k % 2] : src[(t * K + k) * kTile + c]);
      }
    });
  };
  if (b16)
    gather(tiles.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  else if (h)
    gather(tiles.data_ptr<c10::Half>(), out.data_ptr<float>());
  else
    gather(tiles.data_ptr<float>(), out.data_ptr<float>());
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  return out.view(shape);
}

#ifdef PAGEBUS_SIMD
// One step of the K loop per element type: `kStep` columns of x broadcast, a tile vector
// loaded, multiplied into fp32 sums, and the sums stored as T.
template <typename T>
struct TileStep;

template <>
struct TileStep<float> {
  static constexpr int64_t kStep = 1;
  static vf bcast(const float* x, int64_t s) { return vset1(x[s]); }
  static vf load(const float* w) { return vload(w); }
#ifdef PAGEBUS_F16
  static vf load(const f16* w) { return vload(w); }  // float16 tiles: widened exactly (F16C)
#endif
  static vf madd(vf acc, vf x, vf w) { return vfmadd(x, w, acc); }
  static void store(float* y, vf acc) { vstore(y, acc); }
};

#ifdef __AVX512BF16__
template <>
struct TileStep<bf16> {
  static constexpr int64_t kStep = 2;
  static __m512 bcast(const bf16* x, int64_t s) {
    int32_t pair;
    std::memcpy(&pair, x + 2 * s, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static __m512 load(const bf16* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 madd(__m512 acc, __m512 x, __m512 w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  static void store(bf16* y, __m512 acc) {  // rounded to nearest even, as torch rounds
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(acc));
  }
};
#endif

// y[r, 0:kTile] = x[r, :] . tile for r < MR; `pf` (if set): `pf_lines` cache lines from there
// (a slice of the next tile) to prefetch, spread evenly over the steps.
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
template <typename T, int MR, typename W = T>
static inline void tile_rows(const T* __restrict__ x, int64_t ldx, const W* __restrict__ w, T* __restrict__ y,
                             int64_t ldy, int64_t steps, const void* pf, int64_t pf_lines) {
  using S = TileStep<T>;
  constexpr int64_t E = kTile * S::kStep;  // elements of a tile per step
  vf acc[MR][kTileVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vzero();
  const char* pl = reinterpret_cast<const char*>(pf);
  int64_t owed = 0;  // lines due so far, times `steps` (a running share of pf_lines per step)
  for (int64_t s = 0; s < steps; ++s) {
    for (owed += pf_lines; owed >= steps; owed -= steps, pl += 64) _mm_prefetch(pl, PF_HINT);
    vf wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = S::load(w + s * E + v * (E / kTileVecs));
    for (int r = 0; r < MR; ++r) {
      const vf xb = S::bcast(x + r * ldx, s);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = S::madd(acc[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kTileVecs; ++v) S::store(y + r * ldy + kLanes * v, acc[r][v]);
}

// How far ahead of its loads one_tile asks for its stream's lines (0: it does not; the hardware
// prefetcher alone). The tiles a thread runs follow one another in memory (for_each_run), so near
// a tile's end this fetches the next one's start. Zen 3 (AVX2), float16 weights in 4 KiB pages,
// single-stream decode step against none: 512 B 0.90-0.94x, 1 KiB 0.87-0.90x, 2 KiB 0.95x (the
// hardware prefetcher restarted at every 4 KiB page). AVX-512 builds ask for none: Zen 4, bf16,
// the step's 121 GEMVs in 2 MiB pages (workers/host_memory.py) against 4 KiB ahead 0.95x the time
// where the memory read ~32 GB/s and 0.93x where it read ~55 (0.976 / 0.91 of a plain read of the
// same bytes, from 0.94 / 0.84), float32 0.96x / 0.92x, in 4 KiB pages 0.95x; single-stream engine
// steps, the two paths alternating step by step, 1.02-1.04x as fast, 4 rows 1.03x. (An AVX2 build
// on that Zen 4, float16 tiles: 0.87x the time without; not measured on Zen 3 since the huge pages.)
#ifdef __AVX512F__
constexpr int64_t kStreamAhead = 0;
#else
constexpr int64_t kStreamAhead = 1024;
#endif

// Up to kFewRows rows of x against one tile, for the GEMV-like calls (decode of one or a few
// sequences) that wait on DRAM, not on FMAs. A thread's tiles follow one another in memory
// (for_each_run), so its whole share is one stream (on AVX2 each line asked for kStreamAhead ahead).
// Pairs of tiles half a matrix apart (two streams a thread, as before) read slower: a plain read
// of the default model's 121 weight regions, Zen 4, two threads, 0.91-0.92 of the time with one
// stream a thread. Its 121 matmuls in step order (bench/matmul_ab.py, 24 rounds), the pairs'
// time over this: bf16 1 row 1.07, 2 rows 1.04, 4 rows 1.12 (control 1.01 / 1.01 / 0.99);
// float32 1 and 2 rows 1.09; an AVX2 build with float16 tiles (on the same Zen 4) 1.05 / 1.10.
// The same sums in the same order: bitwise the same y.
template <typename T, int MR, typename W = T>
static inline void one_tile(const T* __restrict__ x, int64_t ldx, const W* __restrict__ w, T* __restrict__ y,
                            int64_t ldy, int64_t steps) {
  using S = TileStep<T>;
  constexpr int64_t E = kTile * S::kStep, SB = E * static_cast<int64_t>(sizeof(W));  // SB: bytes a step
  vf acc[MR][kTileVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vzero();
  for (int64_t s = 0; s < steps; ++s) {
    // the lines this step's bytes reach, kStreamAhead on (one every 64 / SB steps when SB < 64)
    if constexpr (kStreamAhead > 0)
      for (int64_t b = (s * SB + 63) / 64 * 64; b < (s + 1) * SB; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w) + kStreamAhead + b, _MM_HINT_T0);
    vf wv[kTileVecs];
    for (int v = 0; v < kTileVecs; ++v) wv[v] = S::load(w + s * E + v * (E / kTileVecs));
    for (int r = 0; r < MR; ++r) {
      const vf xb = S::bcast(x + r * ldx, s);
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = S::madd(acc[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kTileVecs; ++v) S::store(y + r * ldy + kLanes * v, acc[r][v]);
}

template <typename T, typename W>
static void few_rows(int64_t m, const T* x, int64_t ldx, const W* w, T* y, int64_t ldy, int64_t steps) {
  switch (m) {
#define ROWS(R)                                                                    \
  case R:                                                                          \
    if constexpr (R <= kFewRows) one_tile<T, R, W>(x, ldx, w, y, ldy, steps); \
    break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
  }
}

template <typename T, typename W>
static void row_block(int64_t m, const T* x, int64_t ldx, const W* w, T* y, int64_t ldy, int64_t steps, const void* pf,
                      int64_t pf_lines) {
  switch (m) {
#define ROWS(R)                                                                       \
  case R:                                                                             \
    if constexpr (R <= kRowBlock) tile_rows<T, R, W>(x, ldx, w, y, ldy, steps, pf, pf_lines); \
    break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
}

// The tile matmul's spans are at most a 1 / (kClaimsPerThread * threads) share of a row chunk's
// tiles: enough claims to even out a slow thread, few enough that a span's tiles stream in order.
constexpr int64_t kClaimsPerThread = 8;

// Rows in chunks whose x fits in L2 beside a tile (~384 KiB of it): each thread runs its tiles
// over one chunk, then the next, so x is read from L2 for every tile and only the tiles come
// again from further out, once per chunk (at 2048 rows x read afresh for every tile was L3
// traffic the arithmetic waited on).
template <typename T>
static int64_t row_chunk(int64_t K) {
  return std::max<int64_t>(64, (393216 / (K * static_cast<int64_t>(sizeof(T)))) / kRowBlock * kRowBlock);
}

// One tile over `rows` rows of x into y (row stride ldy), in row blocks, the tile `next` (if set)
// prefetched a slice per block. The rows spread evenly over the blocks (32 on AVX2: 6 6 5 5 5 5,
// not 6 6 6 6 6 2): a block of few rows has too few accumulators to cover the FMA latency, and
// ran a row at about half the rate of a full one. Each row's sums are the same whichever block
// holds it.
template <typename T, typename W>
static void tile_over_rows(const T* x, int64_t ldx, int64_t rows, const W* wt, const W* next, T* y, int64_t ldy,
                           int64_t steps) {
  constexpr int64_t E = kTile * TileStep<T>::kStep, step_bytes = E * static_cast<int64_t>(sizeof(W));
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock, slice = (steps + blocks - 1) / blocks;
  const int64_t base = rows / blocks, extra = rows % blocks;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t s0 = b * slice, pf = next != nullptr ? std::max<int64_t>(0, std::min(slice, steps - s0)) : 0;
    const int64_t m = base + (b < extra);
    row_block<T, W>(m, x + r * ldx, ldx, wt, y + r * ldy, ldy, steps, next != nullptr ? next + s0 * E : nullptr,
                    (pf * step_bytes + 63) / 64);
    r += m;
  }
}

// x [M, K] times the tiles -> y [M, N]. Up to kFewRows rows: one tile at a time, each thread a run
// of consecutive tiles (for_each_run), one stream.
// More: row blocks of kRowBlock go through the multiply-adds against a tile held in cache; while a tile's blocks run, the next tile is prefetched a slice
// per block, so reading W overlaps the arithmetic on the one before. W: the tiles' element type:
// T, or float16 beside float32 x, widened as each vector loads (F16C's conversion runs beside the
// FMAs; widening each tile once into a float32 buffer instead was 4-13% slower at 4-64 rows).
// tiles_into: `out` says where a tile's block of y goes: `at(r0, t, ld)` the block of rows r0.. and tile t
// (row stride ld), and `done(r0, rows, t)` once it holds them (TilesInY: y itself; the fused
// argmax: a thread's scratch, reduced while it is in L1).
template <typename T, typename W, typename Out>
static void tiles_into(const T* xp, int64_t ldx, const W* w, Out& out, int64_t M, int64_t K, int64_t NT) {
  const int64_t steps = K / TileStep<T>::kStep, tile_elems = K * kTile;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (M <= kFewRows) {
    for_each_run(NT, [&](int64_t t) {
      int64_t ld;
      T* y = out.at(0, t, ld);
      few_rows<T, W>(M, xp, ldx, w + t * tile_elems, y, ld, steps);
      out.done(0, M, t);
    });
    return;
  }
  // spans of the tiles of one row chunk, chunk by chunk: both threads work in the same chunk at a time
  const int64_t chunk = row_chunk<T>(K), chunks = (M + chunk - 1) / chunk;
  const int64_t cap = std::max<int64_t>(1, NT / (kClaimsPerThread * threads));
  for_each_span(chunks * NT, NT, cap, [&](int64_t lo, int64_t hi, int64_t after) {
    const int64_t r0 = lo / NT * chunk, t0 = lo % NT, t1 = t0 + (hi - lo);
    const int64_t rows = std::min(chunk, M - r0);
    for (int64_t t = t0; t < t1; ++t) {
      const W* wt = w + t * tile_elems;
      // the tile after this one: the next of this span, or the first of this thread's next span
      const W* nt = t + 1 < t1 ? wt + tile_elems : after < chunks * NT ? w + (after % NT) * tile_elems : nullptr;
      int64_t ld;
      T* y = out.at(r0, t, ld);
      tile_over_rows<T, W>(xp + r0 * ldx, ldx, rows, wt, nt, y, ld, steps);
      out.done(r0, rows, t);
    }
  });
}

template <typename T>
struct TilesInY {
  T* y;
  int64_t N;
  T* at(int64_t r0, int64_t t, int64_t& ld) const {
    ld = N;
    return y + r0 * N + t * kTile;
  }
  void done(int64_t, int64_t, int64_t) const {}
};

template <typename T, typename W = T>
static void tiles_kernel(const T* xp, int64_t ldx, const W* w, T* yp, int64_t M, int64_t K, int64_t NT) {
  TilesInY<T> out{yp, NT * kTile};
  tiles_into<T, W>(xp, ldx, w, out, M, K, NT);
}

// silu(x . gate) * (x . up) from a gate_up weight's tiles (gate's NT / 2 tiles, then up's), into
// a [M, NT / 2 * kTile] out of row stride ldo: each gate tile and its up tile run over a row chunk
// into two small buffers, then their SiLU product is written, so the [M, 2d] gate_up output is
// never stored and no second pass reads it back. The same row blocks, tile pairs and vector SiLU
// as tiles_kernel followed by silu_and_mul_rows: bitwise the same result.
template <typename W>
static void gate_up_silu_kernel(const float* xp, int64_t ldx, const W* w, float* op, int64_t ldo, int64_t M, int64_t K,
                                int64_t NT) {
  const int64_t half = NT / 2, steps = K / TileStep<float>::kStep, tile_elems = K * kTile;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto product = [&](const float* g, const float* u, int64_t rows, float* o) {  // g, u: [rows, kTile]
    for (int64_t r = 0; r < rows; ++r) silu_and_mul_vectors(g + r * kTile, u + r * kTile, o + r * ldo, kTile);
  };
  if (M <= kFewRows) {  // tiles_kernel's one stream a thread into [M, 2d], then the products (~1 us)
    thread_local std::vector<float> gu;
    gu.resize(static_cast<size_t>(M * NT * kTile));
    tiles_kernel<float, W>(xp, ldx, w, gu.data(), M, K, NT);
    for (int64_t r = 0; r < M; ++r)
      silu_and_mul_vectors(gu.data() + r * NT * kTile, gu.data() + r * NT * kTile + half * kTile, op + r * ldo,
                           half * kTile);
    return;
  }
  // tiles_kernel's row chunks, spans, row blocks and prefetching, a span's items being pairs of one chunk
  const int64_t chunk = row_chunk<float>(K), chunks = (M + chunk - 1) / chunk;
  const int64_t cap = std::max<int64_t>(1, half / (kClaimsPerThread * threads));
  for_each_span(chunks * half, half, cap, [&](int64_t lo, int64_t hi, int64_t after) {
    thread_local std::vector<float> gbuf, ubuf;
    gbuf.resize(static_cast<size_t>(chunk * kTile));
    ubuf.resize(static_cast<size_t>(chunk * kTile));
    const int64_t r0 = lo / half * chunk, t0 = lo % half, t1 = t0 + (hi - lo);
    const int64_t rows = std::min(chunk, M - r0);
    for (int64_t t = t0; t < t1; ++t) {
      const W* wg = w + t * tile_elems;
      const W* wu = w + (t + half) * tile_elems;
      // after the up tile: the next pair's gate tile, of this span or of this thread's next one
      const W* next = t + 1 < t1 ? wg + tile_elems : after < chunks * half ? w + (after % half) * tile_elems : nullptr;
      tile_over_rows<float, W>(xp + r0 * ldx, ldx, rows, wg, wu, gbuf.data(), kTile, steps);
      tile_over_rows<float, W>(xp + r0 * ldx, ldx, rows, wu, next, ubuf.data(), kTile, steps);
      product(gbuf.data(), ubuf.data(), rows, op + r0 * ldo + t * kTile);
    }
  });
}
#endif  // PAGEBUS_SIMD

#ifdef PAGEBUS_AMX
// ---------------------------------------------------------------- bfloat16 tiles on AMX
// AMX multiplies a 16 x 32 tile of x by a 32 x 16 tile of W (16 pairs of k, each column's pair
// adjacent) into 16 x 16 fp32 sums in one instruction: 16x the products of a vdpbf16ps. The
// bfloat16 column tiles above are already that B layout: a 16-column group of a tile, over 16
// pairs of k, is 16 rows of 64 bytes at a 192-byte stride, so AMX reads the same packed weights
// and x as it is. Output columns go in groups of 16 (a tile holds 3), two groups at a time
// against two 16-row groups of x: 4 accumulators, 2 x and 2 W registers of the 8 (the blocking
// oneDNN's AMX kernels use).

constexpr int64_t kAmxGroup = 16, kAmxK = 32;  // output columns / rows of x per tile; k per step
// One row of x stays on AVX-512's tile stream (a GEMV waits on memory either way: 0.016 vs 0.022
// ms for 960 x 576); from two rows AMX is as fast or faster (4: 0.023 vs 0.028 ms; 32: 0.021 vs
// 0.22 ms; the 49152-row LM head at 32: 1.4 vs 13 ms).
constexpr int64_t kAmxMinRows = 2;

// sums[0:16 * G, 0:16 * C] (row stride 32 floats) = x[0:16 * G, :] . W's groups b0 (and b1 when
// C == 2), each `ksteps` steps of 32 k; x rows at `ldx`, a group's step at kStepElems.
// `pf` (if set): the next pair's groups, whose step s is prefetched beside this one's (a stream
// from memory ahead of the loads, as tile_rows does for its next tile).
template <int G, int C>
static inline void amx_block(const bf16* x, int64_t ldx, const bf16* b0, const bf16* b1, int64_t ksteps, float* sums,
                             const bf16* const* pf) {
  constexpr int64_t kStepElems = kAmxK / 2 * kTile * 2, kWStride = kTile * 2 * sizeof(bf16);
  const int64_t xs = ldx * static_cast<int64_t>(sizeof(bf16));
  _tile_zero(0);
  if (C == 2) _tile_zero(1);
  if (G == 2) _tile_zero(2);
  if (G == 2 && C == 2) _tile_zero(3);
  for (int64_t s = 0; s < ksteps; ++s) {
    if (pf != nullptr)
      for (int q = 0; q < 2; ++q)
        if (pf[q] != nullptr)
          for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf[q] + s * kStepElems + r * 2 * kTile), _MM_HINT_T1);
    _tile_loadd(4, x + s * kAmxK, xs);
    _tile_loadd(6, b0 + s * kStepElems, kWStride);
    _tile_dpbf16ps(0, 4, 6);
    if (G == 2) {
      _tile_loadd(5, x + 16 * ldx + s * kAmxK, xs);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (C == 2) {
      _tile_loadd(7, b1 + s * kStepElems, kWStride);
      _tile_dpbf16ps(1, 4, 7);
      if (G == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ss = 32 * sizeof(float);
  _tile_stored(0, sums, ss);
  if (C == 2) _tile_stored(1, sums + 16, ss);
  if (G == 2) _tile_stored(2, sums + 16 * 32, ss);
  if (G == 2 && C == 2) _tile_stored(3, sums + 16 * 32 + 16, ss);
}

// x [M, K] (M a multiple of 16, K of 32) times bfloat16 column tiles -> y [rows, N] (row stride
// ldy), the first `rows` of M. Threads take pairs of column groups; rows go in L2-sized chunks,
// as in tiles_kernel, so a pair's weights (K x 32 columns) are read from memory once a chunk and
// from cache for each of its 32-row blocks.
static void amx_tiles_kernel(const bf16* xp, int64_t ldx, const bf16* w, bf16* yp, int64_t ldy, int64_t M,
                             int64_t rows, int64_t K, int64_t NT) {
  const int64_t groups = NT * (kTile / kAmxGroup), pairs = (groups + 1) / 2, ksteps = K / kAmxK;
  const int64_t tile_elems = K * kTile;
  const int64_t chunk = std::max<int64_t>(32, (393216 / (K * static_cast<int64_t>(sizeof(bf16)))) / 32 * 32);
  auto group = [&](int64_t g) { return w + (g / 3) * tile_elems + (g % 3) * kAmxGroup * 2; };
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    amx_configure();
    alignas(64) float sums[32 * 32];
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
      const int64_t r1 = std::min(M, r0 + chunk);
      for (int64_t p = p0; p < p1; ++p) {
        const bool two = 2 * p + 1 < groups;
        const bf16 *b0 = group(2 * p), *b1 = two ? group(2 * p + 1) : nullptr;
        // the next pair of this thread's, fetched during this pair's first row block
        const bf16* next[2] = {p + 1 < p1 ? group(2 * p + 2) : nullptr, p + 1 < p1 && 2 * p + 3 < groups ? group(2 * p + 3) : nullptr};
        for (int64_t r = r0; r < r1; r += 32) {
          const bool g2 = r + 16 < r1;
          const bf16* x = xp + r * ldx;
          const bf16* const* pf = r == r0 ? next : nullptr;
          if (g2 && two) amx_block<2, 2>(x, ldx, b0, b1, ksteps, sums, pf);
          else if (g2) amx_block<2, 1>(x, ldx, b0, b1, ksteps, sums, pf);
          else if (two) amx_block<1, 2>(x, ldx, b0, b1, ksteps, sums, pf);
          else amx_block<1, 1>(x, ldx, b0, b1, ksteps, sums, pf);
          const int64_t n = std::min<int64_t>(g2 ? 32 : 16, rows - r);
          for (int64_t i = 0; i < n; ++i) {
            bf16* yr = yp + (r + i) * ldy + 2 * p * kAmxGroup;
            TileStep<bf16>::store(yr, _mm512_load_ps(sums + i * 32));
            if (two) TileStep<bf16>::store(yr + 16, _mm512_load_ps(sums + i * 32 + 16));
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// Whether bfloat16 tiles multiply on AMX here: an AMX build, and Linux granted the tile state.
bool bf16_amx_in_use() {
#ifdef PAGEBUS_AMX
  return amx_usable();
#else
  return false;
#endif
}

// Whether float32 weights go in column tiles here (an AVX-512 or AVX2 + FMA build).
bool tiles_built() {
#ifdef PAGEBUS_SIMD
  return true;
#else
  return false;
#endif
}

bool bf16_tiles_built() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// What x [M, K] and `pack_tiles` tiles multiply as, checked: h: float16 tiles
// (--quantization fp16) beside float32 x; else tiles of x's dtype (b16: bfloat16).
struct TilesCall {
  torch::ScalarType st;
  bool h, b16;
  int64_t M, K, NT;
};

TilesCall check_tiles(const torch::Tensor& x, const torch::Tensor& tiles, const char* what) {
  const bool h = tiles.scalar_type() == torch::kHalf;
  const auto st = h ? check_dtype({&x}, what) : check_dtype({&x, &tiles}, what);
  TORCH_CHECK(!h || (st == torch::kFloat32 && tiles.device().is_cpu() && f16_built()), what,
              ": float16 tiles need float32 x and a build with F16C or AVX-512");
  const bool b16 = st == torch::kBFloat16;
  TORCH_CHECK(!b16 || bf16_tiles_built(), what, ": bfloat16 tiles need an AVX-512 BF16 build");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && tiles.is_contiguous() && tiles.dim() == (b16 ? 4 : 3) &&
                  tiles.size(2) == kTile && tiles.size(1) * (b16 ? 2 : 1) == x.size(1) &&
                  (!b16 || tiles.size(3) == 2),
              what, ": x [M, K] with contiguous rows and tiles [N / ", kTile, ", K, ", kTile, "] (bfloat16: [N / ",
              kTile, ", K / 2, ", kTile, ", 2]) expected");
  return {st, h, b16, x.size(0), x.size(1), tiles.size(0)};
}

// Whether bfloat16 tiles multiply on AMX (amx_tiles_kernel) rather than the tile kernel.
bool amx_takes(const TilesCall& c) {
#ifdef PAGEBUS_AMX
  return c.b16 && c.M >= kAmxMinRows && c.K % kAmxK == 0 && amx_usable();
#else
  return false;
#endif
}

// x [M, K] (rows contiguous) times `pack_tiles` tiles -> [M, N], in the tiles' dtype.
torch::Tensor linear_tiles(torch::Tensor x, torch::Tensor tiles) {
  const TilesCall c = check_tiles(x, tiles, "linear_tiles");
  const bool h = c.h, b16 = c.b16;
  const int64_t M = c.M, K = c.K, NT = c.NT;
  auto y = torch::empty({M, NT * kTile}, x.options());
#ifdef PAGEBUS_SIMD
#ifdef __AVX512BF16__
#ifdef PAGEBUS_AMX
  if (amx_takes(c)) {
    // AMX reads x 16 rows at a time: a partial last group comes from a zero-padded copy
    const int64_t Mp = (M + kAmxGroup - 1) / kAmxGroup * kAmxGroup;
    torch::Tensor xa = x;
    if (Mp != M) {
      xa = torch::empty({Mp, K}, x.options());
      xa.narrow(0, 0, M).copy_(x);
      xa.narrow(0, M, Mp - M).zero_();
    }
    amx_tiles_kernel(xa.data_ptr<bf16>(), xa.stride(0), tiles.data_ptr<bf16>(), y.data_ptr<bf16>(), NT * kTile, Mp, M,
                     K, NT);
    return y;
  }
#endif
  if (b16) {
    tiles_kernel<bf16>(x.data_ptr<bf16>(), x.stride(0), tiles.data_ptr<bf16>(), y.data_ptr<bf16>(), M, K, NT);
    return y;
  }
#endif
#ifdef PAGEBUS_F16
  if (h) {
    tiles_kernel<float, f16>(x.data_ptr<float>(), x.stride(0), tiles.data_ptr<f16>(), y.data_ptr<float>(), M, K, NT);
    return y;
  }
#endif
  tiles_kernel<float>(x.data_ptr<float>(), x.stride(0), tiles.data_ptr<float>(), y.data_ptr<float>(), M, K, NT);
#else
  // Without AVX2 (the Python side does not pack there; kept so the module always builds).
  y.copy_(at::bmm(x.unsqueeze(0).expand({NT, M, K}), tiles).transpose(0, 1).reshape({M, NT * kTile}));
#endif
  return y;
}

// ---------------------------------------------------------------- the decode stack
// Every held layer of a Llama-family decoder for a step in which each sequence decodes one
// token, in one call from Python: the same compiled ops the layers call one by one (norms,
// fused QKV attention, SiLU-and-mul) and the layers' own matmuls, without the ~11 Python calls,
// argument conversions and checks a layer costs between them (about 40% of a single-stream
// step of the default model on one thread, more on two, where the matmuls shrink and they don't).
//
// A matmul is y = x @ W^T as its owner compiled it: this file's column tiles, or the
// quantized-weight kernels of workers/layers/quant/cpu_kernels.py, another extension built
// against the same torch headers, whose functions of this signature are passed by address.
using MatmulFn = torch::Tensor (*)(const torch::Tensor&, const std::vector<torch::Tensor>&);

// float32 rows above which MKL's batched GEMM over the tiles beats the tile kernel: 160 on Intel
// CPUs (512 rows: 1015 vs 1064 ms for 30 layers); none elsewhere, where MKL takes its generic
// path (AMD EPYC, AVX-512: the tile kernel 2.5-5x MKL at 161-2048 rows of this model's shapes).
// kernels/cpu_native.py asks for it too, so both callers split at the same row count.
// The index of x's first maximum, as torch.argmax gives it (a NaN counts as the maximum: its
// first one); exact and scalar, for rows holding a NaN.
inline int64_t first_max_scalar(const float* x, int64_t n) {
  int64_t at = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (x[j] != x[j]) return j;
    if (x[j] > x[at]) at = j;
  }
  return at;
}

// first_max_scalar in one vector pass: the max of each run of 4 vectors against the best so
// far (strictly greater: the first run holding the maximum wins), then the run scanned for it.
// ~5 us for a 49,152-wide float32 row where torch's argmax takes ~60-120 us (its row-wise
// reduction does not vectorise over one wide row): a greedy decode step's sampling.
inline int64_t first_max(const float* x, int64_t n) {
  int64_t i = 0, run = 0;
  float best = -std::numeric_limits<float>::infinity();
#ifdef PAGEBUS_SIMD
  constexpr int64_t C = 4 * kLanes;
#ifdef __AVX512F__
  __mmask16 nan = 0;
  auto unordered = [](vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); };
#else
  __m256 nan = _mm256_setzero_ps();
  auto unordered = [](vf v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); };
#endif
  for (; i + C <= n; i += C) {
    const vf a = vload(x + i), b = vload(x + i + kLanes), c = vload(x + i + 2 * kLanes), d = vload(x + i + 3 * kLanes);
#ifdef __AVX512F__
    nan |= unordered(a) | unordered(b) | unordered(c) | unordered(d);
#else
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_or_ps(unordered(a), unordered(b)), _mm256_or_ps(unordered(c), unordered(d))));
#endif
    const float m = max_lanes(vmax(vmax(a, b), vmax(c, d)));
    if (m > best) best = m, run = i;
  }
#ifdef __AVX512F__
  if (nan) return first_max_scalar(x, n);
#else
  if (_mm256_movemask_ps(nan)) return first_max_scalar(x, n);
#endif
#endif
  int64_t at = 0;
  if (i > 0) {  // the first of the winning run's elements equal to its maximum
    at = run;
    while (x[at] != best) ++at;
  }
  for (int64_t j = i; j < n; ++j) {
    if (x[j] != x[j]) return j;
    if (x[j] > best || (j == 0)) best = x[j], at = j;
  }
  return at;
}

// Each row's first_max: torch.argmax(-1) of float32 logits [rows, vocab] with contiguous rows.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "argmax_rows: float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ls = logits.stride(0);
  TORCH_CHECK(n > 0, "argmax_rows: an empty row has no maximum");
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = first_max(lp + r * ls, n);
  });
  return out;
}

// The exponential race's candidates (workers/sampling.py): for each row of x [R, V] (logits over
// temperature), the ids that can still win argmax(x - log E) over the kept ids (x >= cutoff),
// where log E is a decreasing function of a 32-bit hash h of (row key, id). `log_e` [4097] holds
// log E at each 2^20-wide bucket's lower edge of h (the last: at h = 2^32 - 1), so an id in
// bucket b scores within [x - log_e[b], x - log_e[b + 1]]. The winner scores at least L, the
// largest lower bound; ids whose upper bound is below L cannot win. The bounds are widened by a
// margin far above float32 rounding of the score and any ulp-level wobble of the log, so the
// exact race over the candidates (in torch, with the same noise) picks the same id as over the
// whole row. Returns (ids [R, max_candidates] int64 ascending, counts [R]); a row whose count is
// -1 takes the whole-row race: it holds a NaN, or more candidates than fit.
namespace race {
inline uint32_t noise_hash(uint32_t id, uint32_t mul, uint32_t add) {  // sampling.hash32 + 2^31
  uint32_t z = id * mul + add;
  z ^= z >> 16;
  z *= 0x7FEB352DU;
  z ^= z >> 15;
  z *= 0x846CA68BU;
  z ^= z >> 16;
  return z ^ 0x80000000U;
}
inline float margin(float x) { return 1e-4f + std::fabs(x) * 1e-6f; }

// The bounds of ids i0..i0+lanes as vectors: where each id is kept (x >= cut, never a NaN), and
// its score's lower (at = 0) or upper (at = 1) bound, from its hash's bucket b: log_e[b + at].
#ifdef __AVX512F__
constexpr int64_t kRaceLanes = 16;
struct RaceVec {
  __m512i mul, add, iota;
  __m512 cut;
  RaceVec(uint32_t m, uint32_t a, float c)
      : mul(_mm512_set1_epi32(static_cast<int>(m))), add(_mm512_set1_epi32(static_cast<int>(a))),
        iota(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), cut(_mm512_set1_ps(c)) {}
  // bound (lower: at 0, upper: at 1) and the kept mask of 16 ids from i0; `nan` gathers NaN lanes
  __m512 bound(const float* row, int64_t i0, const float* T, int at, __mmask16& kept, __mmask16& nan) const {
    const __m512 x = _mm512_loadu_ps(row + i0);
    __m512i z = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i0)), iota), mul), add);
    z = _mm512_xor_si512(z, _mm512_srli_epi32(z, 16));
    z = _mm512_mullo_epi32(z, _mm512_set1_epi32(0x7FEB352D));
    z = _mm512_xor_si512(z, _mm512_srli_epi32(z, 15));
    z = _mm512_mullo_epi32(z, _mm512_set1_epi32(static_cast<int>(0x846CA68BU)));
    z = _mm512_xor_si512(z, _mm512_srli_epi32(z, 16));
    const __m512i b = _mm512_add_epi32(_mm512_srli_epi32(_mm512_xor_si512(z, _mm512_set1_epi32(INT32_MIN)), 20), _mm512_set1_epi32(at));
    const __m512 t = _mm512_i32gather_ps(b, T, 4);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    kept = _mm512_cmp_ps_mask(x, cut, _CMP_GE_OQ);
    const __m512 m = _mm512_fmadd_ps(_mm512_abs_ps(x), _mm512_set1_ps(1e-6f), _mm512_set1_ps(1e-4f));
    return at == 0 ? _mm512_sub_ps(_mm512_sub_ps(x, t), m) : _mm512_add_ps(_mm512_sub_ps(x, t), m);
  }
};
#endif

// L: the largest lower bound of a kept id's score; `nan` set where the row holds a NaN.
float lower_bound(const float* row, int64_t V, uint32_t mul, uint32_t add, float cut, const float* T, bool& nan) {
  float L = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  nan = false;
#ifdef __AVX512F__
  const RaceVec v(mul, add, cut);
  __m512 best = _mm512_set1_ps(L);
  __mmask16 nans = 0;
  for (; i + kRaceLanes <= V; i += kRaceLanes) {
    __mmask16 kept;
    const __m512 lo = v.bound(row, i, T, 0, kept, nans);
    best = _mm512_mask_max_ps(best, kept, best, lo);
  }
  L = _mm512_reduce_max_ps(best);
  nan = nans != 0;
#endif
  for (; i < V; ++i) {
    const float xi = row[i];
    nan |= xi != xi;
    if (xi >= cut) L = std::max(L, xi - T[noise_hash(static_cast<uint32_t>(i), mul, add) >> 20] - margin(xi));
  }
  return L;
}

// The kept ids whose upper bound reaches L into out (ascending); -1 past `cap` of them.
int64_t collect(const float* row, int64_t V, uint32_t mul, uint32_t add, float cut, const float* T, float L,
                int64_t* out, int64_t cap) {
  int64_t n = 0, i = 0;
#ifdef __AVX512F__
  const RaceVec v(mul, add, cut);
  const __m512 lv = _mm512_set1_ps(L);
  __mmask16 nans = 0;
  for (; i + kRaceLanes <= V; i += kRaceLanes) {
    __mmask16 kept;
    const __m512 hi = v.bound(row, i, T, 1, kept, nans);
    for (uint32_t in = kept & _mm512_cmp_ps_mask(hi, lv, _CMP_GE_OQ); in; in &= in - 1) {
      if (n == cap) return -1;
      out[n++] = i + __builtin_ctz(in);
    }
  }
#endif
  for (; i < V; ++i) {
    const float xi = row[i];
    // written so a NaN bound (x = -inf: -inf + inf) fails, as the vector compare does
    if (!(xi >= cut && xi - T[(noise_hash(static_cast<uint32_t>(i), mul, add) >> 20) + 1] + margin(xi) >= L)) continue;
    if (n == cap) return -1;
    out[n++] = i;
  }
  return n;
}
}  // namespace race

std::vector<torch::Tensor> race_candidates(torch::Tensor x, torch::Tensor key_mul, torch::Tensor key_add,
                                           torch::Tensor cutoff, torch::Tensor log_e, int64_t max_candidates) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "race_candidates: float32 [rows, vocab] with contiguous rows");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V < (int64_t(1) << 31), "race_candidates: vocab ", V, " does not fit the int32 ids");
  auto km = key_mul.reshape({-1}).contiguous(), ka = key_add.reshape({-1}).contiguous();
  auto cut = cutoff.reshape({-1}).contiguous(), le = log_e.contiguous();
  TORCH_CHECK(km.scalar_type() == torch::kInt32 && ka.scalar_type() == torch::kInt32 && km.numel() == R &&
                  ka.numel() == R && cut.scalar_type() == torch::kFloat32 && cut.numel() == R &&
                  le.scalar_type() == torch::kFloat32 && le.numel() == 4097 && max_candidates > 0,
              "race_candidates: int32 keys, float32 cutoffs per row, float32 log_e [4097]");
  auto ids = torch::zeros({R, max_candidates}, x.options().dtype(torch::kInt64));
  auto counts = torch::empty({R}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  const int32_t *mp = km.data_ptr<int32_t>(), *ap = ka.data_ptr<int32_t>();
  const float *cp = cut.data_ptr<float>(), *T = le.data_ptr<float>();
  int64_t *ip = ids.data_ptr<int64_t>(), *np = counts.data_ptr<int64_t>();
  const int64_t ls = x.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * ls;
      const uint32_t mul = static_cast<uint32_t>(mp[r]), add = static_cast<uint32_t>(ap[r]);
      bool nan = false;
      const float L = race::lower_bound(row, V, mul, add, cp[r], T, nan);
      np[r] = nan ? -1 : race::collect(row, V, mul, add, cp[r], T, L, ip + r * max_candidates, max_candidates);
    }
  });
  return {ids, counts};
}

// The sorted top values a top_k / top_p cutoff reads (workers/sampling.py _truncation_cutoff),
// without sorting the row: per row of x [T, V], its largest c values, descending, where c = top_k
// when top_k < V (the renormalising mass is the top k's), else one more than the values that a
// histogram of the row says hold top_p of its mass, plus a margin of 1e-4 of it (far above the
// float32 sums' error), so the exact cumulative sum over them crosses top_p before the last.
// Histogram: buckets 1/64 of a logit wide below the row's max, masses by fast_exp summed in
// double, read from the top; values over 24 below the max are left out (together at most
// vocab x e^-24 of the max's own mass: 1e-5 at 256k ids), and four histograms take alternate
// values, so repeated buckets do not wait on one another. Only the buckets read are sorted.
// Returns [T, max c] padded with -inf (masses 0), or an empty tensor where a row holds a NaN or
// an infinite max (the torch path takes those).
namespace nucleus {
constexpr int32_t kBuckets = 24 * 64, kCopies = 4;
constexpr float kPerUnit = 64.f, kSpan = 24.f;
constexpr double kMargin = 1e-4;

// One row's values in descending order down to the bucket where `k` values (k < V) or top_p of
// the mass (k >= V) are reached, plus, by mass, the next value; false for a NaN or infinite max.
struct Row {
  std::vector<int32_t> b;
  std::vector<float> e;
  std::vector<int64_t> count = std::vector<int64_t>(kBuckets * kCopies);
  std::vector<double> mass = std::vector<double>(kBuckets * kCopies);

  bool top(const float* row, int64_t V, int64_t k, float top_p, std::vector<float>& out) {
    b.resize(static_cast<size_t>(V));
    e.resize(static_cast<size_t>(V));
    float m = -std::numeric_limits<float>::infinity();
    bool nan = false;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 best = _mm512_set1_ps(m);
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_max_ps(best, v);
    }
    m = _mm512_reduce_max_ps(best);
    nan = unordered != 0;
#endif
    for (; i < V; ++i) {
      nan |= row[i] != row[i];
      m = std::max(m, row[i]);
    }
    if (nan || !std::isfinite(m)) return false;
#pragma omp simd
    for (i = 0; i < V; ++i) {
      const float d = std::min(m - row[i], kSpan);  // in [0, kSpan]; -inf's too
      b[i] = d < kSpan ? static_cast<int32_t>(d * kPerUnit) : kBuckets;
      e[i] = fast_exp(-d);  // read only where b < kBuckets
    }
    std::fill(count.begin(), count.end(), 0);
    std::fill(mass.begin(), mass.end(), 0.0);
    for (i = 0; i + kCopies <= V; i += kCopies)
      for (int32_t c = 0; c < kCopies; ++c) {
        const int32_t at = b[i + c];
        if (at < kBuckets) {
          ++count[c * kBuckets + at];
          mass[c * kBuckets + at] += e[i + c];
        }
      }
    for (; i < V; ++i)
      if (b[i] < kBuckets) ++count[b[i]], mass[b[i]] += e[i];
    const bool by_mass = k >= V;
    double total = 0.0;
    for (double v : mass) total += v;
    const double target = static_cast<double>(top_p) * total * (1.0 + kMargin);
    int32_t last = kBuckets;  // not reached within the span: every value
    int64_t taken = 0;
    double acc = 0.0;
    for (int32_t j = 0; j < kBuckets && last == kBuckets; ++j) {
      for (int32_t c = 0; c < kCopies; ++c) {
        taken += count[c * kBuckets + j];
        acc += mass[c * kBuckets + j];
      }
      if (by_mass ? acc >= target : taken >= k) last = j;
    }
    if (last == kBuckets) taken = V;
    out.resize(static_cast<size_t>(taken + 16));  // slack: the stores below write past the count
    float rest = -std::numeric_limits<float>::infinity();  // the largest value not taken
    int64_t j = 0, n = 0;
#ifdef __AVX512F__
    for (const __m512i lv = _mm512_set1_epi32(last); j + 16 <= V; j += 16) {
      const __mmask16 in = _mm512_cmple_epi32_mask(_mm512_loadu_si512(b.data() + j), lv);
      // compress in a register, store all 16 (the slack below): Zen 4's compress-to-memory is slow
      _mm512_storeu_ps(out.data() + n, _mm512_maskz_compress_ps(in, _mm512_loadu_ps(row + j)));
      n += __builtin_popcount(in);
    }
#endif
    for (; j < V; ++j) {
      out[static_cast<size_t>(n)] = row[j];
      n += b[j] <= last;
    }
#pragma omp simd reduction(max : rest)
    for (i = 0; i < V; ++i) rest = std::max(rest, b[i] > last ? row[i] : -std::numeric_limits<float>::infinity());
    out.resize(static_cast<size_t>(taken));
    std::sort(out.begin(), out.end(), std::greater<float>());
    if (!by_mass)
      out.resize(static_cast<size_t>(k));
    else if (static_cast<int64_t>(out.size()) < V)
      out.push_back(rest);
    return true;
  }
};
}  // namespace nucleus

torch::Tensor top_values(torch::Tensor x, torch::Tensor top_k, torch::Tensor top_p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1,
              "top_values: float32 [rows, vocab] with contiguous rows");
  const int64_t T = x.size(0), V = x.size(1);
  auto kk = top_k.reshape({-1}).to(torch::kInt64).contiguous();
  auto pp = top_p.reshape({-1}).to(torch::kFloat32).contiguous();
  TORCH_CHECK(kk.numel() == T && pp.numel() == T && V > 0, "top_values: one top_k and one top_p per row");
  const float *xp = x.data_ptr<float>(), *ppp = pp.data_ptr<float>();
  const int64_t *kp = kk.data_ptr<int64_t>(), ls = x.stride(0);
  std::vector<std::vector<float>> rows(static_cast<size_t>(T));
  std::atomic<bool> bad{false};
  at::parallel_for(0, T, 1, [&](int64_t r0, int64_t r1) {
    nucleus::Row h;
    for (int64_t r = r0; r < r1 && !bad.load(std::memory_order_relaxed); ++r)
      if (!h.top(xp + r * ls, V, std::min(kp[r], V), ppp[r], rows[static_cast<size_t>(r)])) bad = true;
  });
  if (bad) return torch::empty({0, 0}, x.options());
  size_t width = 1;
  for (const auto& v : rows) width = std::max(width, v.size());
  auto vals = torch::full({T, static_cast<int64_t>(width)}, -std::numeric_limits<float>::infinity(), x.options());
  float* vp = vals.data_ptr<float>();
  for (int64_t r = 0; r < T; ++r) std::copy(rows[r].begin(), rows[r].end(), vp + r * static_cast<int64_t>(width));
  return vals;
}

int64_t max_tile_rows() {
  static const int64_t rows = __builtin_cpu_is("intel") ? 160 : std::numeric_limits<int64_t>::max();
  return rows;
}

torch::Tensor tiles_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& w) {
  const auto& tiles = w[0];
  const int64_t M = x.size(0), K = x.size(1), NT = tiles.size(0);
  if (M <= max_tile_rows() || tiles.scalar_type() != torch::kFloat32) return linear_tiles(x, tiles);  // bf16, f16: tiles at every M
  return at::bmm(x.unsqueeze(0).expand({NT, M, K}), tiles).transpose(0, 1).reshape({M, NT * kTile});
}

int64_t tiles_matmul_address() { return reinterpret_cast<int64_t>(&tiles_matmul); }

// The running first maximum of some of a row's columns, as first_max_scalar picks it over the
// whole row (a NaN is the maximum: its first one; ties go to the lower column), held so that
// merging in any order gives the same: the fused argmax's threads take tiles out of order.
struct RowBest {
  static constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  float val = -std::numeric_limits<float>::infinity();
  int64_t at = kNone, nan_at = kNone;
  void add(float v, int64_t j) {
    if (v != v)
      nan_at = std::min(nan_at, j);
    else if (v > val || (v == val && j < at))
      val = v, at = j;
  }
  void merge(const RowBest& o) {
    nan_at = std::min(nan_at, o.nan_at);
    if (o.at != kNone) add(o.val, o.at);
  }
  int64_t index() const { return nan_at != kNone ? nan_at : at; }
};

#ifdef PAGEBUS_SIMD
// A tile's kTile values of one row (columns c0..) into b: one vector pass, and the values one by
// one only where the tile may hold the best so far or a NaN (a few tiles of a row's thousand).
template <typename T>
inline void add_tile(const T* y, int64_t c0, RowBest& b) {
  vf v[kTileVecs];
  for (int i = 0; i < kTileVecs; ++i) v[i] = vload(y + i * kLanes);
  vf m = v[0];
  bool nan = false;
  for (int i = 0; i < kTileVecs; ++i) {
#ifdef __AVX512F__
    nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q) != 0;
#else
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q)) != 0;
#endif
    m = vmax(m, v[i]);
  }
  if (nan || max_lanes(m) >= b.val)
    for (int64_t j = 0; j < kTile; ++j) b.add(f32(y[j]), c0 + j);
}

// tiles_into's `out` for argmax_tiles: each tile's block of y in the thread's scratch, reduced
// into the thread's RowBest of each row while it is in L1.
template <typename T>
struct TilesArgmax {
  int64_t M, rows_cap;
  std::vector<RowBest>& best;  // [threads][M]
  static std::vector<T>& scratch() {
    thread_local std::vector<T> s;
    return s;
  }
  T* at(int64_t, int64_t, int64_t& ld) const {
    ld = kTile;
    auto& s = scratch();
    if (static_cast<int64_t>(s.size()) < rows_cap * kTile) s.resize(static_cast<size_t>(rows_cap * kTile));
    return s.data();
  }
  void done(int64_t r0, int64_t rows, int64_t t) const {
    const T* s = scratch().data();
    RowBest* mine = best.data() + at::get_thread_num() * M;
    for (int64_t r = 0; r < rows; ++r) add_tile(s + r * kTile, t * kTile, mine[r0 + r]);
  }
};

template <typename T, typename W>
void argmax_into(const TilesCall& c, const torch::Tensor& x, const torch::Tensor& tiles, std::vector<RowBest>& best) {
  // the rows tiles_into hands over at once: all of them, or a row chunk's
  const int64_t rows_cap = c.M <= kFewRows ? c.M : std::min(c.M, row_chunk<T>(c.K));
  TilesArgmax<T> o{c.M, rows_cap, best};
  tiles_into<T, W>(x.data_ptr<T>(), x.stride(0), tiles.data_ptr<W>(), o, c.M, c.K, c.NT);
}
#endif

// Each row's first maximum of x @ W^T: argmax_rows(linear_tiles(x, tiles).float()), NaN
// included, without storing the product. Each tile's block of it is reduced in L1 as the tile
// kernel leaves it: a greedy step's LM head, whose [rows, vocab] logits, written early in a
// stream of 57 MB of weights, had left the caches by its end, so converting them to float32 and
// the argmax read them back from DRAM (~0.1 ms of a 7-10 ms single-stream step, bf16, Zen 4).
// AMX and MKL's float32 rows (linear_tiles's other paths) take the product and argmax_rows.
torch::Tensor argmax_tiles(torch::Tensor x, torch::Tensor tiles) {
  const TilesCall c = check_tiles(x, tiles, "argmax_tiles");
  TORCH_CHECK(c.M == 0 || c.NT > 0, "argmax_tiles: an empty row has no maximum");
  auto out = torch::empty({c.M}, x.options().dtype(torch::kInt64));
#ifdef PAGEBUS_SIMD
  if (!amx_takes(c) && (c.st != torch::kFloat32 || c.h || c.M <= max_tile_rows())) {
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    std::vector<RowBest> best(static_cast<size_t>(threads * c.M));
    if (c.h) {
#ifdef PAGEBUS_F16
      argmax_into<float, f16>(c, x, tiles, best);
#endif
    } else if (c.b16) {
#ifdef __AVX512BF16__
      argmax_into<bf16, bf16>(c, x, tiles, best);
#endif
    } else {
      argmax_into<float, float>(c, x, tiles, best);
    }
    int64_t* op = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < c.M; ++r) {
      RowBest b = best[r];
      for (int64_t t = 1; t < threads; ++t) b.merge(best[t * c.M + r]);
      op[r] = b.index();
    }
    return out;
  }
#endif
  return argmax_rows(tiles_matmul(x, {tiles}).to(torch::kFloat32));
}

// silu(x . gate) * (x . up) from a gate_up weight's column tiles into out [M, NT / 2 * kTile]:
// float32 x, float32 or float16 tiles, where tiles_matmul would run the tile kernel; false (out
// untouched) elsewhere, and the caller runs the matmul and silu_and_mul. Beside the separate
// calls, Zen 3, interleaved: see gate_up_silu_kernel.
bool gate_up_silu_into(const torch::Tensor& x, const torch::Tensor& tiles, torch::Tensor& out) {
#ifdef PAGEBUS_SIMD
  if (x.scalar_type() != torch::kFloat32 || x.dim() != 2 || x.stride(1) != 1 || x.size(0) == 0 ||
      !tiles.is_contiguous() || tiles.dim() != 3 || tiles.size(2) != kTile || tiles.size(1) != x.size(1) ||
      tiles.size(0) % 2 != 0 || !tiles.device().is_cpu())
    return false;
  const int64_t M = x.size(0), K = x.size(1), NT = tiles.size(0);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == NT / 2 * kTile && out.stride(1) == 1,
              "gate_up_silu: out [M, d] float32 with contiguous rows expected");
  if (tiles.scalar_type() == torch::kFloat32 && M <= max_tile_rows()) {
    gate_up_silu_kernel<float>(x.data_ptr<float>(), x.stride(0), tiles.data_ptr<float>(), out.data_ptr<float>(),
                               out.stride(0), M, K, NT);
    return true;
  }
#ifdef PAGEBUS_F16
  if (tiles.scalar_type() == torch::kHalf) {
    gate_up_silu_kernel<f16>(x.data_ptr<float>(), x.stride(0), tiles.data_ptr<f16>(), out.data_ptr<float>(),
                             out.stride(0), M, K, NT);
    return true;
  }
#endif
#endif
  return false;
}

// The same for Python: a new [M, d] tensor, or None where gate_up_silu_into declines.
c10::optional<torch::Tensor> gate_up_silu(torch::Tensor x, torch::Tensor tiles) {
  if (x.dim() != 2 || tiles.dim() != 3) return c10::nullopt;
  auto out = torch::empty({x.size(0), tiles.size(0) / 2 * tiles.size(2)}, x.options());
  if (!gate_up_silu_into(x, tiles, out)) return c10::nullopt;
  return out;
}

struct StackMatmul {
  MatmulFn fn;
  std::vector<torch::Tensor> w;
  torch::Tensor operator()(const torch::Tensor& x) const { return fn(x, w); }
};

struct StackLayer {
  torch::Tensor in_norm, post_norm, k_cache, v_cache;
  StackMatmul qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, double scale, double eps)
      : heads_(heads), kv_heads_(kv_heads), scale_(scale), eps_(eps) {}

  // fns / weights: the layer's qkv, o, gate_up and down matmuls, in that order.
  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, std::vector<int64_t> fns,
                 std::vector<std::vector<torch::Tensor>> weights, torch::Tensor k_cache, torch::Tensor v_cache) {
    TORCH_CHECK(fns.size() == 4 && weights.size() == 4, "DecodeStack.add_layer: 4 matmuls (qkv, o, gate_up, down)");
    for (int64_t f : fns) TORCH_CHECK(f != 0, "DecodeStack.add_layer: a matmul without an address");
    TORCH_CHECK(in_norm.is_contiguous() && post_norm.is_contiguous() && in_norm.dim() == 1 &&
                    post_norm.sizes() == in_norm.sizes() && post_norm.scalar_type() == in_norm.scalar_type() &&
                    (layers_.empty() || in_norm.scalar_type() == layers_.front().in_norm.scalar_type()),
                "DecodeStack.add_layer: contiguous 1-D norm weights of one dtype expected");
    auto mm = [&](int i) { return StackMatmul{reinterpret_cast<MatmulFn>(fns[i]), weights[i]}; };
    layers_.push_back({in_norm, post_norm, k_cache, v_cache, mm(0), mm(1), mm(2), mm(3)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // (hidden, residual) after the last layer, as the layers' forward returns them; residual
  // None: x is the embedding's output, and the first layer's residual. The residual stream, the
  // normed rows and the SiLU product live in buffers of this call, updated in place layer after
  // layer: a layer then allocates only its matmuls' outputs and the attention's (the separate
  // ops cost ~3 us each at one row, mostly their output tensors and views).
  //
  // tail 1: [the final norm of every row's hidden + residual] instead; tail 2: [each row's argmax
  // of the LM head over those] (set_final's): a decode step where every row samples. One call
  // then ends the step's model: the separate gather, norm and head calls cost ~0.15 ms a step
  // in the single stream (their first touch of code and data the weight stream had flushed).
  std::vector<torch::Tensor> run(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor positions,
                                 torch::Tensor cos_sin, torch::Tensor slots, torch::Tensor block_tables,
                                 torch::Tensor seq_lens, torch::Tensor query_start_loc, int64_t tail) {
    TORCH_CHECK(tail >= 0 && tail <= 2, "DecodeStack.run: tail 0 (layers), 1 (final norm) or 2 (argmax)");
    TORCH_CHECK(tail == 0 || final_norm_.defined(), "DecodeStack.run: a tail without set_final");
    TORCH_CHECK(tail < 2 || head_.defined(), "DecodeStack.run: an argmax tail without the head's tiles");
    const auto st = check_dtype({&x}, "DecodeStack.run");
    TORCH_CHECK(!layers_.empty() && layers_.front().in_norm.scalar_type() == st, "DecodeStack.run: no layers, or x ",
                "of another dtype than the norms'");
    TORCH_CHECK(x.dim() == 2 && (!residual || (residual->sizes() == x.sizes() && residual->scalar_type() == st)),
                "DecodeStack.run: x [T, hidden] and a residual of its shape and dtype expected");
    const int64_t M = x.size(0), hid = x.size(1);
    const float eps = static_cast<float>(eps_);
    x = x.contiguous();
    auto res = torch::empty_like(x), h = torch::empty_like(x);
    torch::Tensor act;  // silu(gate) * up, sized by the first gate_up
    DISPATCH(st, {
      if (residual) {
        auto r = residual->contiguous();
        add_norm_rows<T>(x.data_ptr<T>(), r.data_ptr<T>(), layers_.front().in_norm.data_ptr<T>(), res.data_ptr<T>(),
                         h.data_ptr<T>(), M, hid, eps);
      } else {
        res.copy_(x);
        norm_rows<T>(res.data_ptr<T>(), hid, layers_.front().in_norm.data_ptr<T>(), h.data_ptr<T>(), M, hid, eps);
      }
      for (size_t i = 0; i < layers_.size(); ++i) {
        const auto& L = layers_[i];
        if (i > 0)
          add_norm_rows<T>(x.data_ptr<T>(), res.data_ptr<T>(), L.in_norm.data_ptr<T>(), res.data_ptr<T>(),
                           h.data_ptr<T>(), M, hid, eps);
        auto a = qkv_decode_attention(L.qkv(h), heads_, kv_heads_, positions, cos_sin, L.k_cache, L.v_cache, slots,
                                      block_tables, seq_lens, query_start_loc, scale_);
        auto o = L.o(a).contiguous();
        add_norm_rows<T>(o.data_ptr<T>(), res.data_ptr<T>(), L.post_norm.data_ptr<T>(), res.data_ptr<T>(),
                         h.data_ptr<T>(), M, hid, eps);
        // the tile kernel's gate_up: its SiLU product straight from the tiles (gate_up_silu_into)
        bool fused = false;
        if (L.gate_up.fn == &tiles_matmul && L.gate_up.w.size() == 1 && L.gate_up.w[0].dim() == 3) {
          if (!act.defined()) act = torch::empty({M, L.gate_up.w[0].size(0) / 2 * kTile}, x.options());
          fused = gate_up_silu_into(h, L.gate_up.w[0], act);
        }
        if (!fused) {
          auto gu = L.gate_up(h).contiguous();
          const int64_t d = gu.size(1) / 2;
          if (!act.defined()) act = torch::empty({M, d}, x.options());
          silu_and_mul_rows<T>(gu.data_ptr<T>(), gu.stride(0), act.data_ptr<T>(), M, d);
        }
        x = L.down(act).contiguous();
      }
      if (tail > 0)
        add_norm_rows<T>(x.data_ptr<T>(), res.data_ptr<T>(), final_norm_.data_ptr<T>(), res.data_ptr<T>(),
                         h.data_ptr<T>(), M, hid, static_cast<float>(final_eps_));
    });
    if (tail == 1) return {h};
    if (tail == 2) return {argmax_tiles(h, head_)};
    return {x, res};
  }

  // A greedy decode step from the token ids to their next ones: the embedding's rows (set_embedding),
  // the layers, the final norm and the head's argmax, and the step's rows of the persistent
  // block table, in one call from the runner (workers/runner.py _greedy_step). The model's Python around
  // the stack (module calls, inference mode, the embedding's and the table's gathers) took ~0.25
  // ms of a single-stream step, on code and data the weight stream had flushed.
  // The ids come back as a list (no tensor to wrap and read back from Python).
  std::vector<int64_t> greedy_step(torch::Tensor ids, torch::Tensor positions, torch::Tensor cos_sin,
                                   torch::Tensor slots, torch::Tensor table, torch::Tensor rows, torch::Tensor seq_lens,
                                   torch::Tensor query_start_loc) {
    TORCH_CHECK(embed_.defined(), "DecodeStack.greedy_step: no set_embedding");
    c10::InferenceMode guard;
    auto x = embed_tiled_ ? embed_rows(embed_, ids) : embed_.index_select(0, ids);
    const auto out = run(x, c10::nullopt, positions, cos_sin, slots, table.index_select(0, rows), seq_lens,
                         query_start_loc, 2)[0];
    const int64_t* p = out.data_ptr<int64_t>();
    return std::vector<int64_t>(p, p + out.numel());
  }

  // What greedy_step looks the ids up in: pack_tiles' column tiles of a tied head (embed_rows) or
  // the [vocab, hidden] table, its rows of the activations' dtype.
  void set_embedding(torch::Tensor weight, bool tiled) {
    TORCH_CHECK(tiled || (weight.dim() == 2 && !layers_.empty() &&
                          weight.scalar_type() == layers_.front().in_norm.scalar_type()),
                "DecodeStack.set_embedding: column tiles, or a [vocab, hidden] table of the norms' dtype");
    embed_ = weight;
    embed_tiled_ = tiled;
  }

  // The model's final norm and, where argmax_tiles takes the activations' dtype, the LM head's
  // column tiles (undefined: no argmax tail).
  void set_final(torch::Tensor norm, double eps, c10::optional<torch::Tensor> head) {
    TORCH_CHECK(!layers_.empty() && norm.is_contiguous() && norm.sizes() == layers_.front().in_norm.sizes() &&
                    norm.scalar_type() == layers_.front().in_norm.scalar_type(),
                "DecodeStack.set_final: after add_layer, a contiguous norm weight like the layers' expected");
    final_norm_ = norm;
    final_eps_ = eps;
    head_ = head ? *head : torch::Tensor();
  }

 private:
  int64_t heads_, kv_heads_;
  double scale_, eps_, final_eps_ = 0.0;
  std::vector<StackLayer> layers_;
  torch::Tensor final_norm_, head_, embed_;
  bool embed_tiled_ = false;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("TILE") = kTile;
  m.def("pack_tiles", &pack_tiles, "[N, K] -> [N / TILE, K, TILE] (bfloat16: [N / TILE, K / 2, TILE, 2])");
  m.def("tiles_built", &tiles_built, "whether this build multiplies float32 tiles (AVX-512 or AVX2 + FMA)");
  m.def("bf16_tiles_built", &bf16_tiles_built, "whether this build multiplies bfloat16 tiles (AVX-512 BF16)");
  m.def("bf16_amx_in_use", &bf16_amx_in_use, "whether bfloat16 tiles multiply on AMX (from 2 rows, K % 32 == 0)");
  m.def("linear_tiles", &linear_tiles, "x [M, K] times column tiles -> [M, N]");
  m.def("embed_rows", &embed_rows, "rows `ids` of the matrix column tiles hold (float16 widened to float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "RMSNorm of x + residual, and the sum");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("rotary", &rotary, "NeoX rotary of q and k into one new buffer");
  m.def("write_kv", &write_kv, "scatter K/V rows into their cache slots");
  m.def("decode_attention", &decode_attention, "paged attention of the one-token queries");
  m.def("prefill_attention", &prefill_attention, "paged causal attention of the prefill chunks (False: not taken)");
  m.def("qkv_decode_attention", &qkv_decode_attention, "rotary, cache write and decode attention from fused QKV");
  m.def("argmax_tiles", &argmax_tiles, "argmax_rows of x times column tiles, without storing the product");
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum (torch.argmax(-1); NaN is the maximum)");
  m.def("race_candidates", &race_candidates, "ids that can win each row's exponential race, and their counts (-1: the whole row)");
  m.def("top_values", &top_values, "each row's top values for a top_k / top_p cutoff, sorted, -inf padded (empty: torch's path)");
  m.def("max_tile_rows", &max_tile_rows, "float32 rows above which the tiles go to MKL's batched GEMM");
  m.def("f16_built", &f16_built, "whether float16 caches and weight tiles beside float32 activations are compiled in");
  m.def("tiles_matmul_address", &tiles_matmul_address, "address of the column-tile matmul, for DecodeStack");
  m.def("gate_up_silu", &gate_up_silu, "silu(x . gate) * (x . up) from gate_up's tiles (None: not on this path)");
  // module_local: two builds (an A/B of kernels) can be loaded in one process
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_final", &DecodeStack::set_final)
      .def("set_embedding", &DecodeStack::set_embedding)
      .def("greedy_step", &DecodeStack::greedy_step)
      .def("run", &DecodeStack::run);
}
