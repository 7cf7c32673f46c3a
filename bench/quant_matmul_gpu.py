"""GPU check and speed of the packed-weight matmuls (kernels/quant_matmul.py) at Llama-3-8B's
linear shapes, against dequantize-then-matmul and against the weight-bandwidth roofline.

    python -m bench.quant_matmul_gpu [--rows 1 64] [--layers 32]

For W4A16 (GPTQ/AWQ layout, group 128), W8A16 (int8 per channel) and bf16 F.linear (cuBLAS), at
each batch size: the max abs error of each layer shape against the torch reference, the median
time of the four matmuls of one decoder layer (fused QKV, O, fused gate/up, down), the weight
bytes they read, the bandwidth that implies, and the output tok/s of `--layers` such layers
(the matmuls alone: attention, norms and the head excluded) beside the roofline (weight bytes
at the measured copy bandwidth). One JSON object on stdout; exit 1 if a check fails. Without
CUDA: {"skipped": "no CUDA device"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_e2e import measure_ceilings
from bench.kernels_gpu import _git_sha, _time_ms

# (name, N, K) of one Llama-3-8B decoder layer, QKV and gate/up fused as the engine holds them.
SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
GROUP = 128


def _weights(kind: str, n: int, k: int, dtype: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=dev).manual_seed(n + k)
    if kind == "w4a16":
        qs = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, device=dev, generator=g)
        d = torch.rand(n, k // GROUP, device=dev, generator=g) * 2e-3
        m = -8 * d
        return qs, d, m
    if kind == "w8a16":
        qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev, generator=g)
        return qs, torch.rand(n, 1, device=dev, generator=g) * 2e-4
    return (torch.randn(n, k, device=dev, generator=g, dtype=torch.float32).mul_(0.02).to(dtype),)


def _fn(kind: str, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> Any:
    from pagebus.kernels.quant_matmul import q4_matmul, q8_matmul

    if kind == "w4a16":
        return lambda: q4_matmul(x, *w)
    if kind == "w8a16":
        return lambda: q8_matmul(x, *w)
    return lambda: F.linear(x, w[0])


def _ref(kind: str, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from pagebus.kernels.quant_matmul import dequantize_q4, dequantize_q8

    dense = dequantize_q4(*w) if kind == "w4a16" else dequantize_q8(*w) if kind == "w8a16" else w[0]
    return (x.float() @ dense.to(x.dtype).float().t()).to(x.dtype)


def run(
    shapes: list[tuple[str, int, int]], rows: list[int], layers: int, dev: torch.device
) -> dict[str, Any]:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ceil = measure_ceilings(dev, tiny=dev.type != "cuda")
    bw = ceil["copy_bandwidth_gb_s"] * 1e9
    results: dict[str, Any] = {}
    ok = True
    for kind in ("w4a16", "w8a16", "bf16"):
        for m in rows:
            ms = 0.0
            nbytes = 0
            err = 0.0
            for _, n, k in shapes:
                w = _weights(kind, n, k, dtype, dev)
                x = torch.randn(m, k, device=dev, dtype=torch.float32).to(dtype)
                fn = _fn(kind, x, w)
                ref = _ref(kind, x, w)
                diff = (fn().float() - ref.float()).abs()
                err = max(err, float(diff.max()))
                # bf16 output: an ulp of the largest outputs, plus the float32 sums' order
                ok = ok and bool((diff <= 1e-2 + 1.6e-2 * ref.float().abs()).all())
                ms += _time_ms(fn, dev)
                nbytes += sum(t.numel() * t.element_size() for t in w)
            results[f"{kind}_rows{m}"] = {
                "layer_ms": ms,
                "weight_bytes_per_layer": nbytes,
                "achieved_gb_s": nbytes / (ms / 1e3) / 1e9,
                "roofline_fraction": (nbytes / bw) / (ms / 1e3),
                "linear_tok_s": m / (layers * ms / 1e3),
                "roofline_tok_s": m / (layers * nbytes / bw),
                "max_abs_err": err,
            }
    return {"ceilings": ceil, "results": results, "all_ok": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--layers", type=int, default=32)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "quant_matmul_gpu", "skipped": "no CUDA device"}))
        return 0
    dev = torch.device("cuda")
    out: dict[str, Any] = {
        "bench": "quant_matmul_gpu",
        "git_sha": _git_sha(),
        "device": torch.cuda.get_device_name(dev),
        "shapes": SHAPES_8B,
        "group_size": GROUP,
    }
    out |= run(SHAPES_8B, a.rows, a.layers, dev)
    print(json.dumps(out))
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
