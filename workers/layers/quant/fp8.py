"""`--quantization fp8`: weights held in float8_e4m3fn, one fp32 scale per output row.

Where the weights come from:
- a checkpoint that ships them (config.json `quantization_config` {"quant_method": "fp8",
  "activation_scheme": "dynamic" | "static", "ignored_layers": [...]}, the format vLLM and
  transformers write): each matrix `weight` in e4m3 [out, in] with a per-tensor `weight_scale`
  (per-channel [out] / [out, 1] scales load too) and, with the static scheme, a per-tensor
  `input_scale`. A fused layer's shards keep their own scales (held per row): nothing is
  requantized. Refused by name: block-wise scales (`weight_block_size`), and ignored layers other
  than the LM head.
- any float checkpoint (safetensors, or a GGUF dequantized at load): quantized at load, per
  output row, scale = amax / 448.
The LM head (and so a tied embedding) stays in the model dtype, as in vLLM.

How `x @ W^T` runs:
- CUDA, compute capability 8.9+ (Ada, Hopper), bf16 activations, K and N multiples of 16:
  `torch._scaled_mm` (W8A8): activations quantized per token (dynamic) or with the checkpoint's
  static input scale, row-wise scales on both sides, bf16 out.
- CPUs, float32 activations: fp8_cpu.py's compiled kernel widens the bytes in registers
  (weight-only; e4m3 widens exactly to fp32).
- everywhere else (older GPUs, fp16/fp32 activations on a GPU, a CPU without the kernel): the
  weight dequantized to the activation dtype, then F.linear.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from pagebus.kernels.fp8 import FP8_DTYPE, FP8_MAX, to_fp8
from pagebus.workers.layers.quant import fp8_cpu
from pagebus.workers.layers.quant.base import LinearMethod, LinearMethodFactory
from torch import nn

if TYPE_CHECKING:
    from pagebus.workers.layers.linear import Linear

ACTIVATION_SCHEMES = ("dynamic", "static")
_TINY = torch.finfo(torch.float32).tiny


def _scale(layer: Linear, name: str = "weight_scale") -> torch.Tensor:
    """A tensor this method registered on the layer (nn.Module's attribute typing cannot say so)."""
    return cast(torch.Tensor, getattr(layer, name))


def _register(layer: Linear, name: str, t: torch.Tensor, loader: Callable[..., None]) -> None:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    layer.register_parameter(name, p)


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [out, in], fp32 [out]): each row's largest |w| maps to 448."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    return to_fp8(w, scale[:, None]), scale


