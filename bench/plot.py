"""PNG charts from the JSON the bench scripts print.

    python -m bench.plot PEERS_JSON [--serve SERVE_JSON] [--out-dir DIR]

PEERS_JSON (bench/peers.py) -> DIR/peers.png: per engine, offline output tok/s and single-stream
decode tok/s, two bar charts. Keys read: engines.<name>.offline.output_tokens_per_s,
engines.<name>.single.decode_tokens_per_s (falling back to .output_tokens_per_s); engines that were
skipped or failed are left out. Pass "-" to skip it when only plotting serve results.

SERVE_JSON (bench/serve.py or anything shaped alike) -> DIR/serve.png: latency percentiles against
load, one panel per metric. Keys read: results[] with request_rate (req/s; "inf" or null means all
at once) or, when no result has a request rate, max_concurrency; and, for each metric present among
ttft_ms, itl_ms, tpot_ms, e2e_ms, an object of percentiles such as {"p50": ..., "p99": ...}; every
pNN key found is drawn as one line.

matplotlib is not a pagebus dependency: it is imported lazily and, when missing, the script exits
non-zero saying how to install it. Prints one JSON object: {"written": [paths]}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

SERVE_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
MISSING_MPL = "bench/plot.py needs matplotlib, which is not installed: pip install matplotlib"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        sys.exit(MISSING_MPL)
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def peer_bars(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{"offline": {engine: tok/s}, "single": {engine: tok/s}} for the engines that have figures."""
    bars: dict[str, dict[str, float]] = {"offline": {}, "single": {}}
    for name, r in doc.get("engines", {}).items():
        if "offline" in r and r["offline"].get("output_tokens_per_s"):
            bars["offline"][name] = r["offline"]["output_tokens_per_s"]
        single = r.get("single", {})
        value = single.get("decode_tokens_per_s") or single.get("output_tokens_per_s")
        if value:
            bars["single"][name] = value
    return bars


def plot_peers(doc: dict[str, Any], out: Path) -> Path:
    plt = _pyplot()
    bars = peer_bars(doc)
    cfg = doc.get("config", {})
    titles = {
        "offline": f"offline: {cfg.get('num_requests', '?')} x {cfg.get('input_len', '?')} in "
        f"x {cfg.get('output_len', '?')} out, output tok/s",
        "single": f"single stream: decode tok/s ({cfg.get('single_output_len', '?')} tokens)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key in zip(axes, ("offline", "single"), strict=True):
        names, values = list(bars[key]), list(bars[key].values())
        colors = ["tab:red" if n == "pagebus" else "tab:gray" for n in names]
        ax.bar(names, values, color=colors)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(titles[key], fontsize=9)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.set_ylabel("tokens/s")
    fig.suptitle(f"{doc.get('device', '')}  {doc.get('git_sha', '')}  {doc.get('date', '')}", fontsize=8)
    absent = [f"{n} ({'skipped' if 'skipped' in r else 'failed'})" for n, r in doc.get("engines", {}).items()
              if "skipped" in r or "error" in r]  # fmt: skip
    if absent:
        fig.text(0.01, 0.01, "not shown: " + ", ".join(absent), fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _x_key(results: list[dict[str, Any]]) -> str:
    """request_rate when the run swept rates, else max_concurrency (bench/serve.py's default sweep)."""
    if any(r.get("request_rate") is not None for r in results) or not any(
        "max_concurrency" in r for r in results
    ):
        return "request_rate"
    return "max_concurrency"


def _x(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    return math.inf if v in (None, "inf", "Infinity") else float(v)


def plot_serve(doc: dict[str, Any], out: Path) -> Path:
    plt = _pyplot()
    results = doc.get("results", [])
    if not results:
        raise ValueError("serve JSON has no results[]")
    key = _x_key(results)
    results = sorted(results, key=lambda r: _x(r, key))
    metrics = [m for m in SERVE_METRICS if any(isinstance(r.get(m), dict) for r in results)]
    if not metrics:
        raise ValueError(f"serve JSON results carry none of {SERVE_METRICS}")
    # An infinite rate (everything at once) is drawn one step right of the largest finite rate.
    finite = [_x(r, key) for r in results if math.isfinite(_x(r, key))]
    inf_x = (max(finite) * 1.5) if finite else 1.0
    xs = [x if math.isfinite(x) else inf_x for x in (_x(r, key) for r in results)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        keys = sorted({k for r in results for k in r.get(metric, {}) if k[:1] == "p" and k[1:].isdigit()})
        for k in sorted(keys, key=lambda k: int(k[1:])):
            pts = [(x, r[metric][k]) for x, r in zip(xs, results, strict=True) if k in r.get(metric, {})]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
        ax.set_title(metric, fontsize=9)
        label = "request rate (req/s; 'all at once' drawn rightmost)" if key == "request_rate" else key
        ax.set_xlabel(label, fontsize=8)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peers_json", help='JSON printed by bench/peers.py, or "-" for none')
    ap.add_argument("--serve", default=None, help="JSON printed by bench/serve.py")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if args.peers_json != "-":
        written.append(plot_peers(json.loads(Path(args.peers_json).read_text()), out_dir / "peers.png"))
    if args.serve:
        written.append(plot_serve(json.loads(Path(args.serve).read_text()), out_dir / "serve.png"))
    print(json.dumps({"written": [str(p) for p in written]}))


if __name__ == "__main__":
    main()
