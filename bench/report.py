"""The README's Performance summary, generated from one run of bench/peers.py.

    python -m bench.report RESULT_JSON [--write README.md]

RESULT_JSON: what `python -m bench.peers ...` printed (run it without `--skip served` so the
served targets are in it too). Prints the summary as Markdown: the machine and its ceilings, each
engine's throughput, the served workloads, and every target of the speed issue with the value
measured, the value asked and whether it was met. With --write, the summary replaces the text
between the file's two markers (MARK_BEGIN, MARK_END) instead, and one JSON object is printed:
{"written": path}. Nothing is measured here: every figure comes from RESULT_JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.peers import (
    TARGET_BANDWIDTH_FRACTION,
    TARGET_COMPUTE_FRACTION,
    TARGET_OFFLINE_RATIO,
    TARGET_PROCESS_SPLIT,
    TARGET_SINGLE_RATIO,
)

MARK_BEGIN = "<!-- bench.report:begin -->"
MARK_END = "<!-- bench.report:end -->"


def engine_name(key: str, engine: dict[str, Any]) -> str:
    """How a result's engine key reads in a table: pagebus's two paths, llama.cpp's format, versions."""
    version = f" {engine['version']}" if engine.get("version") else ""
    if key == "pagebus":
        return "**pagebus** `LLM.generate`"
    if key == "pagebus_run_batch":
        return "**pagebus** `run-batch`"
    if key.startswith("llamacpp_"):
        return f"llama.cpp{version} {key.removeprefix('llamacpp_').upper()}"
    return {"vllm": f"vLLM CPU{version}", "hf": f"HF transformers{version}"}.get(key, key + version)


def server_name(key: str) -> str:
    """A served result's engine key as a column: the server each one is."""
    if key.startswith("llamacpp_"):
        return f"llama.cpp server {key.removeprefix('llamacpp_').upper()}"
    return {"pagebus": "**pagebus** `serve`", "vllm": "vLLM's OpenAI server"}.get(key, key)


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("**yes**" if ok else "no")


def _at_least(v: float | None, target: float) -> bool | None:
    return None if v is None else v >= target


def machine_line(doc: dict[str, Any]) -> str:
    m, ceil, cfg = doc["machine"], doc["ceilings"], doc["config"]
    flags = " ".join(k for k, on in m.get("cpu_flags", {}).items() if on) or "none of note"
    cpu_id = f" ({m['cpu_id']})" if m.get("cpu_id") else ""
    weights = "float16" if cfg.get("quantization") == "fp16" else cfg.get("quantization") or cfg["dtype"]
    return (
        f"**{doc['date'][:10]}, {m['cpu_model']}{cpu_id}, {m['cpus']} CPUs, {m['mem_gib']} GiB** (flags: {flags}; "
        f"torch {m['torch']}); pagebus {doc['git_sha']} in {cfg['dtype']} arithmetic, {weights} weights, "
        f"{cfg.get('kv_cache_dtype', 'auto')} KV cache. Ceilings measured in the same run: FMA peak "
        f"{_num(ceil.get('fma_gflops_float32'), 1)} GFLOP/s (float32), torch.mm "
        f"{_num(ceil['matmul_gflops'][cfg['dtype']].get('square_2048'), 1)} GFLOP/s ({cfg['dtype']}, 2048 square), "
        f"DRAM copy {_num(ceil['dram_gb_per_s'], 1)} GB/s; load average {m.get('loadavg_1m_at_start')} at the start."
    )


def engines_table(doc: dict[str, Any]) -> list[str]:
    cfg, engines = doc["config"], doc["engines"]
    sizes = [str(n) for n in cfg["offline_sizes"]]
    shape = f"{cfg['input_len']} in x {cfg['output_len']} out"
    head = [f"offline {n} x {shape}, output tok/s" for n in sizes]
    rows = [
        "| engine | " + " | ".join(head) + f" | single stream ({cfg['single_input_len']} in), decode tok/s |",
        "|---" * (len(sizes) + 2) + "|",
    ]
    order = sorted(engines, key=lambda k: (not k.startswith("pagebus"), k != "pagebus_run_batch", k))
    for key in order:
        e = engines[key]
        if "error" in e or e.get("skipped"):
            rows.append(
                f"| {engine_name(key, e)} | {e.get('error') or e.get('skipped')} |" + " |" * len(sizes)
            )
            continue
        by_size = e.get("offline_by_size") or {}
        tps = [_num((by_size.get(n) or {}).get("output_tokens_per_s"), 1) for n in sizes]
        single = _num((e.get("single") or {}).get("decode_tokens_per_s"), 1)
        rows.append(f"| {engine_name(key, e)} | " + " | ".join(tps) + f" | {single} |")
    return rows


def served_table(doc: dict[str, Any]) -> list[str]:
    engines = (doc.get("served") or {}).get("engines") or {}
    workloads = [w for w in doc["config"].get("workloads", []) if any(w in e for e in engines.values())]
    if not workloads:
        return []
    rows = [
        "| served workload | " + " | ".join(server_name(k) for k in engines) + " |",
        "|---" * (len(engines) + 1) + "|",
    ]
    for w in workloads:
        cells = []
        for e in engines.values():
            r = e.get(w) or {}
            ttft = r.get("ttft_ms") or {}
            cells.append(
                f"{_num(r.get('output_throughput'), 1)} tok/s, TTFT p50 / P99 {_num(ttft.get('p50', 0) / 1e3)} / "
                f"{_num(ttft.get('p99', 0) / 1e3)} s"
                if r.get("output_throughput") is not None
                else "-"
            )
        rows.append(f"| {w} | " + " | ".join(cells) + " |")
    return rows


