"""pagebus against the engines users would pick instead, on the same machine, in one run.

    bench/setup_peers.sh                      # once: each peer in its own venv (~15 min)
    python -m bench.peers [--num-requests 32 64] [--input-len 128] [--output-len 128]
        [--single-input-len 32] [--single-output-len 128] [--dtype auto] [--peers hf llamacpp vllm]
        [--rounds 3] [--single-rounds 5]
        [--llamacpp-formats ...] [--llamacpp-n-batch 2048] [--llamacpp-n-ubatch 2048]
        [--skip served startup run-batch] [--check] [--peer-dir ~/.cache/pagebus/peers]

In order: the machine (CPU model and flags, torch, load average); its ceilings, measured here by
bench/peer_runners/ceilings.py (dense matmul FLOP/s in float32 and bfloat16, at a large square size
and at this model's shapes; the float32 FMA peak of the cores; DRAM GB/s of a large copy, read +
write); then every engine on the same token-id prompts, greedy, EOS ignored, timed by one protocol
(bench/peer_runners/_harness.py), all engines loaded at once and their runs interleaved
(bench/interleave.py): --rounds rounds, each timing every engine once, the order rotating:
- offline, for each --num-requests n: n prompts submitted at once; output tok/s of the batch (the
  median over rounds, each round on prompts of its own).
- single: one --single-input-len prompt alone, in --single-rounds rounds; decode tok/s = (n - 1) /
  (t_n - t_1) within a round (the median over rounds), and end to end.
Before every run the machine settles: no engine starts while another's threads are still busy
(bench/interleave.py's wait_for_quiet).
Every ratio between two engines is paired: the median over rounds of the ratio within a round.
Engines: pagebus through LLM.generate (in this process) and through `pagebus run-batch` (the
multi-process engine, a fresh one each run; offline only, on the same prompts); HF transformers
`generate`; llama.cpp (llama-cpp-python) on each GGUF of --llamacpp-formats; vLLM CPU (eager).
Each peer runs its driver under its own venv's python, kept loaded between its runs; prefix
caching is off and every timed run gets prompts no run has seen.
--dtype auto: bfloat16 where the CPU has native bf16 (AVX-512 BF16 or AMX), float32 elsewhere (bf16
is emulated there); pagebus, HF and vLLM run it. llama.cpp runs every format worth trying: F32, F16,
Q8_0 and the Q4_1 original, and BF16 too where bf16 is native.
Then pagebus's start-up to Ready (`pagebus serve` until it answers, with the split it logs) and the
served benchmark (bench/serve_peers.py: vLLM's own client against each server, --serve-rounds
rounds, ratios paired by round).

"targets" holds the issue's ratios: offline (pagebus / vLLM, pagebus / llama.cpp's best format, and
the fraction of the compute ceiling = workload FLOPs / time / matmul FLOP/s in pagebus's dtype; in
float32 also each engine's fraction of the FMA peak, and the fraction 1.5x each peer asks of
pagebus), single stream (pagebus / llama.cpp at the same precision, and F16; the fraction of the
bandwidth ceiling = weight bytes per token x tok/s / DRAM bytes/s), served (in float32 with the P99
TTFT's floor here: every prompt's prefill at the FMA peak, best order; p99_ttft_floor_s), start-up
and the process split (run-batch / LLM.generate). --check exits 1 when a floor of
bench/peer_floors.json is not met.
A peer not set up is "skipped"; a peer that fails carries its error. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import serve_peers
from bench.common import emit, log, setup_logging
from bench.interleave import (
    Engine,
    EngineFailed,
    Interleaved,
    LocalEngine,
    PeerEngine,
    RunBatchEngine,
    paired,
)
from bench.peer_runners import ceilings
from bench.peer_runners._harness import Generate
from bench.ports import free_port
from bench.serve_peers import DEFAULT_PEER_DIR, NOT_SET_UP, load_manifest, peer_env, pick_dtype, positive_int
from bench.throughput import make_prompts

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
FLOORS = Path(__file__).resolve().parent / "peer_floors.json"
PEERS = ("hf", "llamacpp", "vllm")
SKIPPABLE = ("run-batch", "startup", "served")
SAME_PRECISION_GGUF = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# The speed issue's targets (bench/report.py marks each met or not; served ones: bench/serve_peers.py)
TARGET_STARTUP_S = 10.0
TARGET_OFFLINE_RATIO = 1.5  # pagebus offline output tok/s >= 1.5 x each peer's
TARGET_COMPUTE_FRACTION = 0.7  # offline: workload FLOPs / time >= 0.7 x the dense matmul ceiling
TARGET_SINGLE_RATIO = 1.0  # single stream decode tok/s >= llama.cpp's at the same precision
TARGET_BANDWIDTH_FRACTION = 0.8  # single stream: weight bytes per token x tok/s >= 0.8 x DRAM bytes/s
TARGET_PROCESS_SPLIT = 0.95


# --------------------------------------------------------------------------------------------- pagebus
def pagebus_generate(
    dtype: str, kv_cache_dtype: str = "auto", quantization: str | None = None
) -> tuple[Generate, Any]:
    from pagebus import LLM, SamplingParams

    # as the peers: no cache hits
    llm = LLM(None, dtype=dtype, seed=0, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
              quantization=quantization)  # fmt: skip

    def generate(prompts: list[list[int]], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    return generate, llm


def _pagebus_version() -> str | None:
    try:
        return importlib.metadata.version("pagebus")
    except importlib.metadata.PackageNotFoundError:
        return None


def start_engines(
    args: argparse.Namespace, job: dict[str, Any], engines: dict[str, dict[str, Any]], closers: list[Any]
) -> list[Engine]:
    """pagebus (LLM.generate here, and run-batch) and every peer configuration, loaded; what failed to
    load, or is not set up, goes straight into `engines` with its reason. `closers` gets what must
    be shut down after the runs."""
    started: list[Engine] = []
    meta = {"engine": "pagebus", "version": _pagebus_version(), "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}  # fmt: skip
    log.info("pagebus (%s): loading", args.dtype)
    t, load = time.perf_counter(), _load()
    try:
        generate, llm = pagebus_generate(args.dtype, args.kv_cache_dtype, args.quantization)
        closers.append(llm)
        engines["pagebus"] = {"loadavg_1m_at_start": load, "path": "LLM.generate"} | meta | {
            "load_s": round(time.perf_counter() - t, 2)}  # fmt: skip
        started.append(LocalEngine("pagebus", generate))
    except Exception as e:  # still report the peers
        log.exception("pagebus failed")
        engines["pagebus"] = {"error": f"{type(e).__name__}: {e}"}
    if "run-batch" not in args.skip:
        # no prefix caching, as pagebus_generate and the peers: the process split compares like with like
        opts = argparse.Namespace(
            dtype=args.dtype, max_num_batched_tokens=2048, max_inflight=256, model=None,
            kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False, quantization=args.quantization,
        )  # fmt: skip
        engines["pagebus_run_batch"] = {"path": "run-batch"} | meta
        started.append(RunBatchEngine("pagebus_run_batch", opts))
    peer_dir = Path(args.peer_dir).expanduser()
    for peer in args.peers:
        manifest = load_manifest(peer_dir, peer)
        if manifest is None:
            engines[peer] = {"skipped": NOT_SET_UP, "peer_dir": str(peer_dir)}
            continue
        for name, cfg in peer_configs(peer, manifest, args).items():
            log.info("%s: loading %s", name, cfg["model"])
            load = _load()  # the machine may be shared: record how busy it was as each engine started
            try:
                cmd = [manifest["python"], str(RUNNERS / f"{peer}_runner.py")]
                eng = PeerEngine(name, cmd, peer_env(manifest), job | cfg, args.peer_timeout)
            except EngineFailed as e:
                engines[name] = {"error": str(e), "model": cfg["model"]}
                continue
            closers.append(eng)
            engines[name] = {"loadavg_1m_at_start": load} | eng.loaded | {"model": cfg["model"]}
            started.append(eng)
    return started


def measure_engines(
    args: argparse.Namespace, job: dict[str, Any], sizes: list[int]
) -> dict[str, dict[str, Any]]:
    """Every engine's offline and single-stream figures, timed in interleaved rounds
    (bench/interleave.py), with what each engine reported at load."""
    engines: dict[str, dict[str, Any]] = {}
    closers: list[Any] = []
    try:
        started = start_engines(args, job, engines, closers)
        runs = Interleaved(
            started, args.rounds, single_rounds=args.single_rounds, probe=ceilings.memory_probe
        )
        log.info("offline: %s x %d in x %d out, %d rounds of %s", sizes, args.input_len, args.output_len,
                 args.rounds, [e.name for e in started])  # fmt: skip
        runs.run_offline(job["prompts"], sizes, job["output_len"])
        log.info("single stream: %d rounds", args.single_rounds)
        runs.run_single(job["single_prompt"], job["single_output_len"])
        for name, res in runs.results().items():
            engines[name] = {k: v for k, v in engines[name].items() if "error" not in res} | res
        if "offline_by_size" in engines.get("pagebus_run_batch", {}):
            engines["pagebus_run_batch"]["interleaved_with"] = [
                e.name for e in started if e.name != "pagebus_run_batch"
            ]
    finally:
        for c in reversed(closers):  # release their threads and processes before the next part
            (c.shutdown if hasattr(c, "shutdown") else c.close)()
    return engines


# --------------------------------------------------------------------------------------------- peers
def llamacpp_formats(requested: list[str] | None, bf16_native: bool, manifest: dict[str, Any]) -> list[str]:
    """The GGUFs worth trying on this machine: BF16 only where bf16 is native."""
    formats = requested or ["f32", "f16", "q8_0", "q4_1"] + (["bf16"] if bf16_native else [])
    return [f for f in formats if f in manifest["models"]]


def peer_configs(peer: str, manifest: dict[str, Any], opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """name -> (model, options) for each configuration of a peer that is set up."""
    m = manifest["models"]
    if peer == "hf":
        return {"hf": {"model": m["hf_dir"], "options": {"threads": opts.threads, "dtype": opts.dtype}}}
    if peer == "llamacpp":
        options = {
            "threads": opts.threads, "n_batch": opts.llamacpp_n_batch, "n_ubatch": opts.llamacpp_n_ubatch,
            "ctx_per_seq": opts.ctx_per_seq,
        }  # fmt: skip
        formats = llamacpp_formats(opts.llamacpp_formats, opts.bf16_native, manifest)
        return {f"llamacpp_{q}": {"model": m[q], "options": options | {"format": q}} for q in formats}
    return {
        "vllm": {
            "model": m["hf_dir"],
            "options": {"enforce_eager": not opts.vllm_compiled, "dtype": opts.dtype},
        }
    }


def run_peer(peer: str, manifest: dict[str, Any], job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one peer's driver with its venv's python; its stderr is relayed to ours."""
    cmd = [manifest["python"], str(RUNNERS / f"{peer}_runner.py")]
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=peer_env(manifest), cwd=RUNNERS,
    )  # fmt: skip
    tail: collections.deque[str] = collections.deque(maxlen=15)

    def relay() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(f"[{peer}] {line}")
            tail.append(line.rstrip())

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    try:
        out, _ = proc.communicate(json.dumps(job), timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    relay_thread.join(timeout=5)
    wall = round(time.perf_counter() - t, 1)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode}", "stderr_tail": list(tail)[-8:], "wall_s": wall}
    return json.loads(lines[-1]) | {"wall_s": wall}


