"""Smoke test of bench/peers.py and bench/plot.py at toy sizes: shape of the JSON, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # loads the real default model

REPO = Path(__file__).resolve().parents[2]
N, IN, OUT, SINGLE_OUT = 2, 8, 4, 4


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_peers_json_and_plot(tmp_path: Path) -> None:
    missing = tmp_path / "no-peers-here"
    proc = _run(
        ["-m", "bench.peers", "--num-requests", str(N), "--input-len", str(IN), "--output-len", str(OUT),
         "--single-output-len", str(SINGLE_OUT), "--peer-dir", str(missing)],
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, "bench scripts print exactly one JSON object on stdout"
    doc = json.loads(lines[0])
    for key in ("git_sha", "device", "date", "command", "machine", "config", "engines", "ratios"):
        assert key in doc, key
    assert "bench.peers" in doc["command"]

    pb = doc["engines"]["pagebus"]
    assert "error" not in pb, pb
    off, single = pb["offline"], pb["single"]
    assert off["requests"] == N
    assert off["input_tokens"] == N * IN
    assert off["output_tokens"] == N * OUT
    assert off["elapsed_s"] > 0 and off["output_tokens_per_s"] > 0
    assert single["input_tokens"] == IN and single["output_tokens"] == SINGLE_OUT
    assert single["elapsed_s"] > 0 and single["output_tokens_per_s"] > 0
    # Engines not set up are reported, never fatal, and get no ratio.
    for peer in ("hf", "llamacpp", "vllm"):
        assert doc["engines"][peer]["skipped"].startswith("not set up"), doc["engines"][peer]
    assert doc["ratios"] == {}

    out_json = tmp_path / "peers.json"
    out_json.write_text(proc.stdout)
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
