"""bench/report.py: the README's Performance summary from a stored bench/peers.py result."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report

REPO = Path(__file__).resolve().parents[2]
SERVED = "bench/results/peers_avx2_zen3_20261206_pv_groups_served.json"  # a run with every part


def _doc(path: str = SERVED) -> dict:
    return json.loads((REPO / path).read_text())


def _row(block: str, target: str) -> list[str]:
    """The cells of the targets table's row whose first cell starts with `target`."""
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith(target):
            return cells
    raise AssertionError(f"no row {target!r} in:\n{block}")


def test_every_target_with_its_value_and_verdict() -> None:
    block = report.render(_doc(), SERVED)
    assert block.startswith(report.MARK_BEGIN) and block.endswith(report.MARK_END)
    assert "AMD EPYC, 2 CPUs" in block and "FMA peak 204.7 GFLOP/s" in block and "pagebus 9e42182" in block
    # the engines, pagebus's two paths first, and what each did
    assert re.search(r"\| \*\*pagebus\*\* `run-batch` \| 250.7 \| 257.9 \| - \|", block)
    assert "| llama.cpp 0.3.36 F16 | 187.5 | 221.7 | 74.6 |" in block
    assert block.index("`run-batch` |") < block.index("`LLM.generate` |") < block.index("| llama.cpp")
    # the verdicts follow the measured values against the targets
    assert _row(block, "`run-batch` / vLLM, 32 requests")[1:] == ["1.62", ">= 1.5", "**yes**"]
    assert _row(block, "`run-batch` / llama.cpp F16 (its best format), 64")[1:] == ["1.16", ">= 1.5", "no"]
    compute = _row(block, "`run-batch` compute fraction, 64 requests")
    assert compute[1] == "0.76 (0.63 of the FMA peak; 1.5x llama.cpp asks 0.81)" and compute[3] == "**yes**"
    assert _row(block, "single stream / llama.cpp F16")[1:] == ["1.01", ">= 1.0", "**yes**"]
    assert _row(block, "single stream, fraction")[1:] == ["0.75", ">= 0.8", "no"]
    assert _row(block, "process split (`run-batch` / `LLM.generate`), 64")[1:] == ["0.91", ">= 0.95", "no"]
    assert _row(block, "start-up to Ready")[1:] == ["8.8 s", "< 10 s", "**yes**"]
    # served: each server's figures, the verdicts the run carries, and whether the floor allows the target
    assert "| **pagebus** `serve` | vLLM's OpenAI server | llama.cpp server F16 |" in block
    assert "258.4 tok/s, TTFT p50 / P99 4.35 / 6.52 s" in block
    assert _row(block, "served 64x128x128@32: output tok/s")[1:] == ["1.93", ">= 1.5", "**yes**"]
    ttft = _row(block, "served 8x1024x64@1: P99 TTFT")
    assert ttft[1] == "1.01 (floor here: 1.04x what the target allows, out of reach)" and ttft[3] == "no"
    # 0.99x: reachable, just, at the FMA peak
    assert "out of reach" not in _row(block, "served 64x128x128@32: P99 TTFT")[1]


def test_a_run_without_peers_or_served_parts() -> None:
    doc = _doc("bench/results/peers_avx2_zen3_20261206_kv_trickle.json")  # --skip served
    block = report.render(doc, "x.json")
    assert "Served" not in block and "served " not in block
    assert _row(block, "`run-batch` / vLLM, 64 requests")[1:] == ["1.37", ">= 1.5", "no"]
    doc["engines"]["vllm"] = {"skipped": "not set up: run bench/setup_peers.sh"}
    doc["targets"]["offline"]["64"]["vs_vllm"]["run_batch"] = None
    block = report.render(doc, "x.json")
    assert "| vLLM CPU | not set up: run bench/setup_peers.sh |" in block
    # unmeasured, not failed
    assert _row(block, "`run-batch` / vLLM, 64 requests")[1:] == ["-", ">= 1.5", "-"]


def test_write_replaces_only_the_marked_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.MARK_BEGIN}\nold\n{report.MARK_END}\nafter\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", SERVED, "--write", str(readme)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"written": str(readme)}
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n" + report.MARK_BEGIN)
    assert text.endswith(report.MARK_END + "\nafter\n")
    assert "old" not in text and text.count(report.MARK_BEGIN) == 1
    assert report.replace_block(text, report.render(_doc(), SERVED)) == text  # idempotent


def test_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="add the two markers"):
        report.replace_block("no markers here", "block")
    with pytest.raises(ValueError, match=r"not a bench/peers\.py result"):
        report.render({"bench": "serve_peers"}, "s.json")
    plain = tmp_path / "plain.md"
    plain.write_text("nothing marked\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", SERVED, "--write", str(plain)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "add the two markers" in proc.stderr
    assert plain.read_text() == "nothing marked\n"  # left as it was


def test_readme_summary_is_the_named_result_rendered() -> None:
    """The README's block is generated, never edited by hand: re-rendering the result it names gives it."""
    text = (REPO / "README.md").read_text()
    start, end = text.index(report.MARK_BEGIN), text.index(report.MARK_END) + len(report.MARK_END)
    block = text[start:end]
    source = re.search(r"python -m bench\.report (\S+) --write README\.md", block)
    assert source, "the block names the result it was generated from"
    assert report.render(_doc(source[1]), source[1]) == block, (
        f"README's Performance block is out of date: python -m bench.report {source[1]} --write README.md"
    )
