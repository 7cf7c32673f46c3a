"""`x @ W^T` for e4m3 weights on CPUs, compiled once per machine (C++, -march=native).

Dequantizing an e4m3 matrix through torch ops at every call ran the default model's decode at
1/11 of fp32's speed (bench/fp8_kv.py fp8_weights: torch converts e4m3 one value at a time).
Here, up to 32 rows of x (decode), each byte of W is widened in registers: its sign and its 7
exponent/mantissa bits are moved into an fp32's bit positions, and one multiply by 2**120 rebiases
the exponent (e4m3's subnormals come out right, as fp32 subnormals times 2**120), then FMAs
against chunks of 8 rows of x; a row's scale multiplies its sums. Above 32 rows W is widened once
into a float copy for one BLAS call. Without AVX-512 the same loops run in scalar C++. Needs K a
multiple of 16; otherwise, or when the build fails (a warning says why once), Fp8LinearMethod
dequantizes in torch. `make setup` builds it (`python -m pagebus.workers.layers.quant.fp8_cpu`);
otherwise the first fp8 matmul does.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static constexpr int64_t kMaxGemvM = 32;
static constexpr float kRebias = 1.329227995784916e36f;  // 2**120: e4m3 bias 7 -> fp32 bias 127

static inline float e4m3(uint8_t b) {
  const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7F) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * kRebias;
}

#ifdef __AVX512F__
static inline __m512 e4m3x16(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  const __m512i em = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, em)), _mm512_set1_ps(kRebias));
}

// y[r, n] = s[n] * sum_k x[r, k] w[n, k] for R rows of x and n in [n0, n1).
template <int R>
static void rows(const float* x, int64_t K, const uint8_t* w, const float* s, float* y, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* wn = w + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 wv = e4m3x16(wn + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = s[n] * _mm512_reduce_add_ps(acc[r]);
  }
}
#endif

static void gemv(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* s, float* y,
                 int64_t N, int64_t n0, int64_t n1) {
#ifdef __AVX512F__
  switch (M) {
    case 1: rows<1>(x, K, w, s, y, N, n0, n1); break;
    case 2: rows<2>(x, K, w, s, y, N, n0, n1); break;
    case 3: rows<3>(x, K, w, s, y, N, n0, n1); break;
    case 4: rows<4>(x, K, w, s, y, N, n0, n1); break;
    case 5: rows<5>(x, K, w, s, y, N, n0, n1); break;
    case 6: rows<6>(x, K, w, s, y, N, n0, n1); break;
    case 7: rows<7>(x, K, w, s, y, N, n0, n1); break;
    default: rows<8>(x, K, w, s, y, N, n0, n1); break;
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += x[r * K + k] * e4m3(w[n * K + k]);
      y[r * N + n] = s[n] * acc;
    }
#endif
}

torch::Tensor fp8_mm(torch::Tensor x, torch::Tensor w, torch::Tensor s) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && s.is_contiguous(), "w: e4m3 bytes [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.size(1) == K && K % 16 == 0 && s.numel() == N, "shapes: x [M, K], w [N, K], K % 16 == 0");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kMaxGemvM) {
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t b0 = n0; b0 < n1; b0 += 16) {  // 16 rows of W (a few KiB) against every 8 of x
        const int64_t b1 = std::min(n1, b0 + 16);
        for (int64_t r0 = 0; r0 < M; r0 += 8) gemv(xp + r0 * K, std::min<int64_t>(8, M - r0), K, wp, sp, yp + r0 * N, N, b0, b1);
      }
    });
    return y;
  }
  auto wf = torch::empty({N, K}, xc.options());
  float* wfp = wf.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) wfp[n * K + k] = sp[n] * e4m3(wp[n * K + k]);
  });
  at::mm_out(y, xc, wf.t());
  return y;
}
"""


@functools.cache
def _ops() -> Any | None:
    """The compiled module, or None (warned once) when it cannot be built."""
    from pagebus.kernels.cpu_native import build_directory_for
    from torch.utils.cpp_extension import load_inline

    os.environ.setdefault("MAX_JOBS", "2")
    try:  # torch caches the build per machine and source
        with build_directory_for("pagebus_fp8_cpu") as build_directory:
            return load_inline(
                name="pagebus_fp8_cpu",
                cpp_sources=_SOURCE,
                functions=["fp8_mm"],
                build_directory=build_directory,
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as e:
        log.warning(
            "building the fp8 CPU kernel failed (%s: %s; it needs g++ and ninja): fp8 matmuls "
            "dequantize in torch instead, about 10x slower",
            type(e).__name__,
            e,
        )
        return None


def fp8_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float32 @ (e4m3 w [N, K] * scale [N] per row)^T, or None when the kernel cannot
    take it (another dtype, K not a multiple of 16, no build)."""
    ops = _ops() if x.dtype == torch.float32 and w.shape[1] % 16 == 0 else None
    if ops is None:
        return None
    out: torch.Tensor = ops.fp8_mm(x, w.view(torch.uint8), scale)
    return out


def main() -> int:
    """`python -m pagebus.workers.layers.quant.fp8_cpu`: build the kernel now (make setup runs it)."""
    logging.basicConfig(level=logging.WARNING)
    ops = _ops()
    if ops is None:
        print(
            "pagebus fp8 CPU kernel: not built (see the warning above); fp8 matmuls dequantize in torch",
            file=sys.stderr,
        )
        return 0  # not fatal: the torch path serves without it
    print(f"pagebus fp8 CPU kernel: {ops.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
