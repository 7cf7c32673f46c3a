"""Peak memory while loading the default model's weights, kept quantized or dequantized.

    python -m bench.quant_load_memory [--formats q4_1 q4_k_m q8_0] [--files-from-peers]

Each case loads the model (workers/runner.load_model, fp32 activations) in a fresh process and
reports its peak RSS above what the process held before loading (imports, torch), the RSS after
loading, and the weight bytes the model holds. "none" is the same file dequantized at load.
Files: the default model (Q4_1) and, with --files-from-peers, bench/setup_peers.sh's rewrites and
bench/quant.py's llama.cpp quantizations. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from bench.common import emit, setup_logging

_CHILD = """
import json, resource, sys, torch
from pagebus.workers.loader import resident_weight_bytes
from pagebus.workers.runner import load_model

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

path, quantization = sys.argv[1], sys.argv[2]
torch.zeros(1) @ torch.zeros(1, 1)  # torch's lazy start-up allocations belong to the baseline
before, peak_before = rss(), peak()
model, _ = load_model(path, torch.float32, torch.device("cpu"), quantization=quantization)
print(json.dumps({
    "rss_before_load": before, "peak_rss_before_load": peak_before,
    "load_peak_above_before": peak() - before, "rss_after_load_above_before": rss() - before,
    "weight_bytes": resident_weight_bytes(model),
}))
"""


def measure(path: str, quantization: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, quantization], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from pagebus.frontends.model_files import default_model_path

    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", nargs="+", default=["q4_1", "q4_k_m", "q8_0"])
    ap.add_argument("--files-from-peers", action="store_true", help="use the peer model folder's GGUFs")
    ap.add_argument("--peer-model-dir", default="~/.cache/pagebus/peers/model")
    args = ap.parse_args()
    files = {"q4_1": default_model_path()}
    if args.files_from_peers:
        folder = os.path.expanduser(args.peer_model_dir)
        for fmt in args.formats:
            path = os.path.join(folder, f"SmolLM2-135M-Instruct.{fmt}.gguf")
            if fmt not in files and os.path.isfile(path):
                files[fmt] = path
    results: dict[str, Any] = {}
    for fmt in args.formats:
        if fmt not in files:
            results[fmt] = {"skipped": "no such file (see --files-from-peers, bench/quant.py --make-q4-0)"}
            continue
        results[fmt] = {"file": files[fmt]} | {q: measure(files[fmt], q) for q in ("gguf", "none")}
    emit({"bench": "quant_load_memory", "unit": "bytes", "results": results})


if __name__ == "__main__":
    main()
