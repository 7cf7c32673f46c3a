// The CPU backend's fused ops (float32): each replaces a chain of small torch ops whose
// dispatch, not arithmetic, dominated a decode step (kernels/cpu_native.py says why and
// when each is used). Built once per machine with -O3 -march=native; loops are written with
// OpenMP simd reductions where a sum must be reordered to vectorize, never -ffast-math (which
// would also assume no infinities, and attention masks with them).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

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

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, what, ": float32 CPU tensor expected");
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, row by row (rms_norm_ref's order of products).
void norm_rows(const float* x, int64_t x_stride, const float* w, float* out, int64_t rows, int64_t h,
               float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * x_stride;
      const float inv = 1.0f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + eps);
      float* o = out + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = (xr[i] * inv) * w[i];
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "rms_norm x");
  check_f32(w, "rms_norm weight");
  const int64_t h = x.size(-1);
  auto x2 = x.reshape({-1, h});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  auto wc = w.contiguous();
  auto out = torch::empty({x2.size(0), h}, x.options());
  norm_rows(x2.data_ptr<float>(), x2.stride(0), wc.data_ptr<float>(), out.data_ptr<float>(), x2.size(0), h,
            static_cast<float>(eps));
  return out.view(x.sizes());
}

// (norm(x + residual) * w, x + residual): the decoder's pre-norm with its residual stream.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(x, "add_rms_norm x");
  check_f32(residual, "add_rms_norm residual");
  check_f32(w, "add_rms_norm weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  const int64_t h = x.size(-1);
  auto x2 = x.reshape({-1, h}).contiguous();
  auto r2 = residual.reshape({-1, h}).contiguous();
  auto wc = w.contiguous();
  const int64_t rows = x2.size(0);
  auto sum = torch::empty({rows, h}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* rp = r2.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  at::parallel_for(0, rows * h, 1 << 14, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) sp[i] = xp[i] + rp[i];
  });
  auto out = torch::empty({rows, h}, x.options());
  norm_rows(sp, h, wc.data_ptr<float>(), out.data_ptr<float>(), rows, h, static_cast<float>(eps));
  return {out.view(x.sizes()), sum.view(x.sizes())};
}

// x [T, 2d] -> silu(x[:, :d]) * x[:, d:]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_f32(x, "silu_and_mul x");
  const int64_t d = x.size(-1) / 2;
  auto x2 = x.reshape({-1, 2 * d});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t rows = x2.size(0), xs = x2.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  const float* xp = x2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict__ g = xp + r * xs;
      const float* __restrict__ u = g + d;
      float* __restrict__ o = op + r * d;
      for (int64_t i = 0; i < d; ++i) o[i] = (g[i] / (1.0f + fast_exp(-g[i]))) * u[i];
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  return out.view(shape);
}

// NeoX rotary on q [T, h, d] and k [T, kvh, d] (any row strides, head vectors contiguous):
// new tensors, views of one [T, h + kvh, d] buffer. cos_sin [max_pos, rot]: cos then sin.
std::vector<torch::Tensor> rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k,
                                  torch::Tensor cos_sin) {
  check_f32(q, "rotary q");
  check_f32(k, "rotary k");
  check_f32(cos_sin, "rotary cos_sin_cache");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64, "rotary: int64 positions expected");
  const int64_t T = q.size(0), h = q.size(1), kvh = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == d, "rotary: q and k shapes differ");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == d && k.stride(1) == d,
              "rotary: head vectors must be contiguous");
  auto cs = cos_sin.contiguous();
  const int64_t rot = cs.size(1), half = rot / 2;
  TORCH_CHECK(rot <= d, "rotary: rotary dim exceeds head dim");
  auto pos = positions.contiguous();
  auto out = torch::empty({T, h + kvh, d}, q.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* csp = cs.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* __restrict__ c = csp + pp[t] * rot;
      const float* __restrict__ s = c + half;
      for (int64_t j = 0; j < h + kvh; ++j) {
        const float* __restrict__ x = j < h ? qp + t * qs + j * d : kp + t * ks + (j - h) * d;
        float* __restrict__ o = op + (t * (h + kvh) + j) * d;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = x[i] * c[i] - x[i + half] * s[i];
          o[i + half] = x[i + half] * c[i] + x[i] * s[i];
        }
        for (int64_t i = rot; i < d; ++i) o[i] = x[i];
      }
    }
  });
  return {out.narrow(1, 0, h), out.narrow(1, h, kvh)};
}

