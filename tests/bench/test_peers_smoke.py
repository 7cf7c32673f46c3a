"""Smoke test of bench/peers.py and bench/plot.py at toy sizes: shape of the JSON, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads the real default model

REPO = Path(__file__).resolve().parents[2]
# SINGLE_OUT: enough decode steps (~0.2 s) that a round's full run outlasts its one-token run
# through a hiccup of the machine; with 4 a round could lose its decode rate (CI, once).
N, N2, IN, OUT, SINGLE_IN, SINGLE_OUT = 2, 3, 8, 4, 6, 24


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_peers_json_and_plot(tmp_path: Path) -> None:
    missing = tmp_path / "no-peers-here"
    proc = _run(
        ["-m", "bench.peers", "--num-requests", str(N), str(N2), "--input-len", str(IN),
         "--output-len", str(OUT), "--single-input-len", str(SINGLE_IN), "--single-output-len", str(SINGLE_OUT),
         "--peer-dir", str(missing), "--ceiling-seconds", "0.05", "--ceiling-square", "128",
         "--rounds", "3", "--single-rounds", "3", "--skip", "startup", "served"],
        timeout=480,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, "bench scripts print exactly one JSON object on stdout"
    doc = json.loads(lines[0])
    for key in ("git_sha", "device", "date", "command", "machine", "ceilings", "config", "engines", "ratios"):
        assert key in doc, key
    assert "bench.peers" in doc["command"]
    # The machine decides the dtype: bf16 only where the CPU has it natively.
    flags = doc["machine"]["cpu_flags"]
    native = flags["avx512_bf16"] or flags["amx_bf16"]
    assert doc["config"]["dtype"] == ("bfloat16" if native else "float32")
    assert doc["engines"]["pagebus"]["dtype"] == doc["config"]["dtype"]
    ceil = doc["ceilings"]
    # bf16's ceiling only where bf16 is native (emulated, one large product takes minutes)
    assert set(ceil["matmul_gflops"]) == ({"float32", "bfloat16"} if native else {"float32"})
    for dtype in ceil["matmul_gflops"]:
        gflops = ceil["matmul_gflops"][dtype]
        assert gflops["square_128"] > 0 and gflops["layer_m1"] > 0 and gflops["lm_head_m1"] > 0
    assert ceil["dram_gb_per_s"] > 0
    assert (ceil["fma_gflops_float32"] or 0) > 0 if flags["fma"] else ceil["fma_gflops_float32"] is None

    pb = doc["engines"]["pagebus"]
    assert "error" not in pb, pb
    off, single = pb["offline"], pb["single"]
    assert off["requests"] == N
    assert off["input_tokens"] == N * IN
    assert off["output_tokens"] == N * OUT
    assert off["elapsed_s"] > 0 and off["output_tokens_per_s"] > 0
    # --offline-repeats 3: three timed runs, the median's figures kept
    assert len(off["elapsed_runs_s"]) == 3 and off["elapsed_s"] == sorted(off["elapsed_runs_s"])[1]
    assert pb["offline_by_size"][str(N)] == off
    assert pb["offline_by_size"][str(N2)]["output_tokens"] == N2 * OUT
    assert single["input_tokens"] == SINGLE_IN and single["output_tokens"] == SINGLE_OUT
    # one decode rate a round (its own first-token and full runs), the median kept
    assert len(single["decode_runs_tokens_per_s"]) == 3
    assert single["decode_tokens_per_s"] == sorted(single["decode_runs_tokens_per_s"])[1]
    # every run waited for a quiet machine first, at most the wait's 5 s timeout (plus a window)
    assert 0 <= pb["settle_s_max"] < 6 and pb["runs_begun_busy"] >= 0
    # run-batch: the same prompts through the processes, each size, its runs interleaved with LLM.generate's.
    rb = doc["engines"]["pagebus_run_batch"]
    assert "error" not in rb, rb
    assert rb["interleaved_with"] == ["pagebus"] and "single" not in rb
    for n in (N, N2):
        assert (
            rb["offline_by_size"][str(n)]["ok"] == n
            and rb["offline_by_size"][str(n)]["output_tokens"] == n * OUT
        )
        runs = rb["offline_by_size"][str(n)]["elapsed_runs_s"]
        assert len(runs) == 3 and rb["offline_by_size"][str(n)]["elapsed_s"] == sorted(runs)[1]
    tgt = doc["targets"]
    for n in (N, N2):
        off_t = tgt["offline"][str(n)]
        assert off_t["output_tokens_per_s"]["llm"] > 0 and off_t["output_tokens_per_s"]["run_batch"] > 0
        assert off_t["vs_vllm"] == {"llm": None, "run_batch": None}  # no peers here
        assert off_t["compute_fraction"]["llm"] > 0 and off_t["workload_gflop"] > 0
        assert (
            off_t["compute_fraction"]["vllm"] is None and off_t["compute_fraction"]["llamacpp_best"] is None
        )
        assert tgt["process_split"][str(n)] > 0
        if doc["config"]["dtype"] == "float32" and flags["fma"]:  # the FMA peak is float32's
            assert off_t["fma_fraction"]["run_batch"] > 0 and off_t["fma_peak_gflops"] > 0
            assert off_t["fma_fraction_for_target"] == {"vllm": None, "llamacpp_best": None}
    assert tgt["single"]["decode_tokens_per_s"] > 0 and tgt["single"]["bandwidth_fraction"] > 0
    # the memory measured around each round: copy and read, one figure a round
    probed = single["bandwidth_runs_gb_per_s"]
    assert len(probed["copy"]) == len(probed["read"]) == 3 and min(probed["copy"] + probed["read"]) > 0
    assert (
        tgt["single"]["bandwidth_fraction_of_read"] > 0
        and tgt["single"]["bandwidth_fraction_start_ceiling"] > 0
    )
    assert ceil["dram_read_gb_per_s"] > 0
    assert tgt["single"]["vs_llamacpp_same_precision"]["ratio"] is None
    assert "startup" not in tgt and "served" not in tgt  # skipped
    assert single["elapsed_s"] > 0 and single["output_tokens_per_s"] > 0
    # Engines not set up are reported, never fatal, and get no ratio.
    for peer in ("hf", "llamacpp", "vllm"):
        assert doc["engines"][peer]["skipped"].startswith("not set up"), doc["engines"][peer]
    assert doc["ratios"] == {}

    out_json = tmp_path / "peers.json"
    out_json.write_text(proc.stdout)
    # bench/report.py renders this run: pagebus's figures, the peers not set up, unmeasured targets as such
    summary = _run(["-m", "bench.report", str(out_json)], timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert "| **pagebus** `run-batch` |" in summary.stdout and "| vLLM CPU | not set up" in summary.stdout
    assert "| `run-batch` / vLLM, 2 requests | - | >= 1.5 | - |" in summary.stdout
    plot = _run(["-m", "bench.plot", str(out_json), "--out-dir", str(tmp_path)], timeout=60)
    png = tmp_path / "peers.png"
    if plot.returncode == 0:  # matplotlib is installed
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert json.loads(plot.stdout)["written"] == [str(png)]
        # bench/serve.py's shape: a concurrency sweep (request_rate null), percentiles per metric.
        lat = {"p50": 10.0, "p99": 30.0}
        serve = {"results": [{"max_concurrency": c, "request_rate": None, "ttft_ms": lat, "itl_ms": lat}
                             for c in (1, 8)]}  # fmt: skip
        (tmp_path / "serve.json").write_text(json.dumps(serve))
        plot = _run(
            ["-m", "bench.plot", "-", "--serve", str(tmp_path / "serve.json"), "--out-dir", str(tmp_path)], 60
        )
        assert plot.returncode == 0, plot.stderr
        assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"
    else:  # matplotlib is not a pagebus dependency: the script must say so
        assert "needs matplotlib" in plot.stderr, plot.stderr
        assert not png.exists()


def test_check_floors() -> None:
    from bench.peers import check

    doc = {"targets": {"startup": {"ready_s": 12.0}, "process_split": {"32": 0.97, "64": None}}}
    floors = {
        "_doc": "ignored",
        "targets.startup.ready_s": {"max": 10.0},
        "targets.process_split.32": {"min": 0.95},
        "targets.process_split.64": {"min": 0.95},
        "targets.served.64x128x128@32.output_throughput.ratio": {"min": 1.0},
    }
    res = check(doc, floors)
    assert res["failures"] == [{"path": "targets.startup.ready_s", "value": 12.0, "max": 10.0}]
    assert res["passed"] == ["targets.process_split.32"]
    assert res["unchecked"] == [
        "targets.process_split.64",
        "targets.served.64x128x128@32.output_throughput.ratio",
    ]


def test_bandwidth_fraction_pairs_each_round_with_its_own_measurement() -> None:
    from bench.peers import bandwidth_fraction

    gb = 10**9
    r = {"single": {"decode_runs_tokens_per_s": [100.0, 50.0, 80.0],
                    "bandwidth_runs_gb_per_s": {"copy": [50.0, 20.0, 40.0], "read": [100.0, 40.0, 80.0]}}}  # fmt: skip
    # per round 100 x 0.4 GB / 50 = 0.8, 50 x 0.4 / 20 = 1.0, 80 x 0.4 / 40 = 0.8: the median 0.8
    assert bandwidth_fraction(r, 4 * gb // 10, "copy") == 0.8
    assert bandwidth_fraction(r, 4 * gb // 10, "read") == 0.4
    assert bandwidth_fraction({"single": {"decode_runs_tokens_per_s": [1.0]}}, gb, "copy") is None
    assert bandwidth_fraction({}, gb, "copy") is None


def test_request_flops() -> None:
    from bench.peers import request_flops

    m = {"layers": 2, "layer_weights": 10, "q_dim": 4, "hidden": 3, "vocab": 5}
    # 3 in + 2 out: 4 forwards; 2 x 4 x 2 x 10 linear, 4 x 4 x 2 x (1+2+3+4) attention, 2 x 2 x 15 lm_head
    assert request_flops(m, 3, 2) == 160 + 320 + 60


def test_p99_ttft_floor() -> None:
    from bench.peers import add_ttft_floors, p99_ttft_floor_s, request_flops
    from bench.serve_peers import Workload

    m = {"layers": 2, "layer_weights": 10, "q_dim": 4, "hidden": 3, "vocab": 5}
    one = request_flops(m, 3, 1)  # one prompt's prefill: its FLOPs at 1 FLOP/s, in seconds
    # 4 prompts, 2 at once: the first two prefilled one after the other (1 and 2 x one), the later
    # two alone (one each); the 99th percentile of [1, 1, 1, 2] x one, interpolated as numpy does
    w = Workload(num_prompts=4, input_len=3, output_len=2, concurrency=2)
    assert p99_ttft_floor_s(w, m, 1.0) == pytest.approx(1.97 * one)
    assert p99_ttft_floor_s(Workload(1, 3, 2, 1), m, 1.0) == one
    served = {w.name: {"pagebus_p99_ttft_ms": 3000.0, "p99_ttft": {"ratio": 1.5, "target": 0.5}}}
    add_ttft_floors(served, [w, Workload(8, 3, 2, 1)], m, 1000.0)  # a workload that did not run is left
    entry = served[w.name]["p99_ttft"]
    assert entry["floor_ms"] == pytest.approx(1.97 * one, abs=0.05)
    # the best peer's P99 is 3000 / 1.5 = 2000 ms; the target allows half of it
    assert entry["floor_over_allowed"] == pytest.approx(1.97 * one / 1000, abs=1e-3)
