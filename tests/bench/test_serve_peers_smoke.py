"""Smoke test of bench/serve_peers.py at toy sizes with pagebus only: the peers are reported as
skipped, pagebus serve starts, serves both workloads and stops. Shape of the JSON, not speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_peers import parse_workload, startup_split

pytestmark = pytest.mark.slow  # starts pagebus serve on the real default model

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = ("3x8x4@2", "2x16x3@1")


def test_serve_peers_pagebus_only(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve_peers", "--workloads", *WORKLOADS,
         "--peer-dir", str(tmp_path / "no-peers-here"), "--ready-timeout", "300", "--client-timeout", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, "bench scripts print exactly one JSON object on stdout"
    doc = json.loads(lines[0])
    assert doc["bench"] == "serve_peers" and doc["git_sha"] and "avx512_bf16" in doc["machine"]["flags"]
    assert doc["client"] == "bench.serve"  # vLLM's client lives in the vLLM peer's venv, absent here
    assert doc["engines"]["vllm"] == {"skipped": "not set up; run bench/setup_peers.sh"}
    assert doc["engines"]["llamacpp_q4_1"]["skipped"].startswith("not set up")

    pb = doc["engines"]["pagebus"]
    assert "error" not in pb, pb
    assert "--no-enable-prefix-caching" in pb["command"] and "127.0.0.1" in pb["command"]
    assert pb["ready_s"] > 0 and pb["model"]
    for name in WORKLOADS:
        w = parse_workload(name)
        r = pb[name]
        assert r["client"] == "bench.serve" and r["completed"] == w.num_prompts and r["failed"] == 0
        assert r["total_output_tokens"] == w.num_prompts * w.output_len  # ignore_eos
        assert r["output_throughput"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0
        # No peer ran: the ratios carry pagebus's own figures and no comparison.
        assert doc["ratios"][name] == {
            "pagebus_output_throughput": r["output_throughput"],
            "pagebus_p99_ttft_ms": r["ttft_ms"]["p99"],
        }


def test_parse_workload_and_split(tmp_path: Path) -> None:
    w = parse_workload("64x128x128@32")
    assert (w.num_prompts, w.input_len, w.output_len, w.concurrency) == (64, 128, 128, 32)
    assert w.name == "64x128x128@32"
    with pytest.raises(argparse.ArgumentTypeError):
        parse_workload("64x128@32")
    log = tmp_path / "serve.log"
    log.write_text(
        "2026-11-30 10:00:00 INFO pagebus.workers.runner: model loaded in 1.5s: llama, float32\n"
        "2026-11-30 10:00:01 INFO pagebus.frontends.launcher: engine processes ready in 2.25s\n"
        "2026-11-30 10:00:01 INFO pagebus.frontends.engine_client: engine ready in 2.4s: EngineInfo(...)\n"
    )
    assert startup_split(log) == {"model loaded": 1.5, "engine processes": 2.25, "engine": 2.4}
