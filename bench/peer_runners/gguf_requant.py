"""Rewrite a GGUF with another tensor type through llama.cpp's own quantizer (e.g. Q4_1 -> F32).

    python gguf_requant.py IN.gguf OUT.gguf [f32|f16|bf16|q8_0]

Run by setup_peers.sh with the llamacpp peer's python. With allow_requantize, llama.cpp dequantizes
each Q4_1 tensor and stores it in the new type: F32 (and BF16 on a bf16 machine) are the same weights
pagebus runs (it dequantizes the same file to its dtype), with no round trip through an HF directory
and the converter's tokenizer checks. F16 and Q8_0 are the other formats llama.cpp is fast in.
"""

from __future__ import annotations

import ctypes
import os
import sys

import llama_cpp

FTYPES = {
    "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    ftype = FTYPES[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst + ".tmp"
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed: {rc}")
    os.replace(tmp, dst)
    print(f"wrote {dst}", file=sys.stderr)


if __name__ == "__main__":
    main()
