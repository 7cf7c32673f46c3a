"""Smoke test of bench/serve_peers.py at toy sizes with pagebus only: the peers are reported as
skipped, pagebus serve starts, serves both workloads and stops. Shape of the JSON, not speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_peers import median_round, parse_workload, positive_int, ratios, startup_split

pytestmark = pytest.mark.slow  # starts pagebus serve on the real default model

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = ("3x8x4@2", "2x16x3@1")


def test_serve_peers_pagebus_only(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.serve_peers", "--workloads", *WORKLOADS,
         "--peer-dir", str(tmp_path / "no-peers-here"), "--ready-timeout", "300", "--client-timeout", "300",
         "--rounds", "2"],
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
    assert 0 <= pb["settle_s_max"] < 6 and pb["runs_begun_busy"] >= 0
    for name in WORKLOADS:
        w = parse_workload(name)
        r = pb[name]
        assert r["client"] == "bench.serve" and r["completed"] == w.num_prompts and r["failed"] == 0
        assert r["total_output_tokens"] == w.num_prompts * w.output_len  # ignore_eos
        assert r["output_throughput"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0
        # two rounds, the one of the lower tok/s kept (the lower of the middle two)
        assert len(r["rounds"]) == 2 and r["output_throughput"] == min(
            x["output_throughput"] for x in r["rounds"]
        )
        assert r["ttft_ms"]["p99"] in [x["p99_ttft_ms"] for x in r["rounds"]]
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


def _round(tps: float | None, p99: float | None) -> dict[str, object]:
    return {"output_throughput": tps, "ttft_ms": {"p50": p99, "p99": p99}} if tps else {"error": "x"}


def test_rounds_are_paired() -> None:
    """Each workload keeps the round of the median tok/s; the ratios are medians of the ratios
    within a round, so a round that was slow for every server moves no ratio."""
    w = parse_workload("4x8x4@2")
    pb = median_round([_round(100.0, 10.0), _round(50.0, 20.0), _round(90.0, 11.0)])
    assert pb["output_throughput"] == 90.0 and pb["ttft_ms"]["p99"] == 11.0
    assert [r["output_throughput"] for r in pb["rounds"]] == [100.0, 50.0, 90.0]
    vllm = median_round([_round(50.0, 20.0), _round(25.0, 40.0), _round(60.0, 22.0)])
    slow = median_round([_round(10.0, 90.0), _round(5.0, 100.0), _round(9.0, 95.0)])
    broken = median_round([_round(None, None)])
    assert broken["rounds"] == [{"output_throughput": None, "p99_ttft_ms": None}] and "error" in broken
    engines = {"pagebus": {w.name: pb}, "vllm": {w.name: vllm}, "llamacpp_q4_1": {w.name: slow},
               "other": {w.name: broken}}  # fmt: skip
    r = ratios(engines, [w])[w.name]
    # per round 100 / 50, 50 / 25, 90 / 60: 2, 2, 1.5 -> 2.0 (unpaired, 90 / 50 would read 1.8)
    assert r["output_throughput"] == {"best_peer": "vllm", "ratio": 2.0, "target": 1.5, "met": True}
    # per round 10 / 20, 20 / 40, 11 / 22: 0.5 each
    assert r["p99_ttft"] == {"best_peer": "vllm", "ratio": 0.5, "target": 0.5, "met": True}
    # figures without rounds (one run each, as before): their own ratio
    one = {"pagebus": {w.name: _round(30.0, 3.0)}, "vllm": {w.name: _round(20.0, 4.0)}}
    assert ratios(one, [w])[w.name]["output_throughput"]["ratio"] == 1.5


def test_rounds_must_be_positive() -> None:
    assert positive_int("2") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 0"):
        positive_int("0")
