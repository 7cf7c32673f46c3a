"""HF transformers peer: `generate` with static batching, in options.dtype (default bfloat16). Run with the hf peer's python.

    echo JOB | python bench/peer_runners/hf_runner.py      (job format: _harness.py)

model: an HF directory (setup_peers.sh writes one from the default GGUF). Offline submits every
prompt as one left-padded batch, which is how `generate` batches; single stream is batch 1.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from _harness import Generate, run_driver
from transformers import AutoModelForCausalLM


def load(job: dict[str, Any]) -> Generate:
    torch.manual_seed(0)
    torch.set_num_threads(int(job.get("options", {}).get("threads", torch.get_num_threads())))
    dtype = getattr(torch, job.get("options", {}).get("dtype", "bfloat16"))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval()
    # safetensors may leave weights mmapped, and mmap reads stall on this VM: own them in RAM.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    @torch.inference_mode()
    def generate(prompts: list[list[int]], n: int) -> list[int]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token lines up
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        # min_new_tokens = max_new_tokens is HF's way to ignore EOS: exactly n tokens per row.
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
        return [out.shape[1] - width] * len(prompts)

    return generate


if __name__ == "__main__":
    run_driver("hf", transformers.__version__, load)
