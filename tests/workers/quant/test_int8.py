"""`--quantization int8`: weight-only int8 with one scale per output channel, made at load from a
float checkpoint (an HF directory here). The layer matches dequantize-then-matmul; the model's
next-token distributions stay close to the unquantized model's on the oracle prompts."""

from __future__ import annotations

import json

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.workers.layers.linear import Embedding
from pagebus.workers.layers.quant.gguf import Int8LinearMethod, _dense
from pagebus.workers.runner import ModelRunner

from tests.workers.oracle import PROMPTS, prefill_logits
from tests.workers.quant.packed_reference import loaded_two_shard_linear, packed_matmul

# Measured on the default model's weights (SmolLM2-135M), all 8 prompts (73 positions): top-1
# agreement 0.986, mean KL 7.0e-3 nats. The test runs the first 4 (its time budget).
MIN_TOP1 = 0.95
MAX_MEAN_KL = 0.02


@pytest.mark.parametrize("rows", [1, 6, 70])
def test_int8_linear_matches_dequantized(rows: int) -> None:
    layer, w, x = loaded_two_shard_linear(Int8LinearMethod(), rows)
    method = layer.quant_method
    assert isinstance(method, Int8LinearMethod)
    (part,) = method.parts
    deq = _dense(part)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    assert bool(((deq - w).abs() <= scale / 2 + 1e-6).all())  # round to nearest, per row
    want = packed_matmul(x, part.kind, part.tensors)  # 1 row: x as int8 on VNNI machines
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    emb = Embedding(96, 320)
    emb.tie_to(layer)
    assert torch.equal(emb(torch.tensor([3, 80])), deq[[3, 80]])


@pytest.fixture(scope="module")
def hf_dir(hf_oracle, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default model's weights as an HF safetensors directory (fp32). Written by hand:
    transformers will not save a model it loaded from a GGUF."""
    from safetensors.torch import save_file

    model, _ = hf_oracle
    path = tmp_path_factory.mktemp("hf_fp32")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_int8_top1_and_kl_against_unquantized(hf_dir: str, hf_oracle) -> None:
    _, tok = hf_oracle
    runners = {
        q: ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=64, quantization=q), hf_dir)
        for q in ("none", "int8")
    }
    agree = total = 0
    kls: list[torch.Tensor] = []
    for p in PROMPTS[:4]:
        ids = tok(p).input_ids
        ref = torch.log_softmax(prefill_logits(runners["none"], ids).double(), dim=-1)
        q8 = torch.log_softmax(prefill_logits(runners["int8"], ids).double(), dim=-1)
        agree += int((ref.argmax(-1) == q8.argmax(-1)).sum())
        total += len(ids)
        kls.append((ref.exp() * (ref - q8)).sum(-1))
    top1, mean_kl = agree / total, float(torch.cat(kls).mean())
    print(f"int8 vs unquantized over {total} positions: top-1 agreement {top1:.3f}, mean KL {mean_kl:.2e}")
    assert top1 >= MIN_TOP1 and mean_kl <= MAX_MEAN_KL, (top1, mean_kl)
