"""CPU matmuls on 32-wide groups of quantized weights, compiled once per machine (C++, -march=native).

torch's own CPU ops for packed weights (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
ran 10-300x slower than fp32 F.linear at this model's shapes on the AVX-512 machine this was
written on (bench/quant_kernels.py), and dequantizing through torch ops at every call 2-20x
slower. These kernels read the packed weight once per step and dequantize it in registers:
up to 64 rows of x (decode), 16 rows of W at a time go through AVX-512 FMAs against chunks
of 8 rows of x, so W is read from memory once and packed (5 bits a weight for Q4_1, against
32 for fp32); above 64 rows (prefill chunks) W is dequantized once into a float copy and
multiplied by the BLAS that F.linear uses. Without AVX-512 the same loops run in scalar C++.

On AVX-512 VNNI machines, 1-2 rows of x (single-stream decode) go in as int8 instead, as in
llama.cpp: each 32-wide group of x is quantized (max |x| -> 127, one float scale) and vpdpbusd
multiplies 64 weights by 64 activations at once, so the kernel is bound by reading W rather than
by unpacking it (1.2-2.1x the float GEMV per shape at 1 thread). The error this adds is at most
half a step of x's grid per group, times the group's |w| sum (tests/workers/quant assert that).

Layouts (GGUF's own block contents, split into arrays; `G = K / 32` groups per row):
- q4: qs uint8 [N, G, 16], d and m float32 [N, G]: in group g, byte j holds column 32g+j in
  its low nibble and 32g+16+j in its high one; w = d * q + m (Q4_1: as stored). Symmetric
  formats (Q4_0) hold no m: w = d * (q - 8), 20 bytes a group instead of 24.
- q8: qs int8 [N, K], d float32 [N, K / gs]: w = d * q (Q8_0: gs = 32; int8 per-channel: gs = K).

`make setup` builds them (`python -m pagebus.workers.layers.quant.cpu_kernels --build`) into
torch's extension cache, where the engine finds them; otherwise the first use builds them. When
they cannot be built (no g++ or ninja) a warning says so once and the matmuls run in torch
(dequantize, then F.linear): the same values, several times slower.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from pagebus.kernels.quant_matmul import dequantize_q4, dequantize_q8

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>

// Row n of W, dequantized into out[0, K).
// __restrict__: uint8/int8 pointers may alias anything, which would stop vectorization.
static inline void deq_q4_row(const uint8_t* __restrict__ qs, const float* __restrict__ d,
                              const float* __restrict__ m, int64_t K, float* __restrict__ out) {
  const int64_t G = K / 32;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* __restrict__ q = qs + g * 16;
    const float s = d[g], b = m ? m[g] : -8.f * s;
    float* __restrict__ o = out + g * 32;
    for (int j = 0; j < 16; ++j) {
      o[j] = s * (float)(q[j] & 15) + b;
      o[j + 16] = s * (float)(q[j] >> 4) + b;
    }
  }
}

static inline void deq_q8_row(const int8_t* __restrict__ qs, const float* __restrict__ d, int64_t K,
                              int64_t gs, float* __restrict__ out) {
  for (int64_t k0 = 0; k0 < K; k0 += gs) {
    const float s = d[k0 / gs];
    for (int64_t k = k0; k < k0 + gs; ++k) out[k] = s * (float)qs[k];
  }
}

constexpr int64_t kMaxGemvRows = 8;  // accumulators in registers: 8 of AVX-512's 32
constexpr int64_t kMaxGemvM = 64;  // above: one dequantized copy of W and one BLAS call
// Up to this many rows, x goes in as int8 (VNNI machines): 1.2-2.1x the float GEMV at 1-2 rows
// at this model's shapes, one thread; from 3 rows on the float GEMV, whose dequantized weights
// serve 8 rows at once, is as fast or faster (0.7-1.1x at 3-32 rows).
constexpr int64_t kMaxInt8Rows = 2;

#ifdef __AVX512F__
#include <immintrin.h>
// 32 weights of group g of a row, as two vectors of 16 floats (columns 32g..+15, 32g+16..+31).
static inline void q4_group(const uint8_t* q, float d, float m, __m512& lo, __m512& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(15);
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), dv, mv);
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), dv, mv);
}
static inline void q8_half(const int8_t* q, float d, __m512& w) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(d));
}
#endif

// The weights' bytes this far ahead are prefetched by hand, once a cache line: streaming them,
// the hardware prefetcher alone left the loads waiting. int8 path, the default model's 120 q4
// matmuls + Q8_0 head at one row: 13.1 -> 9.5 ms on one thread, 7.2 -> 5.9 ms on two (512 B to
// 16 KiB measured, 4-8 KiB best); float GEMV, 8 rows, one thread: q4 31.1 -> 28.8 ms, q8 37.8 ->
// 35.1; 32 rows, two threads: within noise. Prefetches past a tensor's end do not fault.
constexpr int64_t kPrefetchBytes = 4096;

#ifdef __AVX512F__
// y[r, n] for r < M, n in [n0, n1): W read once, straight into FMAs. M is a template argument
// so the M accumulators live in registers (a runtime-length array spilled them to the stack).
template <int M>
static void q4_rows(const float* xp, int64_t K, const uint8_t* qs, const float* d, const float* m,
                    float* yp, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = qs + n * G * 16;
    const float* dn = d + n * G;
    const float* mn = m ? m + n * G : nullptr;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + g * 16 + kPrefetchBytes), _MM_HINT_T0);
      __m512 lo, hi;
      q4_group(q + g * 16, dn[g], mn ? mn[g] : -8.f * dn[g], lo, hi);
      for (int r = 0; r < M; ++r) {
        const float* xg = xp + r * K + g * 32;
        acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[r]);
        acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) yp[r * N + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// The group loop outside the 16-wide steps: one scale load per group, no k / gs division.
template <int M>
static void q8_rows(const float* xp, int64_t K, int64_t gs, const int8_t* qs, const float* d,
                    float* yp, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / gs;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = qs + n * K;
    const float* dn = d + n * G;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const float s = dn[g];
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 16) {
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + k + kPrefetchBytes), _MM_HINT_T0);
        __m512 w;
        q8_half(q + k, s, w);
        for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + r * K + k), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) yp[r * N + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

#define PAGEBUS_BY_ROWS(M, F, ...)                 \
  switch (M) {                                     \
    case 1: F<1>(__VA_ARGS__); break;              \
    case 2: F<2>(__VA_ARGS__); break;              \
    case 3: F<3>(__VA_ARGS__); break;              \
    case 4: F<4>(__VA_ARGS__); break;              \
    case 5: F<5>(__VA_ARGS__); break;              \
    case 6: F<6>(__VA_ARGS__); break;              \
    case 7: F<7>(__VA_ARGS__); break;              \
    default: F<8>(__VA_ARGS__); break;             \
  }
#endif


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEBUS_VNNI 1
// int8 activations (what llama.cpp multiplies its quantized weights with): each 32-wide group of
// a row of x becomes int8 with one float scale (max |x| -> 127), laid out in the order the weight
// kernel reads, so one vpdpbusd multiplies 64 weights by 64 activations and sums them in fours.
// Chunk-major ([chunk][row]), so the kernel finds row r of a chunk at a constant offset.
struct QuantX {
  int64_t M = 0, K = 0, G = 0, chunks = 0, bytes = 0;  // bytes of q per row and chunk: 128 (q4), 64 (q8)
  std::vector<int8_t> q;  // [chunks, M, bytes]
  std::vector<float> dx;  // [chunks, M, 16]: each group's scale, in the lanes its sums land in
  std::vector<float> corr;  // [M, G]: the per-group term multiplied with the weights' second array
  std::vector<float> corr_sum;  // [M]: sum of corr (q8 with one scale per row)
};

// Row r of x as int8 groups. q4: chunks of 4 groups, the 16 low-nibble columns of each group
// first (64 bytes), then the 16 high-nibble ones; corr = the group's float sum (times m).
// q8: natural order, chunks of 2 groups; corr = -128 * scale * sum(q) (the weights go in as
// w + 128, unsigned, so each group's product carries 128 * sum(q) too much).
static void quantize_row(const float* x, int64_t r, bool q4, QuantX& qx) {
  float* corr = qx.corr.data() + r * qx.G;
  float total = 0;
  for (int64_t g = 0; g < qx.G; ++g) {
    const __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127.f, id = amax > 0 ? 127.f / amax : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
    const int per = q4 ? 4 : 2, lanes = 16 / per;  // groups a chunk holds; lanes of each group's sums
    int8_t* q = qx.q.data() + ((g / per) * qx.M + r) * qx.bytes;
    float* dx = qx.dx.data() + ((g / per) * qx.M + r) * 16;
    int8_t* lo = q4 ? q + (g % 4) * 16 : q + (g % 2) * 32;
    int8_t* hi = q4 ? lo + 64 : lo + 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(qb));
    for (int i = 0; i < lanes; ++i) dx[(g % per) * lanes + i] = d;
    corr[g] = q4 ? _mm512_reduce_add_ps(_mm512_add_ps(a, b))
                 : -128.f * d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    total += corr[g];
  }
  qx.corr_sum[r] = total;
}

static void quantize_x(const float* xp, int64_t M, int64_t K, bool q4, QuantX& qx) {
  qx.M = M;
  qx.K = K;
  qx.G = K / 32;
  qx.chunks = q4 ? (qx.G + 3) / 4 : (qx.G + 1) / 2;
  qx.bytes = q4 ? 128 : 64;
  qx.q.assign(qx.chunks * M * qx.bytes, 0);  // a last chunk's missing groups stay 0, so they add nothing
  qx.dx.assign(qx.chunks * M * 16, 0.f);
  qx.corr.resize(M * qx.G);
  qx.corr_sum.resize(M);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(xp + r * K, r, q4, qx);
  });
}

// sum over g < G of w[g] * c[g], added to acc (16 groups at a time).
static inline __m512 dot_groups(const float* w, const float* c, int64_t G, __m512 acc) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, w + g), _mm512_maskz_loadu_ps(k, c + g), acc);
  }
  return acc;
}

// y[r0 + r, n] for r < M, n in [n0, n1): 4 groups (64 bytes of q4) a step, shared by the M rows.
template <int M>
static void q4_vnni_rows(const QuantX& qx, int64_t r0, const uint8_t* qs, const float* d, const float* m,
                         float* yp, int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = qx.G, C = qx.chunks;
  const __m512i nib = _mm512_set1_epi8(15);
  const __m512i rep4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = qs + n * G * 16;
    const float* dn = d + n * G;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const int64_t ng = std::min<int64_t>(4, G - 4 * c);
      const __m512i wv = ng == 4 ? _mm512_loadu_si512(q + 64 * c)
                                 : _mm512_maskz_loadu_epi8(~0ULL >> (64 - 16 * ng), q + 64 * c);
      const __m128 dw = ng == 4 ? _mm_loadu_ps(dn + 4 * c) : _mm_maskz_loadu_ps((1 << ng) - 1, dn + 4 * c);
      _mm_prefetch(reinterpret_cast<const char*>(q + 64 * c + kPrefetchBytes), _MM_HINT_T0);
      const __m512i lo = _mm512_and_si512(wv, nib), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
      const __m512 dwe = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(dw));
      const int8_t* xc = qx.q.data() + (c * qx.M + r0) * 128;
      const float* dxc = qx.dx.data() + (c * qx.M + r0) * 16;
      for (int r = 0; r < M; ++r) {
        const int8_t* xq = xc + 128 * r;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
        s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(xq + 64));
        const __m512 sx = _mm512_loadu_ps(dxc + 16 * r);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dwe, sx), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) {  // + sum_g m[g] * sum(x in group g); symmetric: m = -8 d
      const float* cr = qx.corr.data() + (r0 + r) * G;
      acc[r] = m ? dot_groups(m + n * G, cr, G, acc[r])
                 : _mm512_fmadd_ps(_mm512_set1_ps(-8.f), dot_groups(dn, cr, G, _mm512_setzero_ps()), acc[r]);
      yp[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]);
    }
  }
}

// q8 with one scale per 32 columns (PerRow false) or per row (true): 2 groups (64 bytes) a step,
// the weights made unsigned (w + 128) for vpdpbusd; QuantX.corr takes the 128s back out.
template <int M, bool PerRow>
static void q8_vnni_rows(const QuantX& qx, int64_t r0, const int8_t* qs, const float* d, float* yp, int64_t N,
                         int64_t n0, int64_t n1) {
  const int64_t G = qx.G, C = qx.chunks, K = qx.K;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const __m512i rep8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = qs + n * K;
    const float* dn = d + n * (PerRow ? 1 : G);
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const bool two = G - 2 * c >= 2;
      const __m512i wv = two ? _mm512_loadu_si512(q + 64 * c) : _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, q + 64 * c);
      _mm_prefetch(reinterpret_cast<const char*>(q + 64 * c + kPrefetchBytes), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(wv, flip);
      __m512 dwe;
      if constexpr (PerRow) {
        dwe = _mm512_set1_ps(dn[0]);
      } else {
        const __m128 dw = _mm_maskz_loadu_ps(two ? 3 : 1, dn + 2 * c);
        dwe = _mm512_permutexvar_ps(rep8, _mm512_castps128_ps512(dw));
      }
      const int8_t* xc = qx.q.data() + (c * qx.M + r0) * 64;
      const float* dxc = qx.dx.data() + (c * qx.M + r0) * 16;
      for (int r = 0; r < M; ++r) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xc + 64 * r));
        const __m512 sx = _mm512_loadu_ps(dxc + 16 * r);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dwe, sx), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) {
      if constexpr (PerRow) {
        yp[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + dn[0] * qx.corr_sum[r0 + r];
      } else {
        acc[r] = dot_groups(dn, qx.corr.data() + (r0 + r) * G, G, acc[r]);
        yp[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]);
      }
    }
  }
}
template <int M>
static void q8_vnni_group(const QuantX& qx, int64_t r0, const int8_t* qs, const float* d, float* yp, int64_t N,
                          int64_t n0, int64_t n1) {
  q8_vnni_rows<M, false>(qx, r0, qs, d, yp, N, n0, n1);
}
template <int M>
static void q8_vnni_row(const QuantX& qx, int64_t r0, const int8_t* qs, const float* d, float* yp, int64_t N,
                        int64_t n0, int64_t n1) {
  q8_vnni_rows<M, true>(qx, r0, qs, d, yp, N, n0, n1);
}
#endif

int64_t int8_rows() {
#ifdef PAGEBUS_VNNI
  return kMaxInt8Rows;
#else
  return 0;
#endif
}

// y[r, n] for r < M <= kMaxGemvRows, n in [n0, n1).
static void q4_gemv(const float* xp, int64_t M, int64_t K, const uint8_t* qs, const float* d,
                    const float* m, float* yp, int64_t N, int64_t n0, int64_t n1) {
#ifdef __AVX512F__
  PAGEBUS_BY_ROWS(M, q4_rows, xp, K, qs, d, m, yp, N, n0, n1)
#else
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = qs + n * G * 16;
    const float* dn = d + n * G;
    for (int64_t r = 0; r < M; ++r) {
      float s = 0;
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < 16; ++j) {
          const float* xg = xp + r * K + g * 32;
          const float b = m ? m[n * G + g] : -8.f * dn[g];
          s += xg[j] * (dn[g] * (float)(q[g * 16 + j] & 15) + b);
          s += xg[j + 16] * (dn[g] * (float)(q[g * 16 + j] >> 4) + b);
        }
      yp[r * N + n] = s;
    }
  }
#endif
}

static void q8_gemv(const float* xp, int64_t M, int64_t K, int64_t gs, const int8_t* qs, const float* d,
                    float* yp, int64_t N, int64_t n0, int64_t n1) {
#ifdef __AVX512F__
  PAGEBUS_BY_ROWS(M, q8_rows, xp, K, gs, qs, d, yp, N, n0, n1)
#else
  const int64_t G = K / gs;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = qs + n * K;
    const float* dn = d + n * G;
    for (int64_t r = 0; r < M; ++r) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += xp[r * K + k] * dn[k / gs] * (float)q[k];
      yp[r * N + n] = s;
    }
  }
#endif
}

#ifdef __AVX512F__
static inline void deq_q4_row_v(const uint8_t* qs, const float* d, const float* m, int64_t K, float* out) {
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 lo, hi;
    q4_group(qs + g * 16, d[g], m ? m[g] : -8.f * d[g], lo, hi);
    _mm512_storeu_ps(out + g * 32, lo);
    _mm512_storeu_ps(out + g * 32 + 16, hi);
  }
}
#define DEQ_Q4_ROW deq_q4_row_v
#else
#define DEQ_Q4_ROW deq_q4_row
#endif

// rows(r0, count, b0, b1) computes y[r0 : r0 + count, b0 : b1]: 16 rows of W at a time (a few
// KiB, L1) against every chunk of up to 8 rows of x, the rows of W split between threads.
template <typename Rows>
static void gemv_blocks(int64_t M, int64_t N, Rows rows) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += 16) {
      const int64_t b1 = std::min(n1, b0 + 16);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxGemvRows) rows(r0, std::min(kMaxGemvRows, M - r0), b0, b1);
    }
  });
}

static at::Tensor checked_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  return x.contiguous();
}

template <typename Deq, typename Gemv>
static torch::Tensor quant_mm(const torch::Tensor& x, int64_t N, int64_t K, Deq deq, Gemv gemv) {
  auto xc = checked_x(x, K);
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxGemvM) {
    gemv_blocks(M, N, [&](int64_t r0, int64_t rows, int64_t b0, int64_t b1) {
      gemv(xp + r0 * K, rows, yp + r0 * N, b0, b1);
    });
    return y;
  }
  // Prefill-sized: dequantize W once (in parallel), then one multithreaded BLAS call.
  auto w = torch::empty({N, K}, xc.options());
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) deq(n, wp + n * K);
  });
  at::mm_out(y, xc, w.t());
  return y;
}

#ifdef PAGEBUS_VNNI
// Decode-sized x through the int8 dot products: x quantized once, then every block of W.
template <typename Rows>
static torch::Tensor vnni_mm(const torch::Tensor& x, int64_t N, int64_t K, bool q4, Rows rows) {
  auto xc = checked_x(x, K);
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  QuantX qx;
  quantize_x(xc.data_ptr<float>(), M, K, q4, qx);
  gemv_blocks(M, N, [&](int64_t r0, int64_t count, int64_t b0, int64_t b1) { rows(qx, r0, count, yp, b0, b1); });
  return y;
}
#endif

torch::Tensor q4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 32;
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && m.is_contiguous(), "q4 arrays must be contiguous");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.numel() ? m.data_ptr<float>() : nullptr;  // none: symmetric (Q4_0), m = -8 d
  const int64_t G = K / 32;
#ifdef PAGEBUS_VNNI
  if (x.size(0) <= kMaxInt8Rows)
    return vnni_mm(x, N, K, true, [&](const QuantX& qx, int64_t r0, int64_t rows, float* yp, int64_t b0, int64_t b1) {
      PAGEBUS_BY_ROWS(rows, q4_vnni_rows, qx, r0, q, dp, mp, yp, N, b0, b1)
    });
#endif
  return quant_mm(
      x, N, K, [&](int64_t n, float* out) { DEQ_Q4_ROW(q + n * G * 16, dp + n * G, mp ? mp + n * G : nullptr, K, out); },
      [&](const float* xp, int64_t M, float* yp, int64_t n0, int64_t n1) {
        q4_gemv(xp, M, K, q, dp, mp, yp, N, n0, n1);
      });
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
  const int64_t N = qs.size(0), K = qs.size(1), gs = K / d.size(1);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous(), "q8 arrays must be contiguous");
  const int8_t* q = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int64_t G = d.size(1);
#ifdef PAGEBUS_VNNI
  if (x.size(0) <= kMaxInt8Rows && (gs == 32 || gs == K))
    return vnni_mm(x, N, K, false, [&](const QuantX& qx, int64_t r0, int64_t rows, float* yp, int64_t b0, int64_t b1) {
      if (gs == K) {
        PAGEBUS_BY_ROWS(rows, q8_vnni_row, qx, r0, q, dp, yp, N, b0, b1)
      } else {
        PAGEBUS_BY_ROWS(rows, q8_vnni_group, qx, r0, q, dp, yp, N, b0, b1)
      }
    });
#endif
  return quant_mm(
      x, N, K, [&](int64_t n, float* out) { deq_q8_row(q + n * K, dp + n * G, K, gs, out); },
      [&](const float* xp, int64_t M, float* yp, int64_t n0, int64_t n1) {
        q8_gemv(xp, M, K, gs, q, dp, yp, N, n0, n1);
      });
}

// The matmuls by address, for compiled callers in other extensions (kernels/csrc/cpu_ops.cpp's
// DecodeStack): same torch headers, so this signature means the same on both sides.
static torch::Tensor q4_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& w) {
  return q4_mm(x, w[0], w[1], w.size() > 2 ? w[2] : torch::Tensor(at::empty({0}, w[1].options())));
}
static torch::Tensor q8_matmul(const torch::Tensor& x, const std::vector<torch::Tensor>& w) {
  return q8_mm(x, w[0], w[1]);
}
int64_t matmul_address(std::string kind) {
  TORCH_CHECK(kind == "q4" || kind == "q8", "matmul_address: q4 or q8, not ", kind);
  return reinterpret_cast<int64_t>(kind == "q4" ? &q4_matmul : &q8_matmul);
}
"""


