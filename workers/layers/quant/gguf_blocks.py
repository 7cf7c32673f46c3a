"""GGUF quantized blocks unpacked into the arrays the CPU kernels read (cpu_kernels.py), with
no float copy of the matrix: integer quants stay integers, and each group of 32 (or 16)
weights gets its float32 scale (and offset) folded from the block's own scales.

- Q4_0, Q4_1, Q4_K -> "q4" (qs uint8 [N, G, 16], d and m float32 [N, G], w = d * q + m; Q4_0
  holds no m: w = d * (q - 8), 20 bytes a group of 32 instead of 24).
  Q4_K's 256-wide super-block holds 8 groups of 32 with 6-bit scale and min indices:
  d = d_super * sc and m = -(dmin_super * mn), which are exactly the products the gguf
  package's dequantizer forms, so every weight comes out bit-identical.
- Q8_0, Q5_0, Q6_K -> "q8" (qs int8 [N, K], d float32 [N, K / gs], w = d * q): Q5_0's
  5-bit quants minus 16 and Q6_K's 6-bit quants minus 32 fit int8; Q6_K has one int8 scale
  per 16 weights, so its gs is 16 (d = d_super * scale).

Held sizes, bits per weight (file / memory): Q4_0 4.5/5, Q4_1 5/6, Q4_K 4.5/6, Q5_0 5.5/9,
Q8_0 8.5/9, Q6_K 6.6/10: the float32 scales cost more than the file's fp16 ones.
"""

from __future__ import annotations

import numpy as np
import torch

# (weights per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}

# The unpacking runs in numpy: torch's uint8 copies of these strided block fields took 10-30x
# longer here (threaded elementwise kernels waiting on a busy second core).


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (the fp16 scales of a block)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _shifts(*s: int) -> np.ndarray:
    return np.array(s, dtype=np.uint8)


def _nibble_groups(v: np.ndarray) -> np.ndarray:
    """[..., 32] 4-bit values -> [..., 16] bytes in the q4 layout (low nibbles: the first 16)."""
    return v[..., :16] | (v[..., 16:] << 4)


def unpack(qtype: str, data: torch.Tensor, cols: int) -> tuple[str, list[torch.Tensor]]:
    """`data`: uint8 [rows, bytes per row] of `qtype` blocks. Returns (kind, kernel arrays)."""
    rows = data.shape[0]
    per_block, nbytes = BLOCKS[qtype]
    b = np.ascontiguousarray(data.numpy()).reshape(rows, cols // per_block, nbytes)
    kind, arrays = _unpack(qtype, b, rows, cols)
    return kind, [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def _unpack(qtype: str, b: np.ndarray, rows: int, cols: int) -> tuple[str, list[np.ndarray]]:
    if qtype == "Q8_0":
        return "q8", [b[..., 2:].view(np.int8).reshape(rows, cols), _f16(b[..., 0:2])]
    if qtype == "Q4_0":
        return "q4", [b[..., 2:], _f16(b[..., 0:2])]  # symmetric: no m (the kernels take -8 d)
    if qtype == "Q4_1":
        return "q4", [b[..., 4:], _f16(b[..., 0:2]), _f16(b[..., 2:4])]
    if qtype == "Q5_0":
        # bit j of the little-endian uint32 qh is the 5th bit of weight j
        high = ((b[..., 2:6, None] >> _shifts(*range(8))) & 1).reshape(rows, -1, 32)
        low = np.concatenate([b[..., 6:] & 15, b[..., 6:] >> 4], axis=-1)
        q = (low | (high << 4)).view(np.int8) - np.int8(16)
        return "q8", [q.reshape(rows, cols), _f16(b[..., 0:2])]
    if qtype == "Q4_K":
        return "q4", _q4_k(b, rows, cols)
    return "q8", _q6_k(b, rows, cols)


def _q4_k(b: np.ndarray, rows: int, cols: int) -> list[np.ndarray]:
    """Bytes: d (fp16), dmin (fp16), 12 bytes of 6-bit scales and mins for 8 groups, 128 of quants
    (group 2i: low nibbles of bytes 32i..32i+31, group 2i+1: their high nibbles)."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16]
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=-1).astype(np.float32)
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)
    q = _nibble_groups((qs & 15).reshape(rows, -1, 32))
    g = cols // 32
    return [q, (d[..., None] * sc).reshape(rows, g), (-(dmin[..., None] * mn)).reshape(rows, g)]


def _q6_k(b: np.ndarray, rows: int, cols: int) -> list[np.ndarray]:
    """Bytes: 128 of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), d (fp16).
    Each half of 128 weights: 64 low nibbles then 64 high nibbles of its 64 ql bytes; 32-weight
    run i of the half takes bits 2i..2i+1 of its 32 qh bytes."""
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64) >> _shifts(0, 4).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 1, 4, 1)
    q = ((ql & 15).reshape(rows, -1, 32) | ((qh & 3).reshape(rows, -1, 32) << 4)).view(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])[..., None] * scales
    return [q.reshape(rows, cols), d.reshape(rows, cols // 16)]