# --------------------------------------------------------------------------------------------- model facts
def model_facts(dtype: str) -> dict[str, Any]:
    """The default model's shapes, its matmul weight count and bytes per token in `dtype`."""
    from pagebus.frontends.model_files import default_model_path
    from pagebus.workers.loader import read_config

    mc = read_config(default_model_path())
    dims = {
        "hidden": mc.hidden_size, "intermediate": mc.intermediate_size, "q_dim": mc.num_heads * mc.head_dim,
        "kv_dim": mc.num_kv_heads * mc.head_dim, "vocab": mc.vocab_size, "layers": mc.num_layers,
    }  # fmt: skip
    layer = sum(
        k * n
        for k, n in ceilings.layer_shapes(dims["hidden"], dims["intermediate"], dims["q_dim"], dims["kv_dim"])
    )
    # Every token reads every layer's weights and the whole lm_head (tied or not); the embedding
    # lookup reads one row. Norms are negligible.
    matmul_weights = dims["layers"] * layer + dims["vocab"] * dims["hidden"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return dims | {"layer_weights": layer, "matmul_weights": matmul_weights,
                   "weight_bytes_per_token": matmul_weights * itemsize}  # fmt: skip


def request_flops(m: dict[str, Any], input_len: int, output_len: int) -> int:
    """FLOPs of one greedy request: input_len + output_len - 1 token forwards through every layer
    (2 per weight) and causal attention (QK^T and PV: 4 x q_dim per key, keys = position + 1), and the
    lm_head on the output_len positions that sample."""
    tokens = input_len + output_len - 1
    linear = 2 * tokens * m["layers"] * m["layer_weights"]
    attention = 4 * m["q_dim"] * m["layers"] * tokens * (tokens + 1) // 2
    return linear + attention + 2 * output_len * m["hidden"] * m["vocab"]


# --------------------------------------------------------------------------------------------- targets
def fma_peak(ceil: dict[str, Any], dtype: str) -> float:
    """The cores' FMA peak in FLOP/s where it bounds pagebus's arithmetic (float32 runs), else 0."""
    return (ceil.get("fma_gflops_float32") or 0) * 1e9 if dtype == "float32" else 0.0


def p99_ttft_floor_s(w: serve_peers.Workload, model: dict[str, Any], fma_flops: float) -> float:
    """The least P99 TTFT a float32 engine could report for workload w on this machine: each
    prompt's prefill (request_flops with one output token) at the FMA peak, the prompts prefilled
    one at a time (the order that gives the least TTFTs), the first min(N, C) arriving together (the
    client starts C at once) and every later one alone (the best case). The percentile is the
    client's (numpy's linear one)."""
    one = request_flops(model, w.input_len, 1) / fma_flops
    first = min(w.num_prompts, w.concurrency)
    ttfts = [i * one for i in range(1, first + 1)] + [one] * (w.num_prompts - first)
    if len(ttfts) == 1:
        return ttfts[0]
    return statistics.quantiles(ttfts, n=100, method="inclusive")[98]


def add_ttft_floors(
    served: dict[str, Any], workloads: list[serve_peers.Workload], model: dict[str, Any], fma_flops: float
) -> None:
    """Beside each workload's P99 TTFT ratio: its floor here (p99_ttft_floor_s) and that floor over
    what the target allows (target x the best peer's P99): above 1, no float32 engine meets it here."""
    for w in workloads:
        entry = (served.get(w.name) or {}).get("p99_ttft")
        if not entry:
            continue
        floor_ms = p99_ttft_floor_s(w, model, fma_flops) * 1e3
        best_peer_ms = served[w.name]["pagebus_p99_ttft_ms"] / entry["ratio"]
        entry["floor_ms"] = round(floor_ms, 1)
        entry["floor_over_allowed"] = round(floor_ms / (entry["target"] * best_peer_ms), 3)


def bandwidth_fraction(r: dict[str, Any], weight_bytes: int, kind: str) -> float | None:
    """The median over single-stream rounds of weight bytes read a second / the memory's `kind`
    GB/s measured around that round (None without those measurements)."""
    single = r.get("single") or {}
    rates, bw = (
        single.get("decode_runs_tokens_per_s") or [],
        (single.get("bandwidth_runs_gb_per_s") or {}).get(kind),
    )
    if not rates or not bw or len(bw) != len(rates):
        return None
    return round(statistics.median([t * weight_bytes / (g * 1e9) for t, g in zip(rates, bw, strict=True)]), 3)


def _tps(r: dict[str, Any], n: int | None = None) -> float | None:
    if n is None:
        return (r.get("single") or {}).get("decode_tokens_per_s")
    return ((r.get("offline_by_size") or {}).get(str(n)) or {}).get("output_tokens_per_s")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(engines: dict[str, dict[str, Any]], sizes: list[int]) -> dict[str, dict[str, float | None]]:
    """pagebus (LLM.generate) / each peer that ran: offline per size and single stream decode paired
    by round (bench/interleave.py paired), single stream end to end as the ratio of the medians."""
    pb = engines.get("pagebus", {})
    out = {}
    for name, r in engines.items():
        if name.startswith("pagebus") or "error" in r or "skipped" in r:
            continue
        out[name] = {f"offline_{n}_output_tokens_per_s": paired(pb, r, n) for n in sizes} | {
            "single_decode_tokens_per_s": paired(pb, r, None),
            "single_output_tokens_per_s": ratio(
                pb.get("single", {}).get("output_tokens_per_s"), r.get("single", {}).get("output_tokens_per_s")
            ),
        }  # fmt: skip
    return out


def targets(
    engines: dict[str, dict[str, Any]], ceil: dict[str, Any], model: dict[str, Any], opts: argparse.Namespace
) -> dict[str, Any]:
    pb, batch = engines.get("pagebus", {}), engines.get("pagebus_run_batch", {})
    flops_peak = ceil["matmul_gflops"][opts.dtype][f"square_{opts.ceiling_square}"] * 1e9
    fma = fma_peak(ceil, opts.dtype)
    llamacpp = {n: r for n, r in engines.items() if n.startswith("llamacpp_")}
    offline = {}
    for n in opts.num_requests:
        work_flops = n * request_flops(model, opts.input_len, opts.output_len)
        best = max(llamacpp, key=lambda k: _tps(llamacpp[k], n) or 0, default=None)
        per_path = {"llm": pb, "run_batch": batch}
        # the peers' fractions too: 1.5x a peer asks for 1.5x its fraction of the same ceiling
        peers = {"vllm": engines.get("vllm", {}), "llamacpp_best": llamacpp[best] if best else {}}
        elapsed = {
            k: ((r.get("offline_by_size") or {}).get(str(n)) or {}).get("elapsed_s")
            for k, r in (per_path | peers).items()
        }
        offline[str(n)] = {
            "output_tokens_per_s": {k: _tps(r, n) for k, r in per_path.items()},
            "vs_vllm": {k: paired(r, engines.get("vllm", {}), n) for k, r in per_path.items()},
            "vs_llamacpp_best": {"engine": best if best and _tps(llamacpp[best], n) else None}
            | {k: paired(r, llamacpp[best], n) if best else None for k, r in per_path.items()},
            "workload_gflop": round(work_flops / 1e9, 1),
            "compute_ceiling_gflops": round(flops_peak / 1e9, 1),
            "compute_fraction": {k: round(work_flops / t / flops_peak, 3) if t else None for k, t in elapsed.items()},
        }  # fmt: skip
        if fma:  # the same against the FMA peak, and the share of it each 1.5x target asks of pagebus
            fraction = {k: round(work_flops / t / fma, 3) if t else None for k, t in elapsed.items()}
            offline[str(n)] |= {
                "fma_peak_gflops": round(fma / 1e9, 1),
                "fma_fraction": fraction,
                "fma_fraction_for_target": {
                    k: round(TARGET_OFFLINE_RATIO * f, 3) if f else None
                    for k, f in fraction.items() if k in peers
                },
            }  # fmt: skip
    same = f"llamacpp_{SAME_PRECISION_GGUF[weight_dtype(opts)]}"
    dram, per_token = ceil["dram_gb_per_s"] * 1e9, model["weight_bytes_per_token"]
    decode = _tps(pb)
    at_start = round(decode * per_token / dram, 3) if decode else None
    single = {
        "decode_tokens_per_s": decode,
        "vs_llamacpp_same_precision": {"engine": same, "ratio": paired(pb, engines.get(same, {}), None)},
        "vs_llamacpp_f16": paired(pb, engines.get("llamacpp_f16", {}), None),
        "weight_bytes_per_token": per_token,
        "dram_gb_per_s": ceil["dram_gb_per_s"],
        "bandwidth_ceiling_tokens_per_s": round(dram / per_token, 1),
        # the copy measured around each round (interleave.run_single), else the one at the start
        "bandwidth_fraction": bandwidth_fraction(pb, per_token, "copy") or at_start,
        "bandwidth_fraction_of_read": bandwidth_fraction(pb, per_token, "read"),
        "bandwidth_fraction_start_ceiling": at_start,
    }
    split = {str(n): paired(batch, pb, n) for n in opts.num_requests}
    return {
        "offline": offline,
        "single": single,
        "process_split": split | {"target": TARGET_PROCESS_SPLIT,
                                  "met": all(v is not None and v >= TARGET_PROCESS_SPLIT for v in split.values())},
    }  # fmt: skip


def weight_dtype(opts: argparse.Namespace) -> str:
    """The dtype pagebus holds its weights in: float16 with --quantization fp16, else --dtype's."""
    return "float16" if opts.quantization == "fp16" else opts.dtype


def pagebus_flags(opts: argparse.Namespace) -> list[str]:
    """The weight and KV cache options of this run, as `pagebus serve` flags."""
    flags = ["--kv-cache-dtype", opts.kv_cache_dtype]
    return flags + (["--quantization", opts.quantization] if opts.quantization else [])


def measure_startup(opts: argparse.Namespace, runs: int) -> dict[str, Any]:
    """`pagebus serve` on the default model from exec to its first answer, `runs` times (the first
    may read the model from disk, later ones from the page cache); the split it logs each time."""
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="startup.") as d:
        for i in range(runs):
            port = free_port()
            cmd = serve_peers.pagebus_cmd(opts.dtype, port, pagebus_flags(opts))
            try:
                srv = serve_peers.start_server(f"pagebus_{i}", cmd, None, port, Path(d), 600.0)
            except RuntimeError as e:
                out.append({"error": str(e)})
                continue
            serve_peers.stop_server(srv)
            out.append({"ready_s": srv.ready_s, "split_s": serve_peers.startup_split(srv.log_path)})
    ready = [r["ready_s"] for r in out if "ready_s" in r]
    best = min(ready, default=None)
    return {"runs": out, "ready_s": best, "target_s": TARGET_STARTUP_S,
            "met": best is not None and best < TARGET_STARTUP_S}  # fmt: skip


