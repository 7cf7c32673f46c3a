"""Every kernel compiles for sm_90 (no GPU needed) and the default tilings do not spill.

The interpreter accepts things a GPU compile rejects (tl.dot below 16 rows, loop-carried type
changes, ...), so the CPU suite also compiles each kernel ahead of time with the bundled ptxas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend")
def test_kernels_compile_for_sm90_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.aot_sm90"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    usage = json.loads(proc.stdout)
    assert {k.split("_")[0] for k in usage} >= {"decode", "prefill", "merge", "kv", "rms", "rotary", "silu"}
    # fp32 caches are not a production path on GPUs; their 64-row split tiles spill a little.
    spills = {k: v["spill_bytes"] for k, v in usage.items() if v["spill_bytes"] and "fp32_gqa8" not in k}
    assert not spills, spills
