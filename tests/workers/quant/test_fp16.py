"""`--quantization fp16`: float16 weights beside float32 activations, made at load. A layer
multiplies exactly the float32 matmul of its weights rounded to float16 (float16 column tiles where
the build has F16C or AVX-512, else the float16 matrix widened per call); the default model's
greedy tokens follow HF transformers running the same rounded weights in float32."""

from __future__ import annotations

import copy

import pytest
import torch
from pagebus.bus.messages import SamplingParams
from pagebus.kernels import cpu_native
from pagebus.workers.layers.linear import Embedding, Linear
from pagebus.workers.layers.quant.fp16 import Fp16LinearMethod
from pagebus.workers.loader import resident_weight_bytes

from tests.workers.oracle import PROMPTS, first_divergence, hf_greedy
from tests.workers.quant.packed_reference import loaded_two_shard_linear

NEW_TOKENS = 32


def _tiles_built() -> bool:
    return cpu_native.available() is None and cpu_native.native_ops().f16_built()


@pytest.mark.parametrize(
    "tiles", [pytest.param(True, marks=pytest.mark.skipif(not _tiles_built(), reason="no F16C build")), False]
)
@pytest.mark.parametrize("rows", [1, 6, 70])
def test_fp16_linear_matches_rounded_weights(rows: int, tiles: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not tiles:  # the fallback every other machine and device takes
        monkeypatch.setattr(cpu_native, "pack_linear", lambda w, half=False: None)
    layer, w, x = loaded_two_shard_linear(Fp16LinearMethod(), rows)
    assert layer.weight.dtype is torch.float16 and (layer.weight.dim() == 3) is tiles
    assert layer.quant_method.resident_bytes(layer) == 96 * 320 * 2
    wr = w.half().double()
    want = x.double() @ wr.t()
    bound = 1e-5 + 4e-7 * (x.double().abs() @ wr.abs().t())
    got = layer(x)
    assert got.dtype is torch.float32 and bool(((got.double() - want).abs() <= bound).all())
    emb = Embedding(96, 320)
    emb.tie_to(layer)
    rows_got = emb(torch.tensor([3, 80]))
    assert rows_got.dtype is torch.float32 and torch.equal(rows_got, w.half().float()[[3, 80]])


def test_fp16_model_follows_hf_on_rounded_weights(default_model: str, hf_oracle) -> None:
    """The default model (a GGUF, dequantized then rounded) with every matrix, the LM head and
    tied embedding included, held float16: half float32's bytes; greedy tokens as HF's on the
    same rounded weights, up to a near-tie (test_oracle_parity.py's rule)."""
    from pagebus import LLM

    model, tok = hf_oracle
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    llm = LLM(default_model, quantization="fp16", seed=0)
    try:
        runner = llm.engine.runner
        linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert linears and all(m.weight.dtype is torch.float16 for m in linears)
        held = resident_weight_bytes(runner.model)
        floats = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # the tied head once
        assert held < floats * 2 * 1.01, (held, floats)  # 2 bytes a weight (+ the norms' float32)
        prompt_ids = [tok(p).input_ids for p in PROMPTS[:4]]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    finally:
        llm.shutdown()
    diverged = []
    for ids, out in zip(prompt_ids, outs, strict=True):
        ref_tokens, ref_top2 = hf_greedy(rounded, ids, NEW_TOKENS)
        got = out.outputs[0].token_ids
        j = first_divergence(got, ref_tokens)
        if j is None:
            continue
        lp = out.outputs[0].logprobs[j]
        ours_top2 = sorted(lp, key=lambda t: lp[t].rank or 99)[:2]
        assert got[j] in ref_top2[j] and ref_tokens[j] in ours_top2, (ids[:8], j, got[j], ref_tokens[j])
        diverged.append(j)
    assert len(diverged) <= 1, f"{len(diverged)} prompts diverged (at {diverged})"