class KernelBuildError(RuntimeError):
    pass


def _build(build_directory: str | None = None) -> Any:
    from torch.utils.cpp_extension import load_inline

    os.environ.setdefault("MAX_JOBS", "2")
    try:  # once per machine and source: torch caches the build (~1 min on 2 cores)
        return load_inline(
            name="pagebus_quant_cpu",
            cpp_sources=_SOURCE,
            functions=["q4_mm", "q8_mm", "int8_rows", "matmul_address"],
            # -fopenmp: at::parallel_for is OpenMP inlined from ATen's headers; without the flag it
            # ran every call on one thread
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=build_directory,
            verbose=False,
        )
    except Exception as e:
        raise KernelBuildError(
            f"building the quantized-weight CPU kernels failed ({type(e).__name__}: {e}); they need a C++ "
            "compiler (g++) and ninja (then run `make setup` again)"
        ) from e


@functools.cache
def _ops() -> Any:
    return _build()


@functools.cache
def available() -> bool:
    """Whether the C++ kernels load (building them if needed); warns once when they cannot."""
    try:
        _ops()
    except KernelBuildError as e:
        log.warning("%s. Quantized matmuls run in torch instead (same values, several times slower)", e)
        return False
    return True


def int8_rows() -> int:
    """Up to how many rows of x (single-stream decode) a matmul quantizes x to int8 per 32
    columns and multiplies with int8 dot products, as llama.cpp's CPU kernels do: 2 on AVX-512
    VNNI machines, else 0. Above it, and for int8 weights with groups other than 32 or a whole
    row (Q6_K's 16), x stays float32 throughout."""
    return int(_ops().int8_rows()) if available() else 0