# --------------------------------------------------------------------------------------------- check
def check(doc: dict[str, Any], floors: dict[str, Any]) -> dict[str, Any]:
    """Each floor is "dotted.path.into.the.json": {"min": x} or {"max": x}; a missing value (a peer
    not set up, a part skipped) is listed as unchecked, not failed."""
    failures, unchecked, passed = [], [], []
    for path, bound in floors.items():
        if path.startswith("_"):
            continue
        value: Any = doc
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            unchecked.append(path)
        elif ("min" in bound and value < bound["min"]) or ("max" in bound and value > bound["max"]):
            failures.append({"path": path, "value": value} | bound)
        else:
            passed.append(path)
    return {"floors": str(FLOORS), "passed": passed, "failures": failures, "unchecked": unchecked}


def machine(ceil: dict[str, Any]) -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu_model": ceil["cpu"]["model"], "cpu_id": ceil["cpu"].get("id"), "cpu_flags": ceil["cpu"]["flags"],
        "cpus": os.cpu_count(),
        "mem_gib": mem_gib, "platform": platform.platform(), "python": platform.python_version(),
        "torch": ceil["torch"], "torch_cpu_capability": ceil["torch_cpu_capability"],
        "loadavg_1m_at_start": ceil["loadavg_1m_at_start"],
    }  # fmt: skip


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, nargs="+", default=[32, 64], help="offline batch sizes")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-input-len", type=int, default=32)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="pagebus's, HF's and vLLM's dtype; auto: bfloat16 where native, else float32")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float16"),
                    help="pagebus's KV cache (float16: llama.cpp's default KV type, half a float32 cache)")  # fmt: skip
    ap.add_argument("--quantization", default=None, choices=("fp16",),
                    help="pagebus's weights (fp16: float16 weights, float32 arithmetic, llama.cpp's F16; "
                    "single stream is then compared with llama.cpp's F16 GGUF)")  # fmt: skip
    ap.add_argument("--llamacpp-formats", nargs="+", default=None,
                    help="GGUFs to run (f32 f16 bf16 q8_0 q4_1); default: those worth trying here")  # fmt: skip
    ap.add_argument("--llamacpp-n-batch", type=int, default=2048, help="tokens per llama_decode call")
    ap.add_argument("--llamacpp-n-ubatch", type=int, default=2048, help="tokens per compute graph")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="HF's and llama.cpp's threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-timeout", type=float, default=1200.0, help="seconds per peer configuration")
    ap.add_argument("--ctx-per-seq", type=int, default=512, help="llama.cpp KV cells per sequence")
    ap.add_argument("--vllm-compiled", action="store_true", help="torch.compile vLLM (+64-96 s start)")
    ap.add_argument("--ceiling-seconds", type=float, default=1.0, help="time per ceiling measurement")
    ap.add_argument("--ceiling-square", type=int, default=2048, help="matmul size of the FLOP/s ceiling")
    ap.add_argument("--rounds", "--offline-repeats", type=positive_int, default=3, dest="rounds",
                    help="rounds of the offline part: each round times every engine once per size, the "
                         "order rotating; medians kept, ratios paired by round "
                         "(one run on these shared machines swings 10-30%%)")  # fmt: skip
    ap.add_argument("--single-rounds", type=positive_int, default=5,
                    help="the single stream's rounds (a few seconds each; more than the offline part's "
                         "since one disturbed run moves a 3-round median by 5-10%%)")  # fmt: skip
    ap.add_argument("--startup-runs", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=SKIPPABLE)
    ap.add_argument("--check", action="store_true", help=f"exit 1 when a floor of {FLOORS.name} is not met")
    serve_peers.add_args(ap, prefix="serve-")
    args = ap.parse_args()
    if args.single_rounds > 29:  # the single stream's prompt variants run out (_harness.single_plan)
        ap.error(f"--single-rounds: at most 29, got {args.single_rounds}")
    args.requested_dtype = args.dtype
    args.dtype = pick_dtype(args.dtype)
    args.pagebus_flags = pagebus_flags(args) + args.pagebus_flags  # served as run offline
    args.bf16_native = ceilings.native_bf16(ceilings.cpu_info()["flags"])
    longest = max(args.input_len + args.output_len, args.single_input_len + args.single_output_len)
    args.ctx_per_seq = max(args.ctx_per_seq, -(-longest // 256) * 256)
    return args


def main() -> None:
    setup_logging()
    args = parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model = model_facts(weight_dtype(args))
    log.info("ceilings (%.1f s each)", args.ceiling_seconds)
    # bf16 only where it is native: torch emulates it elsewhere, ~100x slower (minutes per product)
    dtypes = tuple(dict.fromkeys(("float32", args.dtype, *(("bfloat16",) if args.bf16_native else ()))))
    ceil = ceilings.measure(model, rows=(1, max(args.num_requests), 2048), square=args.ceiling_square,
                            min_s=args.ceiling_seconds, dtypes=dtypes)  # fmt: skip
    sizes = sorted(set(args.num_requests), key=args.num_requests.index)
    work = make_prompts(max(sizes), args.input_len, args.output_len, 0.0, args.seed)
    single = make_prompts(1, args.single_input_len, args.single_output_len, 0.0, args.seed + 1)[0][0]
    job = {
        "prompts": [ids for ids, _ in work], "output_len": args.output_len, "offline_sizes": sizes,
        "single_output_len": args.single_output_len, "single_prompt": single, "modes": ["offline", "single"],
    }  # fmt: skip
    engines = measure_engines(args, job, sizes)
    tgt = targets(engines, ceil, model, args)
    if "startup" not in args.skip:
        log.info("start-up of pagebus serve (%d runs)", args.startup_runs)
        tgt["startup"] = measure_startup(args, args.startup_runs)
    served = None
    if "served" not in args.skip:
        log.info("served: %s", [w.name for w in args.workloads])
        served = serve_peers.run(args)
        tgt["served"] = served["ratios"]
        if fma := fma_peak(ceil, args.dtype):
            add_ttft_floors(tgt["served"], args.workloads, model, fma)
    cfg = {k: v for k, v in vars(args).items() if k != "workloads"} | {
        "workloads": [w.name for w in args.workloads]
    }
    doc = {
        "bench": "peers",
        "date": started,
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "machine": machine(ceil),
        "ceilings": ceil,
        "model": model,
        "config": cfg | {"num_requests": sizes[0], "offline_sizes": sizes},
        "engines": engines,
        "ratios": ratios(engines, sizes),
        "targets": tgt,
    }  # fmt: skip
    if served is not None:
        doc["served"] = {"client": served["client"], "engines": served["engines"]}
    if args.check:
        doc["check"] = check(doc, json.loads(FLOORS.read_text()))
    emit(doc)
    if args.check and doc["check"]["failures"]:
        for f in doc["check"]["failures"]:
            log.error("floor not met: %s", f)
        sys.exit(1)


if __name__ == "__main__":
    main()
