"""`--quantization fp16`: float16 weights beside float32 activations (llama.cpp's F16 files).

Made at load from any float checkpoint (HF directory or GGUF, dequantized first): every linear
layer, the LM head and a tied embedding included, is rounded to float16 (nearest even) and held
at half float32's bytes. A decode step of one or a few sequences reads every weight once from
DRAM, so it runs up to twice as fast; the values it multiplies are the float16 ones, widened
exactly to float32, so only the weights' rounding differs from the float32 model.

On CPUs with F16C or AVX-512 the weights are float16 column tiles that the tile kernel widens in
registers (a few rows of x) or once per tile and row chunk (more rows: the FMA loop stays
float32's); kernels/csrc/cpu_ops.cpp `tiles_kernel`. Elsewhere (other CPUs, GPUs, shapes the tiles
do not take) the float16 matrix is widened for each matmul: the same values, without the speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagebus.workers.layers.linear import Linear, UnquantizedLinearMethod


class Fp16LinearMethod(UnquantizedLinearMethod):
    """Loads as the unquantized method does (float matrices in the default dtype), then rounds."""

    def process_after_loading(self, layer: Linear) -> None:
        from pagebus.kernels.cpu_native import pack_linear

        w = layer.weight.data
        tiles = pack_linear(w, half=True) if w.dtype is torch.float32 else None
        layer.weight.data = tiles if tiles is not None else w.to(torch.float16)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.weight.dim() > 2:
            return super().apply(layer, x)
        return F.linear(x, layer.weight.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))

    def embed(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor:
        if layer.weight.dim() > 2:
            return super().embed(layer, ids)
        return F.embedding(ids, layer.weight).to(torch.get_default_dtype())
