"""GPTQ and AWQ checkpoints: each layout unpacks to exactly the integers the test packed (from the
published layouts, tests/workers/quant/group_pack.py); the packed layer matches
dequantize-then-matmul on CPU; unsupported settings are refused by name; a tiny Llama written as
GPTQ (act-order) and as AWQ gives the greedy tokens of its dequantized float weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.workers.layers.linear import Linear
from pagebus.workers.layers.quant import cpu_kernels, select
from pagebus.workers.layers.quant.group_quant import (
    GroupQuantConfig,
    GroupQuantLinearMethod,
    UnsupportedQuantConfig,
    dense,
    unpack,
)
from pagebus.workers.runner import ModelRunner

from tests.workers.drive import drive_greedy
from tests.workers.quant.group_pack import (
    awq_tensors,
    dequantize,
    gptq_tensors,
    tiny_llama,
    write_quantized,
)
from tests.workers.quant.packed_reference import packed_matmul

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _g_idx(k: int, group: int, act_order: bool, seed: int = 0) -> torch.Tensor:
    """Each column's group: k // group, or groups over a random column order (act-order)."""
    g = torch.arange(k) // group
    if not act_order:
        return g
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    out = torch.empty_like(g)
    out[perm] = g
    return out


def _known(n: int, k: int, bits: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(1, 1 << bits, (n, groups), generator=gen)  # >= 1: GPTQ stores zero - 1
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).half()
    return q, scales, zeros


