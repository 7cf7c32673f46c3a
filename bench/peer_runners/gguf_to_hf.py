"""Write a Hugging Face directory (bf16 safetensors + tokenizer) from a GGUF file.

    python gguf_to_hf.py MODEL.gguf OUT_DIR

Run by setup_peers.sh with the hf peer's python (torch, transformers, gguf). vLLM needs such a
directory. transformers refuses save_pretrained on a GGUF-loaded model, so build a fresh model
from its config and copy the (dequantized) state dict in.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf_path, out_dir = sys.argv[1], sys.argv[2]
    folder, name = os.path.split(os.path.abspath(gguf_path))
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = src.config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings in SmolLM2, so it may be reported missing; anything else is a bug.
    if unexpected or [k for k in missing if not k.startswith("lm_head")]:
        raise SystemExit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    # The config still says quant_method "gguf"; vLLM would then look for a GGUF file. These are
    # plain bf16 weights now.
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, out_dir)
    print(f"wrote {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
