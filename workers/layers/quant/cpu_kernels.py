"""CPU matmuls on 32-wide groups of quantized weights, compiled once per machine (C++, -march=native).

torch's own CPU ops for packed weights (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`)
ran 10-300x slower than fp32 F.linear at this model's shapes on the AVX-512 machine this was
written on (bench/quant_kernels.py), and dequantizing through torch ops at every call 2-20x
slower. These kernels read the packed weight once per step and dequantize it in registers:
up to 64 rows of x (decode), 16 rows of W at a time go through AVX-512 FMAs against chunks
of 8 rows of x, so W is read from memory once and packed (5 bits a weight for Q4_1, against
32 for fp32); above 64 rows (prefill chunks) W is dequantized once into a float copy and
multiplied by the BLAS that F.linear uses. Without AVX-512 the same loops run in scalar C++.

Layouts (GGUF's own block contents, split into arrays; `G = K / 32` groups per row):
- q4: qs uint8 [N, G, 16], d and m float32 [N, G]: in group g, byte j holds column 32g+j in
  its low nibble and 32g+16+j in its high one; w = d * q + m (Q4_0: m = -8d; Q4_1: as stored).
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
    const float s = d[g], b = m[g];
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
    const float* mn = m + n * G;
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 lo, hi;
      q4_group(q + g * 16, dn[g], mn[g], lo, hi);
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
    const float* mn = m + n * G;
    for (int64_t r = 0; r < M; ++r) {
      float s = 0;
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < 16; ++j) {
          const float* xg = xp + r * K + g * 32;
          s += xg[j] * (dn[g] * (float)(q[g * 16 + j] & 15) + mn[g]);
          s += xg[j + 16] * (dn[g] * (float)(q[g * 16 + j] >> 4) + mn[g]);
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
    q4_group(qs + g * 16, d[g], m[g], lo, hi);
    _mm512_storeu_ps(out + g * 32, lo);
    _mm512_storeu_ps(out + g * 32 + 16, hi);
  }
}
#define DEQ_Q4_ROW deq_q4_row_v
#else
#define DEQ_Q4_ROW deq_q4_row
#endif

template <typename Deq, typename Gemv>
static torch::Tensor quant_mm(const torch::Tensor& x, int64_t N, int64_t K, Deq deq, Gemv gemv) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxGemvM) {
    // 16 rows of W at a time (a few KiB, L1) against every chunk of 8 rows of x.
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t b0 = n0; b0 < n1; b0 += 16) {
        const int64_t b1 = std::min(n1, b0 + 16);
        for (int64_t r0 = 0; r0 < M; r0 += kMaxGemvRows)
          gemv(xp + r0 * K, std::min(kMaxGemvRows, M - r0), yp + r0 * N, b0, b1);
      }
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

torch::Tensor q4_mm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
  const int64_t N = qs.size(0), K = qs.size(1) * 32;
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && m.is_contiguous(), "q4 arrays must be contiguous");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const int64_t G = K / 32;
  return quant_mm(
      x, N, K, [&](int64_t n, float* out) { DEQ_Q4_ROW(q + n * G * 16, dp + n * G, mp + n * G, K, out); },
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
  return quant_mm(
      x, N, K, [&](int64_t n, float* out) { deq_q8_row(q + n * K, dp + n * G, K, gs, out); },
      [&](const float* xp, int64_t M, float* yp, int64_t n0, int64_t n1) {
        q8_gemv(xp, M, K, gs, q, dp, yp, N, n0, n1);
      });
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
            functions=["q4_mm", "q8_mm"],
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


def q4_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if not available():
        return F.linear(x, dequantize_q4(qs, d, m))
    return _ops().q4_mm(x, qs, d, m)


def q8_mm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    if not available():
        return F.linear(x, dequantize_q8(qs, d))
    return _ops().q8_mm(x, qs, d)


def bound_mm(kind: str, tensors: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`x -> q4_mm(x, *tensors)` (or q8_mm) straight to the compiled function, for float32
    [M, K] x; None when the kernels cannot be built."""
    if not available():
        return None
    if kind == "q4":
        q4, qs, d, m = _ops().q4_mm, *tensors
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
