"""The loader hands K-quant and Q5_0 matrices from a GGUF file over as their blocks: unpacked,
they equal the loader's own dequantization of the same tensors, rope row order included (whole
rows of 256-wide super-blocks move when attn_q/attn_k are un-permuted)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from pagebus.workers.layers.quant.gguf import GGUFWeight, _dense, _split
from pagebus.workers.loader import iter_gguf
from pagebus.workers.model_config import ModelConfig

from tests.workers.quant.test_gguf_linear import _random_blocks

_TENSORS = {  # GGUF name: (type, rows, cols)
    "blk.0.attn_q.weight": ("Q4_K", 16, 256),
    "blk.0.attn_k.weight": ("Q6_K", 8, 256),
    "blk.0.ffn_down.weight": ("Q6_K", 8, 512),
    "blk.0.ffn_up.weight": ("Q5_0", 16, 256),
}


def _write(path: Path) -> None:
    rng = np.random.default_rng(30)
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, rows, cols) in _TENSORS.items():
        t = gguf.GGMLQuantizationType[qtype]
        if qtype == "Q5_0":
            blocks = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)
        else:
            blocks = _random_blocks(rows, cols, qtype, rng)
        w.add_tensor(name, blocks, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_blocks_from_file_match_the_loaders_dequantization(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write(path)
    cfg = ModelConfig("llama", 32, 256, 512, 1, 2, 1, 128, 1e-5, 1e4, 64, False)
    packed = dict(iter_gguf(str(path), cfg, keep_quantized=True))
    dense = dict(iter_gguf(str(path), cfg))
    assert sorted(packed) == sorted(dense) and len(packed) == len(_TENSORS)
    for name, w in packed.items():
        assert isinstance(w, GGUFWeight), name
        ref = dense[name]
        assert isinstance(ref, torch.Tensor)
        assert torch.equal(_dense(_split(w)), ref), name
