"""Weights from a GGUF file or an HF directory, as (HF parameter name, tensor) pairs.

Tensors stream one at a time into the model's own parameters (each parameter's
`weight_loader` knows how to place a checkpoint tensor, e.g. into a fused QKV matrix),
so peak memory is the model plus one tensor.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch
from pagebus.workers.gguf_file import read_gguf
from pagebus.workers.layers.quant.gguf import GGUFWeight, gguf_weight
from pagebus.workers.model_config import ModelConfig, config_from_gguf, config_from_hf
from torch import nn

# A quantized GGUF matrix comes as its packed blocks (GGUFWeight), everything else as a tensor.
WeightIter = Iterator[tuple[str, "torch.Tensor | GGUFWeight"]]

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def read_config(path: str) -> ModelConfig:
    if is_gguf(path):
        f = read_gguf(path, _model_field)
        return config_from_gguf(f.fields, {t.name for t in f.tensors}, path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: not a .gguf file and no config.json in it")
    return config_from_hf(path)


def _model_field(key: str) -> bool:
    """The vocabulary and merges are the tokenizer's; the model needs only the special ids."""
    return not key.startswith("tokenizer.ggml.") or key in (
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    )


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves in Q/K rows; undo it so the
    weights match HF's rotate_half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def iter_gguf(path: str, cfg: ModelConfig, keep_quantized: bool = False) -> WeightIter:
    """keep_quantized: quantized matrices come as GGUFWeight (their packed blocks, rows in HF
    order), never as a float copy; the layer they load into keeps them packed."""
    import gguf

    for t in read_gguf(path, lambda key: False).tensors:
        m = _GGUF_LAYER_RE.fullmatch(t.name)
        if t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        elif m is not None:
            if m.group(2) not in _GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs: derived from the config instead
            name = f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
        else:
            continue
        rope = cfg.family == "llama" and m is not None and m.group(2) in ("attn_q", "attn_k")
        heads = cfg.num_heads if m is not None and m.group(2) == "attn_q" else cfg.num_kv_heads
        if keep_quantized and t.tensor_type.name not in _FLOAT_TYPES and len(t.shape) == 2:
            q = gguf_weight(t, t.name)
            if rope:  # whole rows of blocks move: the same row permutation as the values'
                q.data = _unpermute_rope(q.data, heads)
            yield name, q
            continue
        # copy: GGUF tensors are read-only mmap views, and mmap reads stall on some VMs
        arr = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True)
        w = torch.from_numpy(arr)
        if rope:
            w = _unpermute_rope(w, heads)
        yield name, w


def iter_safetensors(path: str) -> WeightIter:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    for file in files:
        with safe_open(file, framework="pt") as f:  # lazy: one tensor in memory at a time
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def load_weights(model: nn.Module, weights: WeightIter) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader; fail on anything missing."""
    params = dict(model.named_parameters())
    remap = getattr(model, "checkpoint_name_map", lambda n: (n, None))
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        if "rotary_emb.inv_freq" in ckpt_name:
            continue
        name, shard = remap(ckpt_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            raise KeyError(f"checkpoint tensor {ckpt_name!r} has no parameter in {type(model).__name__}")
        loader: Callable[..., None] = getattr(param, "weight_loader", _default_loader)
        if not isinstance(tensor, torch.Tensor) and not _keeps_packed(loader):
            tensor = tensor.dequantize()  # e.g. an untied embedding: looked up as floats
        loader(param, tensor, shard)
        loaded.add(name)
    tied: set[str] = getattr(model, "tied_parameter_names", set())
    # a quant method may register tensors some checkpoints leave out (GPTQ's g_idx without act-order)
    optional = {n for n, p in params.items() if getattr(p, "optional_in_checkpoint", False)}
    missing = set(params) - loaded - tied - optional
    if missing:
        raise KeyError(f"weights missing from the checkpoint: {sorted(missing)[:8]}")
    finish_loading(model)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held (parameters and buffers; packed ones count as packed), less
    tables derived from the config (the rotary cache)."""
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen or name.endswith("cos_sin_cache"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def _keeps_packed(loader: object) -> bool:
    from pagebus.workers.layers.linear import Linear

    return (
        isinstance(getattr(loader, "__self__", None), Linear)
        and getattr(loader, "__name__", "") == "load_weight"
    )


def finish_loading(model: nn.Module) -> None:
    """Let each layer's quant method repack once all of its shards are in."""
    for m in model.modules():
        done = getattr(m, "process_after_loading", None)
        if done is not None:
            done()


def _default_loader(param: nn.Parameter, w: torch.Tensor, shard: object) -> None:
    if param.shape != w.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(w.shape)}")
    param.data.copy_(w)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """load_format=dummy: fill every parameter in place, on its own device, with small random
    values (norm scales near 1, everything else N(0, 0.02)), so a model of any shape runs from
    its config.json alone. Outputs are meaningless; speed and memory are the real model's."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        g = gens.get(p.device)
        if g is None:
            g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() == 1 and "norm" in name:
            p.data.uniform_(0.9, 1.1, generator=g)
        else:
            p.data.normal_(0.0, 0.02, generator=g)
