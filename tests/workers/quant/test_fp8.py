"""--quantization fp8: e4m3 weights with per-row scales, quantized at load from float weights or
loaded as an fp8 checkpoint ships them (vLLM/transformers' "fp8" quantization_config)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.kernels.fp8 import FP8_DTYPE, to_fp8
from pagebus.workers.layers.linear import Embedding, Linear
from pagebus.workers.layers.quant import fp8_cpu, select
from pagebus.workers.layers.quant.fp8 import Fp8LinearMethod, checkpoint_settings, quantize_rows
from pagebus.workers.loader import resident_weight_bytes
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy
from tests.workers.oracle import prefill_logits
from tests.workers.quant.group_pack import tiny_llama

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[(7 * i + 13 * j) % 197 + 2 for j in range(6 + 5 * i)] for i in range(6)]
# Quantized at load, the tiny random model (weights N(0, 0.2)) against itself unquantized over the
# 6 prompts' 111 positions: top-1 agreement 0.865, mean KL 2.2e-2 nats (--quantization int8 on the
# same model: 0.928, 1.5e-3). e4m3 keeps 3 mantissa bits, a 3.6% RMS relative error per weight,
# about 4x int8's per-channel grid on Gaussian rows, hence ~16x the KL. The bounds leave room for
# BLAS's summation order and fail on a wrong scale or row (top-1 near 1/200, KL of nats).
MIN_TOP1 = 0.8
MAX_MEAN_KL = 0.05


def _layer(method: Fp8LinearMethod, w: torch.Tensor) -> Linear:
    layer = Linear(w.shape[1], {"a": 64, "b": w.shape[0] - 64}, quant_method=method)
    layer.load_weight(layer.weight, w[:64], "a")
    layer.load_weight(layer.weight, w[64:], "b")
    layer.process_after_loading()
    return layer


@pytest.mark.parametrize("rows", [1, 7, 9, 40])  # the CPU kernel: 8-row chunks; above 32, one BLAS call
def test_made_at_load_matches_dequantized(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 320, generator=g), torch.randn(rows, 320, generator=g)
    w[5] *= 1e-3  # a row of small weights: its own scale keeps their precision
    method = Fp8LinearMethod()
    layer = _layer(method, w)
    assert layer.weight.dtype == FP8_DTYPE
    assert resident_weight_bytes(layer) == 96 * 320 + 96 * 4  # a byte a weight, a float a row
    deq = method.dequantized(layer, torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    # e4m3 rounds a normal value by at most 2**-4 of itself, a subnormal one by half of 2**-9 * scale
    assert bool(((deq - w).abs() <= 2**-4 * w.abs() + 2**-10 * scale).all())
    torch.testing.assert_close(layer(x), x @ deq.t(), rtol=1e-5, atol=1e-5)
    emb = Embedding(96, 320)
    emb.tie_to(layer)
    assert torch.equal(emb(torch.tensor([3, 80])), deq[[3, 80]])


def test_cpu_kernel_is_used_and_falls_back() -> None:
    """K a multiple of 16: the compiled kernel (subnormal e4m3 weights included); K = 40: torch."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 320, generator=g)
    w[:, :8] *= 1e-4  # far below each row's amax: e4m3 subnormals
    q, scale = quantize_rows(w)
    deq = q.float() * scale[:, None]
    x = torch.randn(3, 320, generator=g)
    y = fp8_cpu.fp8_mm(x, q, scale)
    assert y is not None  # built (make test's machines have g++ and ninja)
    torch.testing.assert_close(y, x @ deq.t(), rtol=1e-5, atol=1e-5)
    assert fp8_cpu.fp8_mm(x[:, :40], q[:, :40].contiguous(), scale) is None
    layer = _layer(Fp8LinearMethod(), w[:, :40])
    torch.testing.assert_close(
        layer(x[:, :40]), x[:, :40] @ layer.quant_method.dequantized(layer, torch.float32).t()
    )


