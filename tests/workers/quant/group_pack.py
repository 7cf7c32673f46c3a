"""GPTQ and AWQ checkpoints written by the tests from their published layouts (independently of
workers/layers/quant/group_quant.py): packers for known integers, a round-to-nearest group
quantizer, and a tiny Llama saved both quantized and as its dequantized float weights."""

from __future__ import annotations

import json
import os

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column ORDER[i]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 a checkpoint stores."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_along_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: [R, C] values -> int32 [R / p, C]; row p*i + j in bits bits*j.."""
    per = 32 // bits
    v = v.long().view(-1, per, v.shape[1])
    return _int32(sum(v[:, j] << (bits * j) for j in range(per)))  # type: ignore[arg-type]


def pack_along_cols(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C / p]; column p*c + order[j] in bits bits*j.. (GPTQ qzeros: order
    0..p-1; AWQ qweight/qzeros: AWQ_PACK_ORDER)."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = v.long().view(v.shape[0], -1, per)
    return _int32(sum(v[..., order[j]] << (bits * j) for j in range(per)))  # type: ignore[arg-type]


def quantize_rtn(
    w: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K], columns grouped by g_idx -> ints q [N, K], scales fp16 [N, G], zeros [N, G]."""
    groups, maxq = int(g_idx.max()) + 1, (1 << bits) - 1
    q = torch.empty(w.shape, dtype=torch.long)
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.long)
    for g in range(groups):
        cols = (g_idx == g).nonzero().squeeze(1)
        wg = w[:, cols]
        if sym:
            hi = wg.abs().amax(1)
            s, z = 2 * hi / maxq, torch.full((w.shape[0],), (maxq + 1) // 2)
        else:
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = (hi - lo) / maxq
            z = torch.round(-lo / s).long().clamp(1, maxq)  # >= 1: GPTQ stores zero - 1
        s = s.half().float()
        scales[:, g], zeros[:, g] = s, z
        q[:, cols] = torch.clamp(torch.round(wg / s[:, None]).long() + z[:, None], 0, maxq)
    return q, scales.half(), zeros


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    return scales.float()[:, g_idx] * (q - zeros[:, g_idx]).float()


def gptq_tensors(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> dict[str, torch.Tensor]:
    """q [N, K] etc. in GPTQ's checkpoint layout (classic format: zeros stored minus one)."""
    mask = (1 << bits) - 1
    return {
        "qweight": pack_along_rows(q.t(), bits),
        "qzeros": pack_along_cols((zeros.t() - 1) & mask, bits),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_along_cols(q.t().contiguous(), 4, AWQ_PACK_ORDER),
        "qzeros": pack_along_cols(zeros.t().contiguous(), 4, AWQ_PACK_ORDER),
        "scales": scales.t().contiguous(),
    }


_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(path: str) -> dict[str, torch.Tensor]:
    """A random 2-layer Llama's float weights (wide, so greedy tokens are far from ties) and its
    config.json in path. Every input width splits in two whole groups of 32 (tensor parallelism)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    os.makedirs(path, exist_ok=True)
    (cfg_dict := cfg.to_dict()).pop("quantization_config", None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def write_quantized(
    float_sd: dict[str, torch.Tensor], quant_dir: str, ref_dir: str, method: str, group: int, act_order: bool
) -> None:
    """float_sd's projections quantized (GPTQ 4-bit symmetric, or AWQ 4-bit asymmetric) into
    quant_dir, and the same weights dequantized into a float checkpoint in ref_dir (both next to
    a copy of quant_dir's config.json, which gets the quantization_config)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(1)
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    perms: dict[str, torch.Tensor] = {}
    shares = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    for name, w in float_sd.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj not in _PROJ:
            ref[name] = quant[name] = w
            continue
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        if act_order:  # one order per input (q/k/v share theirs, gate/up theirs), as GPTQ's Hessian gives
            key = name.split(".mlp")[0].split(".self_attn")[0] + shares.get(proj, proj)
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty_like(g_idx)
            g_idx[perm] = torch.arange(k) // group
        q, scales, zeros = quantize_rtn(w, g_idx, 4, sym=method == "gptq")
        prefix = name[: -len(".weight")]
        packed = (
            gptq_tensors(q, scales, zeros, g_idx, 4) if method == "gptq" else awq_tensors(q, scales, zeros)
        )
        quant.update({f"{prefix}.{t}": v for t, v in packed.items()})
        ref[name] = dequantize(q, scales, zeros, g_idx)
    os.makedirs(ref_dir, exist_ok=True)
    with open(os.path.join(quant_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": True}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": qc}, f)
    save_file(quant, os.path.join(quant_dir, "model.safetensors"))
    save_file(ref, os.path.join(ref_dir, "model.safetensors"))