class Fp8LinearMethod(LinearMethod):
    """serialized: the checkpoint ships e4m3 weights and their scales (loaded as parameters);
    else float weights are quantized as they load. static: the checkpoint's input scales quantize
    the activations of the scaled-mm path. use_scaled_mm: None decides by device at load; tests
    force it (torch._scaled_mm also runs on CPUs)."""

    def __init__(
        self, serialized: bool = False, static: bool = False, use_scaled_mm: bool | None = None
    ) -> None:
        self.serialized, self.static = serialized, static
        self.use_scaled_mm = use_scaled_mm
        self.x_scale: torch.Tensor | None = None  # static scheme: one scale for the activations

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        layer.weight.weight_loader = layer.load_weight  # type: ignore[attr-defined]
        scale = torch.ones(out_features, dtype=torch.float32)
        if not self.serialized:
            layer.register_buffer("weight_scale", scale)
            return
        # Named as in the checkpoint, so the loader routes `<layer>.weight_scale` here.
        _register(layer, "weight_scale", scale, lambda p, w, shard: self._load_weight_scale(layer, w, shard))
        if self.static:  # one per shard; the activations take their max (vLLM's choice)
            n = len(layer.shard_offsets)
            _register(
                layer,
                "input_scale",
                torch.zeros(n),
                lambda p, w, shard: self._load_input_scale(layer, w, shard),
            )

    def _rows(self, layer: Linear, shard: str | int | None) -> tuple[int, int]:
        return layer.shard_offsets[shard] if shard is not None else (0, layer.out_features)

    def load(self, layer: Linear, w: Any, shard: str | int | None) -> None:
        if not isinstance(w, torch.Tensor):  # a GGUF matrix kept in blocks: its values
            w = w.dequantize()
        start, rows = self._rows(layer, shard)
        if tuple(w.shape) != (rows, layer.in_features):
            raise ValueError(
                f"fp8 linear shard {shard}: expected shape {(rows, layer.in_features)}, checkpoint has {tuple(w.shape)}"
            )
        if self.serialized:
            if w.dtype != FP8_DTYPE:
                raise ValueError(
                    f"an fp8 checkpoint holds a {w.dtype} matrix for a quantized layer (shard {shard}); "
                    "only the LM head may stay unquantized (ignored_layers)"
                )
            layer.weight.data.narrow(0, start, rows).copy_(w)
            return
        q, scale = quantize_rows(w)
        layer.weight.data.narrow(0, start, rows).copy_(q)
        _scale(layer).narrow(0, start, rows).copy_(scale)

    def _load_weight_scale(self, layer: Linear, w: torch.Tensor, shard: str | int | None) -> None:
        """A per-tensor scale fills its shard's rows; a per-channel one is sliced like the rows."""
        start, rows = self._rows(layer, shard)
        dst = _scale(layer).data.narrow(0, start, rows)
        if w.numel() == 1:
            dst.fill_(float(w.reshape(())))
            return
        w = layer.select_checkpoint_part(w.reshape(-1), shard)
        if w.shape != dst.shape:
            raise ValueError(f"fp8 weight_scale of shape {tuple(w.shape)} for {rows} rows (shard {shard})")
        dst.copy_(w)

    def _load_input_scale(self, layer: Linear, w: torch.Tensor, shard: str | int | None) -> None:
        if w.numel() != 1:
            raise ValueError(
                f"fp8 input_scale must be per tensor; the checkpoint's has shape {tuple(w.shape)}"
            )
        i = 0 if shard is None else list(layer.shard_offsets).index(shard)
        _scale(layer, "input_scale").data[i] = float(w.reshape(()))

    def process_after_loading(self, layer: Linear) -> None:
        if self.static:
            self.x_scale = _scale(layer, "input_scale").data.max().reshape(1, 1)
            if float(self.x_scale) <= 0.0:
                raise ValueError("fp8 activation_scheme static: the checkpoint has no positive input_scale")
        if self.use_scaled_mm is None:
            self.use_scaled_mm = (
                scaled_mm_supported(layer.weight.device)
                and layer.in_features % 16 == 0
                and layer.out_features % 16 == 0
            )

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        """W as `dtype` [out, in]: e4m3 values times their row's scale, in fp32."""
        return (layer.weight.float() * _scale(layer)[:, None]).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm and (x.dtype == torch.bfloat16 or x.device.type == "cpu"):
            return self._scaled_mm(layer, x)
        if x.device.type == "cpu":
            shape = x.shape
            y = fp8_cpu.fp8_mm(x.reshape(-1, shape[-1]), layer.weight, _scale(layer))
            if y is not None:
                y = y if layer.bias is None else y + layer.bias
                return y.reshape(*shape[:-1], layer.out_features)
        return F.linear(x, self.dequantized(layer, x.dtype), layer.bias)

    def _scaled_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.x_scale is not None:
            x_scale = self.x_scale.expand(x2.shape[0], 1).contiguous()
        else:  # per token: each row's largest |x| maps to 448
            x_scale = (x2.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
        y = torch._scaled_mm(
            to_fp8(x2, x_scale),
            layer.weight.t(),  # column-major [in, out], as _scaled_mm wants its second operand
            scale_a=x_scale,
            scale_b=_scale(layer)[None, :],
            out_dtype=x.dtype,
        )
        if layer.bias is not None:
            y = y + layer.bias
        return y.reshape(*shape[:-1], layer.out_features)

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        return (layer.weight[ids].float() * _scale(layer)[ids, None]).to(torch.get_default_dtype())


def checkpoint_settings(checkpoint: dict[str, Any] | None) -> tuple[bool, bool]:
    """(serialized, static) from a quantization_config (None: quantize at load); refuses what
    this method does not serve, naming it."""
    if checkpoint is None:
        return False, False
    scheme = checkpoint.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"fp8 checkpoint: activation_scheme {scheme!r} is not supported (dynamic, static)")
    if checkpoint.get("weight_block_size") is not None:
        raise ValueError(
            f"fp8 checkpoint: block-wise scales (weight_block_size {checkpoint['weight_block_size']}) are "
            "not supported; per-tensor and per-channel scales are"
        )
    kv = sorted(k for k in checkpoint if k.startswith("kv_cache"))
    if kv:  # they come with k_scale/v_scale tensors the attention layers have no place for
        raise ValueError(
            f"fp8 checkpoint: KV-cache quantization settings ({kv[0]}) are not supported; "
            "--kv-cache-dtype fp8 computes its own scales"
        )
    ignored = [n for n in checkpoint.get("ignored_layers") or [] if n.split(".")[-1] != "lm_head"]
    if ignored:
        raise ValueError(
            f"fp8 checkpoint: unquantized layers other than the LM head are not supported: {ignored[:4]}"
        )
    return True, scheme == "static"


def fp8_factory(checkpoint: dict[str, Any] | None) -> LinearMethodFactory:
    """Every Linear but the LM head (kept in the model dtype, like vLLM's) gets an Fp8LinearMethod."""
    from pagebus.workers.layers.linear import UnquantizedLinearMethod
    from pagebus.workers.layers.parallel import ParallelLMHead

    serialized, static = checkpoint_settings(checkpoint)

    def make(layer: Linear) -> LinearMethod:
        if isinstance(layer, ParallelLMHead):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(serialized, static)

    return make