_SYMMETRIC = torch.empty(0)  # q4 without m: w = d * (q - 8)


def q4_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    if not available():
        return F.linear(x, dequantize_q4(qs, d, m))
    return _ops().q4_mm(x, qs, d, _SYMMETRIC if m is None else m)


def q8_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    if not available():
        return F.linear(x, dequantize_q8(qs, d))
    return _ops().q8_mm(x, qs, d)


def matmul_address(kind: str) -> int:
    """The address of the C++ `q4`/`q8` matmul taking (x, [its tensors]), for compiled callers."""
    return int(_ops().matmul_address(kind))


def bound_mm(kind: str, tensors: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`x -> q4_mm(x, *tensors)` (or q8_mm) straight to the compiled function, for float32
    [M, K] x; None when the kernels cannot be built."""
    if not available():
        return None
    if kind == "q4":
        q4, qs, d, m = _ops().q4_mm, *tensors, *([_SYMMETRIC] if len(tensors) == 2 else [])
        return lambda x: q4(x, qs, d, m)
    q8, qs, d = _ops().q8_mm, *tensors
    return lambda x: q8(x, qs, d)


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the quantized-weight CPU kernels into torch's cache.")
    ap.add_argument("--build", action="store_true", required=True)
    ap.parse_args()
    try:
        ops = _ops()
    except KernelBuildError as e:
        sys.exit(f"{e}. The engine will run quantized matmuls in torch instead")
    print(f"quantized-weight CPU kernels: {ops.__file__}")


if __name__ == "__main__":
    main()
