"""SiLU-and-mul, the gated MLP activation: x [num_tokens, 2 * d] -> silu(x[:, :d]) * x[:, d:]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from pagebus.kernels._cast import cast_rtne


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_ref` with the product written into silu's output: one [tokens, d] buffer
    fewer per layer, the same two roundings."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    out_ptr,  # [num_tokens, d]
    d,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    # Grid (num_tokens, cdiv(d, BLOCK)): read 2*BLOCK elements, write BLOCK.
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < d
    gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + col, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the two torch ops of the ref do.
    act = cast_rtne(gate / (1.0 + tl.exp(-gate)), x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, cast_rtne(act * up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_and_mul_ref`: [..., 2 * d] -> [..., d]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not even")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # [num_tokens, 2 * d]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(d, 1)))
    if out.numel():
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, d, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], d)