def target_rows(doc: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, asked, met) for every target the run measured."""
    t = doc["targets"]
    out: list[tuple[str, str, str, bool | None]] = []
    for n, o in t.get("offline", {}).items():
        vllm, best = o["vs_vllm"].get("run_batch"), o["vs_llamacpp_best"]
        out.append((f"`run-batch` / vLLM, {n} requests", _num(vllm), f">= {TARGET_OFFLINE_RATIO}",
                    _at_least(vllm, TARGET_OFFLINE_RATIO)))  # fmt: skip
        name = engine_name(best["engine"], {}) if best.get("engine") else "llama.cpp"
        out.append((f"`run-batch` / {name} (its best format), {n} requests", _num(best.get("run_batch")),
                    f">= {TARGET_OFFLINE_RATIO}", _at_least(best.get("run_batch"), TARGET_OFFLINE_RATIO)))  # fmt: skip
        frac = o["compute_fraction"].get("run_batch")
        fma = o.get("fma_fraction") or {}
        asks = (o.get("fma_fraction_for_target") or {}).get("llamacpp_best")
        note = (
            f" ({_num(fma.get('run_batch'))} of the FMA peak; 1.5x llama.cpp asks {_num(asks)})"
            if fma
            else ""
        )
        out.append((f"`run-batch` compute fraction, {n} requests", _num(frac) + note,
                    f">= {TARGET_COMPUTE_FRACTION}", _at_least(frac, TARGET_COMPUTE_FRACTION)))  # fmt: skip
    if s := t.get("single"):
        same = s["vs_llamacpp_same_precision"]
        out.append((f"single stream / {engine_name(same['engine'], {})}", _num(same.get("ratio")),
                    f">= {TARGET_SINGLE_RATIO}", _at_least(same.get("ratio"), TARGET_SINGLE_RATIO)))  # fmt: skip
        bw, read = s.get("bandwidth_fraction"), s.get("bandwidth_fraction_of_read")
        # runs from 2026-12-07 on measure the memory around each round, copy and read
        label = "DRAM copy bandwidth around its rounds" if read is not None else "DRAM bandwidth ceiling"
        note = f" ({_num(read)} of a plain read's)" if read is not None else ""
        out.append((f"single stream, fraction of the {label}", _num(bw) + note,
                    f">= {TARGET_BANDWIDTH_FRACTION}", _at_least(bw, TARGET_BANDWIDTH_FRACTION)))  # fmt: skip
    for w, r in (t.get("served") or {}).items():
        thr, ttft = r["output_throughput"], r["p99_ttft"]
        out.append((f"served {w}: output tok/s / best peer ({server_name(thr['best_peer'])})", _num(thr["ratio"]),
                    f">= {thr['target']}", thr["met"]))  # fmt: skip
        floor = ttft.get("floor_over_allowed")
        # floor: every prompt's prefill at the FMA peak, best order (bench/peers.py p99_ttft_floor_s)
        reach = ", out of reach" if floor is not None and floor > 1 else ""
        note = f" (floor here: {_num(floor)}x what the target allows{reach})" if floor is not None else ""
        out.append((f"served {w}: P99 TTFT / best peer's ({server_name(ttft['best_peer'])})", _num(ttft["ratio"]) + note,
                    f"<= {ttft['target']}", ttft["met"]))  # fmt: skip
    if st := t.get("startup"):
        out.append(("start-up to Ready (`pagebus serve`)", f"{_num(st.get('ready_s'), 1)} s",
                    f"< {st['target_s']:g} s", st.get("met")))  # fmt: skip
    if split := t.get("process_split"):
        for n, v in split.items():
            if n not in ("target", "met"):
                out.append((f"process split (`run-batch` / `LLM.generate`), {n} requests", _num(v),
                            f">= {TARGET_PROCESS_SPLIT}", _at_least(v, TARGET_PROCESS_SPLIT)))  # fmt: skip
    return out


def render(doc: dict[str, Any], source: str) -> str:
    if doc.get("bench") != "peers":
        raise ValueError(f"{source}: not a bench/peers.py result (its 'bench' is {doc.get('bench')!r})")
    lines = [
        MARK_BEGIN,
        f"<!-- generated by `python -m bench.report {source} --write README.md`; edit bench/report.py -->",
        machine_line(doc),
        "",
        f"`{doc['command']}` (`{source}`):",
        "",
        *engines_table(doc),
        "",
    ]
    if served := served_table(doc):
        rounds = (doc.get("config") or {}).get("serve_rounds")
        how = f", in {rounds} rounds (ratios paired by round)" if rounds else ""
        lines += [
            f"Served, with vLLM's own `vllm bench serve` client against each server in turn{how}:",
            "",
            *served,
            "",
        ]
    lines += ["| target | measured | asked | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {asked} | {_met(ok)} |" for name, value, asked, ok in target_rows(doc)]
    return "\n".join([*lines, MARK_END])


def replace_block(text: str, block: str) -> str:
    """text with the part from MARK_BEGIN through MARK_END replaced by block (which carries both)."""
    start, end = text.find(MARK_BEGIN), text.find(MARK_END)
    if start < 0 or end < start:
        raise ValueError(
            f"the file has no {MARK_BEGIN} ... {MARK_END} block to replace; add the two markers first"
        )
    return text[:start] + block + text[end + len(MARK_END) :]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="a JSON object printed by bench/peers.py")
    ap.add_argument(
        "--write", type=Path, default=None, help="replace the marked block of this file (README.md)"
    )
    args = ap.parse_args(argv)
    try:
        block = render(json.loads(args.result.read_text()), args.result.as_posix())
        if args.write is None:
            print(block)
            return
        args.write.write_text(replace_block(args.write.read_text(), block))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"bench.report: {type(e).__name__}: {e}")
    print(json.dumps({"written": str(args.write)}))


if __name__ == "__main__":
    main()