def test_scaled_mm_path_quantizes_activations_per_token() -> None:
    """The CUDA path's math (torch._scaled_mm runs on CPUs too): x's rows in e4m3 at one scale each."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 128, generator=g), torch.randn(5, 128, generator=g)
    x[2] *= 100.0  # per-token scales: one large row does not flatten the others
    layer = _layer(Fp8LinearMethod(use_scaled_mm=True), w)
    deq = layer.quant_method.dequantized(layer, torch.float32)  # type: ignore[attr-defined]
    x_scale = x.abs().amax(dim=1, keepdim=True) / 448
    want = (to_fp8(x, x_scale).float() * x_scale) @ deq.t()
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)  # fp32 sums in another order
    exact = x @ deq.t()
    assert float((layer(x) - exact).norm() / exact.norm()) < 0.05  # e4m3 activations: ~2-3%


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("tiny_float"))
    weights = tiny_llama(path)
    save_file(weights, os.path.join(path, "model.safetensors"))
    return weights, path


def _runner(path: str, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64, quantization=quantization), path)


def test_made_at_load_top1_and_kl_against_unquantized(tiny) -> None:
    _, path = tiny
    ref, fp8 = _runner(path, "none"), _runner(path, "fp8")
    agree = total = 0
    kls: list[torch.Tensor] = []
    for ids in PROMPTS:
        a = torch.log_softmax(prefill_logits(ref, ids).double(), dim=-1)
        b = torch.log_softmax(prefill_logits(fp8, ids).double(), dim=-1)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        kls.append((a.exp() * (a - b)).sum(-1))
    top1, mean_kl = agree / total, float(torch.cat(kls).mean())
    print(
        f"fp8 (made at load) vs unquantized over {total} positions: top-1 {top1:.3f}, mean KL {mean_kl:.2e}"
    )
    assert top1 >= MIN_TOP1 and mean_kl <= MAX_MEAN_KL, (top1, mean_kl)
    head = dict(fp8.model.named_modules())["lm_head"]
    assert head.weight.dtype == torch.float32  # the head stays in the model dtype


def _write_fp8_checkpoint(
    weights: dict[str, torch.Tensor], src: str, quant_dir: str, ref_dir: str, scheme: str
) -> dict[str, torch.Tensor]:
    """Projections as e4m3 with a per-tensor weight_scale (down_proj per channel, [out]), plus an
    input_scale each for the static scheme; ref_dir gets the same weights dequantized."""
    from safetensors.torch import save_file

    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj not in _PROJ:
            quant[name] = ref[name] = w
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if proj == "down_proj" else w.abs().amax()
        scale = (amax / 448).float()
        q = to_fp8(w, scale)
        prefix = name[: -len(".weight")]
        quant[name], quant[f"{prefix}.weight_scale"] = q, scale.reshape(-1 if proj == "down_proj" else ())
        if scheme == "static":
            quant[f"{prefix}.input_scale"] = torch.tensor(0.01 + 0.001 * len(quant))
        ref[name] = q.float() * scale
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    qc = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]}
    for d, sd, extra in ((quant_dir, quant, {"quantization_config": qc}), (ref_dir, ref, {})):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**cfg, **extra}, f)
        save_file(sd, os.path.join(d, "model.safetensors"))
    return quant


def _dequantized(quant: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    w, s = quant[f"{prefix}.weight"].float(), quant[f"{prefix}.weight_scale"]
    return w * (s[:, None] if s.dim() else s)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_fp8_checkpoint_loads_its_dequantized_floats_exactly(tiny, scheme: str, tmp_path) -> None:
    weights, src = tiny
    quant_dir, ref_dir = str(tmp_path / "fp8"), str(tmp_path / "ref")
    quant = _write_fp8_checkpoint(weights, src, quant_dir, ref_dir, scheme)
    fp8, ref = _runner(quant_dir), _runner(ref_dir)  # fp8 detected from config.json
    mods = dict(fp8.model.named_modules())
    for i in range(2):
        p = f"model.layers.{i}"
        held = {  # our layer: the checkpoint matrices stacked in it
            f"{p}.self_attn.qkv_proj": [f"{p}.self_attn.{n}_proj" for n in "qkv"],
            f"{p}.self_attn.o_proj": [f"{p}.self_attn.o_proj"],
            f"{p}.mlp.gate_up_proj": [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"],
            f"{p}.mlp.down_proj": [f"{p}.mlp.down_proj"],
        }
        for ours, theirs in held.items():
            layer = mods[ours]
            want = torch.cat([_dequantized(quant, t) for t in theirs])
            assert torch.equal(layer.quant_method.dequantized(layer, torch.float32), want)
    if scheme == "static":  # a fused layer's activations take its shards' largest input scale
        qkv = mods["model.layers.0.self_attn.qkv_proj"].quant_method
        given = [float(quant[f"model.layers.0.self_attn.{n}_proj.input_scale"]) for n in "qkv"]
        assert float(qkv.x_scale) == pytest.approx(max(given))
    for ids in PROMPTS[:3]:
        torch.testing.assert_close(prefill_logits(fp8, ids), prefill_logits(ref, ids), rtol=1e-5, atol=1e-5)
    prompts = {f"p{i}": (ids, 6) for i, ids in enumerate(PROMPTS)}
    assert drive_greedy(fp8, prompts)[0] == drive_greedy(ref, prompts)[0]


@pytest.mark.parametrize(
    ("qc", "named"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "per_token"}, "activation_scheme 'per_token'"),
        ({"quant_method": "fp8", "ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]}, "down_proj"),
        ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_checkpoints_named(qc: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        checkpoint_settings(qc)


def test_flag_and_checkpoint_resolution() -> None:
    assert select.resolve("fp8", is_gguf=True) == "fp8"  # any float checkpoint, a GGUF's too
    assert select.resolve(None, is_gguf=False, checkpoint={"quant_method": "fp8"}) == "fp8"
    with pytest.raises(ValueError, match="checkpoint is gptq-quantized"):
        select.resolve("fp8", is_gguf=False, checkpoint={"quant_method": "gptq"})
    with pytest.raises(ValueError, match="checkpoint is fp8-quantized"):
        select.resolve("int8", is_gguf=False, checkpoint={"quant_method": "fp8"})


def test_float_matrix_in_an_fp8_checkpoint_refused() -> None:
    with pytest.raises(ValueError, match="only the LM head may stay unquantized"):
        _layer(Fp8LinearMethod(serialized=True), torch.randn(96, 64))


@pytest.mark.parametrize("per_channel", [False, True])
def test_tensor_parallel_slices(per_channel: bool) -> None:
    """A column-parallel rank keeps its rows (and their per-channel scales), a row-parallel rank
    its input columns under the one per-tensor or per-row scale."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 128, generator=g)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(48)
    scale = amax / 448
    q = to_fp8(w, scale[:, None])
    deq = q.float() * scale[:, None]
    ckpt_scale = scale.clone() if per_channel else scale[:1].reshape(())
    x = torch.randn(3, 128, generator=g)
    cols = Linear(128, {0: 16}, quant_method=Fp8LinearMethod(serialized=True))
    cols.checkpoint_rows = {0: 32}
    rows = Linear(64, {0: 48}, quant_method=Fp8LinearMethod(serialized=True))
    rows.checkpoint_cols = 64
    for layer in (cols, rows):
        layer.load_weight(layer.weight, q, 0)
        layer.weight_scale.weight_loader(layer.weight_scale, ckpt_scale, 0)
        layer.process_after_loading()
    torch.testing.assert_close(cols(x), x @ deq[32:48].t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows(x[:, 64:]), x[:, 64:] @ deq[:, 64:].t(), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_2_equals_one_rank(tiny, tmp_path) -> None:
    """TP=2 over gloo on a written fp8 checkpoint gives the single rank's greedy tokens."""
    from tests.distributed.ranks import run_ranks

    weights, src = tiny
    quant_dir = str(tmp_path / "fp8")
    _write_fp8_checkpoint(weights, src, quant_dir, str(tmp_path / "ref"), "dynamic")
    prompts = {f"p{i}": (ids, 5) for i, ids in enumerate(PROMPTS[:3])}
    single = drive_greedy(_runner(quant_dir), prompts)[0]
    for r in run_ranks(quant_dir, 2, 1, prompts):
        assert r.error is None, r.error
        assert r.tokens == single
