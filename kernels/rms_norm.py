"""RMSNorm, optionally fused with the residual add that precedes it.

    x, residual: [num_tokens, hidden]; weight: [hidden]
Without residual: returns norm(x). With residual: r = x + residual, returns (norm(r), r).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pagebus.kernels._cast import cast_rtne


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's RMSNorm: `rms_norm_ref`'s ops in the same order (the same bits), but
    in place on its own temporaries. Freshly allocated [tokens, hidden] buffers cost page
    faults on every large prefill, and each op a dispatch on small decodes. Other dtypes than
    float32 round between ops as the ref does, so they run the ref."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return rms_norm_ref(x, weight, eps, residual)
    if residual is not None:
        if residual.dtype != torch.float32:
            return rms_norm_ref(x, weight, eps, residual)
        x = x + residual
    inv = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    out = torch.mul(x, inv).mul_(weight)
    return out if residual is None else (out, x)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden], read when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden], written when HAS_RESIDUAL
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    # One program per row; the whole row sits in registers (BLOCK >= hidden): read 2-3 rows,
    # write 1-2, one pass over memory.
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < hidden
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + col, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the residual dtype first: the ref normalises the rounded sum.
        x_r = cast_rtne(x, new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + col, x_r, mask=mask)
        x = x_r.to(tl.float32)
        norm_ty = new_residual_ptr.dtype.element_ty
    else:
        norm_ty = x_ptr.dtype.element_ty
    inv = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    # As the ref (and HF): the normalised row is rounded to the input dtype before the weight.
    y = cast_rtne(x * inv, norm_ty).to(tl.float32)
    w = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, cast_rtne(y * w, out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `rms_norm_ref`. Like the ref it leaves its inputs untouched and returns
    new tensors; dtypes follow torch promotion as in the ref."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} for hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
    x2 = x.reshape(-1, hidden)  # [num_tokens, hidden]; a view whenever rows are uniformly strided
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x2.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        new_res = torch.empty(x2.shape, dtype=sum_dtype, device=x.device)
    else:
        r2 = new_res = x2  # unused by the kernel
    weight = weight.contiguous()
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, new_res, hidden, eps,
            x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0),
            BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, triton.next_power_of_2(hidden) // 512)),
        )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (out, new_res.view(x.shape))
