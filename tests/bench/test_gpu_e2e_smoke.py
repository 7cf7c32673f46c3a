"""bench/gpu_e2e.py at tiny sizes on CPU, its merge of the GPU check's parts, and the whole of
bench/gpu_check.sh (GPU tests skip, kernels_gpu says it skipped, the e2e part runs --tiny), so
the script the lead runs on a GPU box has run end to end here. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TINY_ARGS = [
    "--tiny", "--concurrency", "1", "3", "--prompt-len", "6", "--output-len", "5",
    "--prefill-seqs", "2", "--prefill-len", "24", "--max-num-batched-tokens", "32",
]  # fmt: skip


def test_tiny_run_reports_decode_and_prefill_against_rooflines(tmp_path) -> None:
    out_file = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_e2e", *TINY_ARGS, "--json-out", str(out_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out == json.loads(out_file.read_text())
    assert out["ok"] and out["bench"] == "gpu_e2e" and out["device_type"] == "cpu"
    assert out["startup"]["cuda_graph_sizes"] == []  # no graphs on CPU: only the eager runs
    assert [(d["concurrency"], d["cuda_graphs"]) for d in out["decode"]] == [(1, "off"), (3, "off")]
    for d in out["decode"]:
        # 5 outputs: 1 from the prefill step, then 4 full-batch decodes of which the first is untimed
        assert d["decode_steps"] == 3
        assert d["output_tok_s"] > 0 and d["roofline_tok_s"] > 0 and d["fraction_of_roofline"] > 0
    p = out["prefill"]
    assert p["tokens"] == 2 * 24 and p["tok_s"] > 0 and p["tflop_s"] > 0 and p["roofline_tok_s"] > 0
    assert out["ceilings"]["copy_bandwidth_gb_s"] > 0 and out["ceilings"]["matmul_bf16_tflop_s"] > 0


def test_combine_reports_each_part(tmp_path) -> None:
    (tmp_path / "pytest.rc").write_text("0\n")
    (tmp_path / "pytest.log").write_text("3 passed in 1.0s\n")
    (tmp_path / "kernels_gpu.rc").write_text("124\n")
    (tmp_path / "kernels_gpu.log").write_text("still compiling\n")
    (tmp_path / "gpu_e2e.rc").write_text("0\n")
    (tmp_path / "gpu_e2e.json").write_text(json.dumps({"bench": "gpu_e2e", "ok": True}) + "\n")
    out_file = tmp_path / "all.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_e2e", "--combine", str(tmp_path), "--json-out", str(out_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1  # one part failed
    out = json.loads(out_file.read_text())
    assert out["pytest"]["ok"] and "3 passed" in out["pytest"]["log_tail"]
    assert out["kernels_gpu"]["timed_out"] and out["kernels_gpu"]["log_tail"] == "still compiling\n"
    assert out["gpu_e2e"]["result"] == {"bench": "gpu_e2e", "ok": True}
    assert out["ok"] is False


def test_gpu_check_script_runs_every_part(tmp_path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "GPU_E2E_ARGS": " ".join(TINY_ARGS),
        # One kernel file and the CUDA-only worker file (which skips here): the suite runs every
        # kernel test under the interpreter already, and all of them again here took ~2 minutes.
        "GPU_CHECK_TESTS": "tests/kernels/test_compile_sm90.py tests/workers/test_gpu_runner.py",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == out
    assert out["pytest"]["ok"], out["pytest"].get("log_tail")
    assert " passed" in out["pytest"]["log_tail"]  # the selection ran, not an empty collection
    assert out["kernels_gpu"]["ok"] and out["kernels_gpu"]["result"]["skipped"] == "no CUDA device"
    assert out["gpu_e2e"]["ok"] and out["gpu_e2e"]["result"]["ok"]
    assert out["ok"] and proc.returncode == 0


def test_a_failed_run_leaves_the_engine_usable(tmp_path) -> None:
    from pagebus.bus.config import EngineConfig
    from pagebus.workers.runner import ModelRunner

    from bench.gpu_e2e import TINY, Engine, write_llama_config

    write_llama_config(str(tmp_path), TINY)
    cfg = EngineConfig(load_format="dummy", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    runner = ModelRunner(cfg, str(tmp_path))
    eng = Engine(runner, cfg)
    execute = runner.execute
    calls = 0

    def failing(batch):  # the third step of the run dies
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected")
        return execute(batch)

    runner.execute = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        eng.run(4, 5, 6)
    runner.execute = execute  # type: ignore[method-assign]
    eng.reset()
    assert runner.seqs == {}
    m = eng.run(4, 5, 3)  # all four rows are free again
    assert m["prefill_tokens"] == 4 * 5 and m["decode_steps"] == 1
