"""Dequantize-in-the-loop matmuls for packed weights (W4A16, W8A16): y = x @ W^T.

Layouts (those of workers/layers/quant/cpu_kernels.py, group scales allowed coarser than 32):
- q4: qs uint8 [N, K / 32, 16]: in block c, byte j holds column 32c + j in its low nibble and
  32c + 16 + j in its high one; d, m float32 [N, K / gs]: w = d * q + m (GGUF Q4_1 with gs 32;
  GPTQ/AWQ with m = -d * zero and gs their group size, K for one group per row). Without m
  (GGUF Q4_0): symmetric, m = -8 d.
- q8: qs int8 [N, K], d float32 [N, K / gs]: w = d * q (int8 per-channel: gs = K).
K is a multiple of 32 and gs a multiple of 32 (each step of the K loop reads one 32-wide block,
inside one group: one d and m per output column) or a divisor of it (GGUF Q6_K's 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_K = 32


def dequantize_q4(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K] from the q4 layout (m None: symmetric, m = -8 d): the kernels' reference,
    and the fallback where they cannot run."""
    n = qs.shape[0]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float().reshape(n, -1)
    gs = q.shape[1] // d.shape[1]
    if m is None:
        return (q - 8) * d.float().repeat_interleave(gs, dim=1)
    return q * d.float().repeat_interleave(gs, dim=1) + m.float().repeat_interleave(gs, dim=1)


def dequantize_q8(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from the q8 layout."""
    n = qs.shape[0]
    return (qs.float().view(n, d.shape[1], -1) * d.float()[..., None]).view(n, -1)


@triton.jit
def _packed_mm_kernel(
    x_ptr,  # [M, K], rows stride_x apart
    qs_ptr,  # q4: uint8 [N, K / 2]; q8: int8 [N, K]
    d_ptr,  # float32 [N, K / GS]
    m_ptr,  # float32 [N, K / GS] (q4 only)
    y_ptr,  # [M, N], rows stride_y apart
    M,
    N,
    K,
    stride_x,
    stride_y,
    GS: tl.constexpr,
    Q4: tl.constexpr,
    IEEE: tl.constexpr,  # float32 x: full-precision dot (no TF32)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): a [BLOCK_M, BLOCK_N] tile of y over all of K.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    m_ok, n_ok = rm < M, rn < N
    rn64 = rn.to(tl.int64)
    groups = K // GS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(
            x_ptr + rm.to(tl.int64)[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0
        )
        if GS >= 32:  # one group in this block: one scale per output column
            dm_off = (rn64 * groups + k0 // GS)[None, :]
        else:  # GGUF Q6_K: groups of 16, a scale per (column, k)
            dm_off = rn64[None, :] * groups + ((k0 + rk) // GS)[:, None]
        d = tl.load(d_ptr + dm_off, mask=n_ok[None, :], other=0.0)
        if Q4:
            # column k0 + j is byte j % 16 of the block, low nibble for j < 16
            b = tl.load(
                qs_ptr + rn64[None, :] * (K // 2) + (k0 // 2 + rk % 16)[:, None], mask=n_ok[None, :], other=0
            )
            q = ((b.to(tl.int32) >> ((rk // 16) * 4)[:, None]) & 15).to(tl.float32)
            w = q * d + tl.load(m_ptr + dm_off, mask=n_ok[None, :], other=0.0)  # [32, BLOCK_N]
        else:
            q = tl.load(qs_ptr + rn64[None, :] * K + (k0 + rk)[:, None], mask=n_ok[None, :], other=0)
            w = q.to(tl.float32) * d
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_y + rn[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def _launch(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, k: int
) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    n = qs.shape[0]
    if not (qs.is_contiguous() and d.is_contiguous() and (m is None or m.is_contiguous())):
        raise ValueError("qs, d and m must be contiguous")
    gs = k // d.shape[1] if d.shape[1] else 0
    if k % _BLOCK_K or gs == 0 or gs * d.shape[1] != k or (gs % _BLOCK_K and _BLOCK_K % gs):
        raise ValueError(
            f"K {k} must be a multiple of {_BLOCK_K}, and its group size a multiple or divisor of it "
            f"(scales {tuple(d.shape)})"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block_m = 16 if x.shape[0] <= 16 else 64
    block_n = 32 if x.shape[0] <= 16 else 64  # decode: more programs over N (one pass over K each)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _packed_mm_kernel[grid](
        x, qs, d, m if m is not None else d, y, x.shape[0], n, k, x.stride(0), y.stride(0),
        GS=gs, Q4=m is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return y


def q4_matmul(
    x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None
) -> torch.Tensor:
    """W4A16: x [M, K] @ W^T, W in the q4 layout; the output in x's dtype, accumulated in float32."""
    return _launch(x, qs, d, -8 * d if m is None else m, qs.shape[1] * 32)


def q8_matmul(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """W8A16: x [M, K] @ W^T, W int8 [N, K] with d [N, K / gs]."""
    return _launch(x, qs, d, None, qs.shape[1])
