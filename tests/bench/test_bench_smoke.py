"""Every bench script runs at tiny sizes and prints one JSON object whose numbers are positive
and consistent with the workload (no timing assertions: these machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got {len(lines)}"
    out = json.loads(lines[0])
    assert out["bench"] == module and out["git_sha"] and out["device"]
    return out


def test_scheduler_step() -> None:
    out = run_bench("scheduler_step", "--num-seqs", "8", "--steps", "20")
    assert out["cpu_ms_per_step"] > 0 and out["cpu_us_per_seq_per_step"] > 0


def test_throughput_both_paths() -> None:
    out = run_bench(
        "throughput", "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--dtype", "float32"
    )
    for path in ("llm_generate", "run_batch"):
        r = out[path]
        assert (r["input_tokens"], r["output_tokens"]) == (3 * 8, 3 * 4), path
        assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
    assert out["run_batch"]["ok"] == 3 and out["run_batch"]["failed"] == 0
    assert out["ratio_run_batch_to_llm"] > 0 and out["peak_rss_mb"] > 0


def test_decode() -> None:
    out = run_bench(
        "decode", "--dtypes", "float32", "--concurrency", "2", "--output-len", "4", "--input-words", "4"
    )
    r = out["results"]["float32"]
    assert r["single_stream_tok_s"] > 0 and r["concurrent_tok_s"] > 0


def test_prefix() -> None:
    out = run_bench(
        "prefix", "--prefix-len", "48", "--suffix-len", "4", "--num-requests", "2", "--dtype", "float32"
    )
    assert out["ttft_s_caching_on"]["p50"] > 0 and out["ttft_s_caching_off"]["p50"] > 0
    assert out["speedup_p50"] > 0


def test_serve_against_a_launched_server() -> None:
    out = run_bench(
        "serve", "--launch", "--concurrency", "1", "2", "--num-requests", "3", "--input-len", "8",
        "--output-len", "4", "--", "--dtype", "float32",
    )  # fmt: skip
    assert [r["max_concurrency"] for r in out["results"]] == [1, 2]
    for r in out["results"]:
        assert (r["completed"], r["failed"], r["total_output_tokens"]) == (3, 0, 3 * 4)
        assert (
            r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0 and r["e2e_ms"]["p99"] >= r["ttft_ms"]["p50"]
        )
        assert r["goodput"] <= r["request_throughput"]


def test_sampler() -> None:
    out = run_bench("sampler", "--batch-sizes", "1", "3", "--vocab", "500", "--repeats", "1")
    assert [(r["mix"], r["rows"]) for r in out["results"]][:2] == [("greedy", 1), ("greedy", 3)]
    assert all(
        r["new_us_per_row"] > 0 and r["old_us_per_row"] > 0 and r["speedup"] > 0 for r in out["results"]
    )
    assert out["torch"] and out["threads"] == 1


def test_linear_layout() -> None:
    out = run_bench("linear_layout", "--rows", "1", "4", "--rounds", "1")
    assert set(out["results"]) == {"qkv", "o", "gate_up", "down", "lm_head"} and out["cpu_flags"] is not None
    for by_rows in out["results"].values():
        assert set(by_rows) == {"1", "4"}
        assert all(r["checkpoint_gflops"] > 0 and r["transposed_gflops"] > 0 for r in by_rows.values())


def test_steadiness() -> None:
    out = run_bench("steadiness", "--seconds", "1")
    assert out["rounds"] >= 3 and out["threads"] == 1
    for probe in ("matmul_gflops", "copy_gb_per_s"):
        s = out[probe]
        assert 0 < s["min"] <= s["p10"] <= s["median"] <= s["max"], probe
    if out["fma_gflops"] is not None:  # a machine with FMA and a compiler
        assert 0 < out["matmul_over_fma"]["p10"] <= out["matmul_over_fma"]["median"]