@pytest.mark.parametrize(
    ("bits", "group", "act_order"), [(4, 32, False), (4, 64, True), (4, -1, False), (8, 32, True)]
)
def test_gptq_unpacks_known_ints(bits: int, group: int, act_order: bool) -> None:
    n, k = 40, 128
    gs = k if group == -1 else group
    q, scales, zeros = _known(n, k, bits, k // gs, bits + gs)
    g_idx = _g_idx(k, gs, act_order)
    cfg = GroupQuantConfig.from_hf(
        {**GPTQ, "bits": bits, "group_size": group, "desc_act": act_order, "sym": bits == 8}
    )
    u = unpack(cfg, gptq_tensors(q, scales, zeros, g_idx, bits), n, k, "test")
    assert torch.equal(u.q.long(), q) and torch.equal(u.zeros.long(), zeros)
    assert torch.equal(u.scales, scales.float()) and torch.equal(u.g_idx, g_idx)
    assert torch.equal(u.dequantize(), dequantize(q, scales, zeros, g_idx))


def test_gptq_v2_zeros_stored_as_is() -> None:
    q, scales, zeros = _known(8, 64, 4, 2, 3)
    t = gptq_tensors(q, scales, zeros + 1, torch.arange(64) // 32, 4)  # "minus one" of zero + 1
    cfg = GroupQuantConfig.from_hf({**GPTQ, "checkpoint_format": "gptq_v2"})
    assert torch.equal(unpack(cfg, t, 8, 64, "test").zeros.long(), zeros)


@pytest.mark.parametrize("group", [32, -1])
def test_awq_unpacks_known_ints(group: int) -> None:
    n, k = 24, 96
    gs = k if group == -1 else group
    q, scales, zeros = _known(n, k, 4, k // gs, gs)
    u = unpack(
        GroupQuantConfig.from_hf({**AWQ, "group_size": group}), awq_tensors(q, scales, zeros), n, k, "t"
    )
    assert torch.equal(u.q.long(), q) and torch.equal(u.zeros.long(), zeros)
    assert torch.equal(u.scales, scales.float())
    assert torch.equal(u.dequantize(), dequantize(q, scales, zeros, torch.arange(k) // gs))


def _fused_layer(qc: dict, act_order: bool) -> tuple[Linear, torch.Tensor]:
    """A Linear of two shards (like gate/up) loaded from packed known ints; the float W it implies."""
    k, sizes = 128, {0: 48, 1: 32}
    cfg = GroupQuantConfig.from_hf(qc)
    gs = k if cfg.group_size == -1 else cfg.group_size
    g_idx = _g_idx(k, gs, act_order)  # one order for both shards: they share an input
    layer = Linear(k, dict(sizes), quant_method=GroupQuantLinearMethod(cfg))
    ws = []
    for shard, n in sizes.items():
        q, scales, zeros = _known(n, k, cfg.bits, k // gs, 7 + n)
        if cfg.bits == 8:
            zeros = torch.full_like(zeros, 128)
        t = (
            gptq_tensors(q, scales, zeros, g_idx, cfg.bits)
            if cfg.method == "gptq"
            else awq_tensors(q, scales, zeros)
        )
        for name, v in t.items():
            getattr(layer, name).weight_loader(getattr(layer, name), v, shard)
        ws.append(dequantize(q, scales, zeros, g_idx))
    layer.process_after_loading()
    return layer, torch.cat(ws)


# float32 throughout: the kernels compute d q + m (m = -d zero) where the reference computes
# d (q - zero), and sum in another order; 1e-5 relative covers both.
@pytest.mark.parametrize(
    ("qc", "act_order"),
    [(GPTQ, False), ({**GPTQ, "group_size": 64, "desc_act": True}, True), ({**GPTQ, "bits": 8, "sym": True}, False),
     ({**AWQ, "group_size": -1}, False)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_layer_matches_dequantized(qc: dict, act_order: bool, rows: int) -> None:
    layer, w = _fused_layer(qc, act_order)
    method = layer.quant_method
    assert isinstance(method, GroupQuantLinearMethod) and method.packed is not None
    assert method.packed.kind == ("q8" if qc["bits"] == 8 else "q4")
    assert (method.packed.perm is not None) == act_order
    torch.testing.assert_close(dense(method.packed), w, rtol=1e-6, atol=1e-7)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    p = method.packed
    want = packed_matmul(
        x[:, p.perm] if p.perm is not None else x, p.kind, p.tensors
    )  # int8 x at 1 row (VNNI)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    if rows > cpu_kernels.int8_rows():
        torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_tensor_parallel_slices(act_order: bool) -> None:
    """A column-parallel rank keeps its rows, a row-parallel rank its input columns (whole groups;
    an act-order checkpoint's groups are scattered over the columns, so that split is refused)."""
    cfg = GroupQuantConfig.from_hf({**GPTQ, "desc_act": act_order})
    q, scales, zeros = _known(48, 128, 4, 4, 11)
    g_idx = _g_idx(128, 32, act_order)
    w = dequantize(q, scales, zeros, g_idx)
    t = gptq_tensors(q, scales, zeros, g_idx, 4)
    x = torch.randn(3, 128)
    cols = Linear(128, {0: 16}, quant_method=GroupQuantLinearMethod(cfg))
    cols.checkpoint_rows = {0: 32}
    rows = Linear(64, {0: 48}, quant_method=GroupQuantLinearMethod(cfg))
    rows.checkpoint_cols = 64
    for layer in (cols, rows):
        for name, v in t.items():
            getattr(layer, name).weight_loader(getattr(layer, name), v, None)
    cols.process_after_loading()
    torch.testing.assert_close(cols(x), x @ w[32:48].t(), rtol=1e-5, atol=1e-5)
    if act_order:
        with pytest.raises(UnsupportedQuantConfig, match="tensor parallelism"):
            rows.process_after_loading()
        return
    rows.process_after_loading()
    torch.testing.assert_close(rows(x[:, 64:]), x[:, 64:] @ w[:, 64:].t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("qc", "setting"),
    [({**GPTQ, "bits": 3}, "bits 3"), ({**GPTQ, "group_size": 48}, "group_size 48"),
     ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format"), ({**GPTQ, "lm_head": True}, "lm_head"),
     ({**GPTQ, "bits": 8}, "sym false"), ({**AWQ, "version": "gemv"}, "version 'gemv'"),
     ({**AWQ, "zero_point": False}, "zero_point")],
)  # fmt: skip
def test_unsupported_settings_named(qc: dict, setting: str) -> None:
    with pytest.raises(UnsupportedQuantConfig, match=setting):
        GroupQuantConfig.from_hf(qc)


def test_fused_shards_with_different_act_orders_refused() -> None:
    cfg = GroupQuantConfig.from_hf({**GPTQ, "desc_act": True})
    layer = Linear(64, {0: 8, 1: 8}, quant_method=GroupQuantLinearMethod(cfg))
    for shard in (0, 1):
        q, scales, zeros = _known(8, 64, 4, 2, shard)
        for name, v in gptq_tensors(q, scales, zeros, _g_idx(64, 32, True, seed=shard), 4).items():
            getattr(layer, name).weight_loader(getattr(layer, name), v, shard)
    with pytest.raises(UnsupportedQuantConfig, match="different act-order"):
        layer.process_after_loading()


def test_quantization_flag_against_checkpoint() -> None:
    assert select.resolve(None, False, AWQ) == "awq"  # detected from config.json, as vLLM does
    assert select.resolve("gptq", False, GPTQ) == "gptq"
    with pytest.raises(ValueError, match="checkpoint is awq-quantized"):
        select.resolve("gptq", False, AWQ)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        select.resolve(None, False, {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="has none"):
        select.resolve("awq", False, None)


def test_settings_from_autogptq_and_autoawq_files(tmp_path) -> None:
    """Directories without config.json's quantization_config: the quantizers' own files."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert select.checkpoint_quant_config(str(tmp_path)) is None
    (tmp_path / "quant_config.json").write_text(
        json.dumps({"w_bit": 4, "q_group_size": 64, "version": "GEMM"})
    )
    qc = select.checkpoint_quant_config(str(tmp_path))
    assert qc is not None and GroupQuantConfig.from_hf(qc) == GroupQuantConfig("awq", 4, 64, False, False)
    (tmp_path / "quantize_config.json").write_text(
        json.dumps({"bits": 4, "group_size": 128, "desc_act": True})
    )
    qc = select.checkpoint_quant_config(str(tmp_path))
    assert qc is not None and GroupQuantConfig.from_hf(qc) == GroupQuantConfig("gptq", 4, 128, True, True)


PROMPTS = {f"r{i}": ([(13 * i + 7 * j) % 190 + 3 for j in range(3 + 6 * i)], 8) for i in range(3)}


@pytest.fixture(scope="module")
def float_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], str]:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    return tiny_llama(path), path


def _checkpoints(float_weights, method: str, act_order: bool, tmp_path) -> tuple[str, str]:
    sd, base = float_weights
    quant_dir, ref_dir = str(tmp_path / "q"), str(tmp_path / "ref")
    shutil.copytree(base, quant_dir)
    write_quantized(sd, quant_dir, ref_dir, method, group=32, act_order=act_order)
    return quant_dir, ref_dir


@pytest.mark.parametrize(("method", "act_order"), [("gptq", True), ("awq", False)])
def test_tiny_llama_tokens_equal_dequantized(float_weights, method: str, act_order: bool, tmp_path) -> None:
    quant_dir, ref_dir = _checkpoints(float_weights, method, act_order, tmp_path)
    quant = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64), quant_dir)  # detected
    ref = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64), ref_dir)
    qkv = quant.model.model.layers[0].self_attn.qkv_proj
    held = qkv.quant_method
    assert isinstance(held, GroupQuantLinearMethod) and held.cfg.method == method
    # held packed on CPU: 4 bits a weight, float32 d and m per 32 columns, int64 perm (act-order)
    n, k = qkv.out_features, qkv.in_features
    assert held.resident_bytes(qkv) == n * k // 2 + 2 * 4 * n * k // 32 + 8 * k * act_order
    assert drive_greedy(quant, PROMPTS)[0] == drive_greedy(ref, PROMPTS)[0]


def test_tensor_parallel_2_equals_one_rank(float_weights, tmp_path) -> None:
    """TP=2 over gloo: each rank keeps its heads' QKV rows, its gate/up rows and its half of the
    O and down inputs (whole groups), unpacked from the same packed tensors."""
    from tests.distributed.ranks import run_ranks

    quant_dir, _ = _checkpoints(float_weights, "gptq", False, tmp_path)
    single = drive_greedy(ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64), quant_dir), PROMPTS)[0]
    for r in run_ranks(quant_dir, 2, 1, PROMPTS):
        assert r.error is None, r.error
        assert r.tokens == single
