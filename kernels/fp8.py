"""FP8 (e4m3) storage shared by the KV cache and the fp8 weights: the dtype, its range, and one
rounding from fp32, in torch and in Triton.

e4m3 (torch.float8_e4m3fn, Triton's fp8e4nv) has 3 mantissa bits, no infinities and a largest
finite value of 448. A tensor is stored as round(x / scale), saturated to +-448, and read back as
stored * scale. Both paths round to nearest even with e4m3's subnormals (steps of 2**-9), like
torch's own cast: the Triton interpreter's fp32 -> fp8 cast does neither (it truncates carries and
flushes small values), so the Triton writer rounds by hand on the bits, a few integer ops that give
the same bytes on a GPU and under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# float16: half a float32 cache's bytes at 10 mantissa bits (llama.cpp's default KV type); the
# compiled CPU ops read it beside float32 activations (kernels/cpu_native.py native_cache_dtypes).
_KV_CACHE_DTYPES = {"float16": torch.float16, "fp8": FP8_DTYPE, "fp8_e4m3": FP8_DTYPE}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the paged cache for --kv-cache-dtype `name` (auto: the model's)."""
    if name == "auto":
        return model_dtype
    if name not in _KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not supported (auto, float16, fp8, fp8_e4m3)")
    return _KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


# Every e4m3 byte's value: widening by table lookup runs 2.4x faster on CPUs than torch's cast,
# which converts one value at a time (98k values: 0.22 vs 0.53 ms, one thread).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def widen(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor's values as float32 (the same values as t.float())."""
    if t.device.type != "cpu":
        return t.float()
    codes = t.contiguous().view(torch.uint8).reshape(-1).int()
    return _E4M3_VALUES.index_select(0, codes).view(t.shape)


def to_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """x / scale as e4m3, saturated (the reference for every fp8 writer). Divides in fp32."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@triton.jit
def fp32_to_e4m3_bits(x):
    """fp32 -> the e4m3fn byte (uint8) of clamp(x, +-448), rounded to nearest even; NaN -> 0x7F."""
    nan = x != x
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    # Normal e4m3 (|x| >= 2**-6, fp32 exponent >= 121): keep 3 of 23 mantissa bits, rounding
    # half to even; a carry moves into the exponent, as it should. Rebias 127 -> 7: 120 << 3.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    # Subnormal e4m3: round(|x| * 2**9) half to even, from the 24-bit significand. A shift past
    # 25 leaves 0; capping it at 31 keeps the shifts defined.
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - exp.to(tl.int32), 31).to(tl.uint32)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    code = tl.where(exp >= 121, normal, tl.where(exp == 0, 0, q))
    code = tl.where(nan, 0x7F, code | sign)
    return code.to(tl.uint8)


def fp8_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (what the Triton writer stores; torch indexes uint8 in place)."""
    return t.view(torch.uint8)


def check_kv_cache_support(dtype: torch.dtype, device: torch.device, backend: str) -> None:
    """Refuse at start-up what would fail at the first step: Triton compiles e4m3 loads and
    conversions only for compute capability 8.9+ (Ada, Hopper and later)."""
    if not is_fp8(dtype) or device.type != "cuda" or backend != "triton":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"--kv-cache-dtype fp8 with the Triton kernels needs a GPU of compute capability 8.9 or "
            f"newer; {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}. Use --kv-cache-dtype auto, "
            "or --attention-backend torch (it dequantizes the cache in torch)"
        )