// k/v [T, kvh, d] into caches [blocks, bs, kvh, d] at slot_mapping[t] (-1: skip).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  check_f32(k, "write_kv k");
  check_f32(v, "write_kv v");
  check_f32(k_cache, "write_kv k_cache");
  check_f32(v_cache, "write_kv v_cache");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64, "write_kv: int64 slot_mapping expected");
  const int64_t T = k.size(0), kvh = k.size(1), d = k.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "write_kv: head vectors must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == d && v_cache.strides() == k_cache.strides(),
              "write_kv: caches must hold contiguous head vectors, in one layout");
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * bs;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), row = kvh * d;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "write_kv: slot ", slot, " beyond the cache's ", num_slots);
    const int64_t off = (slot / bs) * s0 + (slot % bs) * s1;
    std::memcpy(kc + off, kp + t * k.stride(0), row * sizeof(float));
    std::memcpy(vc + off, vp + t * v.stride(0), row * sizeof(float));
  }
}

#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

// Attention for the sequences with one query token (decodes), reading the paged caches in
// place: out[t] for t = query_start_loc[b] of every such b; other rows are left untouched.
// One work item per sequence, all its heads: a block's K (then V) rows are read in storage
// order, every KV head of a token before the next token, and each K/V row once for the
// query heads that share it.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                      double scale) {
  check_f32(q, "decode_attention q");
  check_f32(out, "decode_attention out");
  check_f32(k_cache, "decode_attention k_cache");
  check_f32(v_cache, "decode_attention v_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32,
              "decode_attention: int32 block tables, lengths and query starts expected");
  const int64_t h = q.size(1), d = q.size(2), bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(h % kvh == 0 && k_cache.size(3) == d, "decode_attention: head counts or sizes disagree");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && out.stride(2) == 1 && out.stride(1) == d,
              "decode_attention: head vectors must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(),
              "decode_attention: caches must hold contiguous head vectors, in one layout");
  auto bt = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int64_t B = lens.size(0), width = bt.size(1), group = h / kvh;
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qp0 = qsl.data_ptr<int32_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  const int64_t qs = q.stride(0), os = out.stride(0);
  const float sc = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b)
    if (qp0[b + 1] - qp0[b] == 1) TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "decode_attention: bad length");
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores;  // [h, L]
    for (int64_t b = b0; b < b1; ++b) {
      if (qp0[b + 1] - qp0[b] != 1) continue;
      const int64_t t = qp0[b], L = lp[b];
      scores.resize(static_cast<size_t>(h * L));
      float* sp = scores.data();
      const int32_t* table = btp + b * width;
      const float* qt = qp + t * qs;
      for (int64_t j0 = 0; j0 < L; j0 += bs) {  // block by block: no division per key
        const int64_t base = table[j0 / bs] * s0, n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o)
          for (int64_t g = 0; g < kvh; ++g)
            group_dots(qt + g * group * d, kc + base + o * s1 + g * s2, group, d, sc, sp + g * group * L + j0 + o, L);
      }
      float* ot = op + t * os;
      for (int64_t hh = 0; hh < h; ++hh) {
        float* __restrict__ s = sp + hh * L;
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < L; ++j) m = std::max(m, s[j]);
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) s[j] = fast_exp(s[j] - m);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < L; ++j) total += s[j];
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t j = 0; j < L; ++j) s[j] *= inv;
      }
      std::fill(ot, ot + h * d, 0.f);
      for (int64_t j0 = 0; j0 < L; j0 += bs) {
        const int64_t base = table[j0 / bs] * s0, n = std::min(bs, L - j0);
        for (int64_t o = 0; o < n; ++o)
          for (int64_t g = 0; g < kvh; ++g) {
            const float* __restrict__ vr = vc + base + o * s1 + g * s2;
            for (int64_t hh = g * group; hh < (g + 1) * group; ++hh) {
              const float p = sp[hh * L + j0 + o];
              float* __restrict__ oh = ot + hh * d;
#pragma omp simd
              for (int64_t i = 0; i < d; ++i) oh[i] += p * vr[i];
            }
          }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "RMSNorm of x + residual, and the sum");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]");
  m.def("rotary", &rotary, "NeoX rotary of q and k into one new buffer");
  m.def("write_kv", &write_kv, "scatter K/V rows into their cache slots");
  m.def("decode_attention", &decode_attention, "paged attention of the one-token queries");
}
