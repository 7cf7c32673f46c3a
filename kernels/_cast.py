"""A Triton helper shared by the kernels: casting fp32 results to the output dtype."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even like torch and the GPU's cvt.rn.

    The interpreter's own fp32 -> bf16 cast truncates, which leaves bf16 results an ulp off the
    torch reference; rounding by hand on the bits is exact on both, for a few integer ops."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = tl.where(x != x, bits | 0x400000, rounded)  # NaN stays a (quiet) NaN
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
