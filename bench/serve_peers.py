"""Served benchmark: `pagebus serve` against vLLM's and llama.cpp's OpenAI servers, in one run.

    bench/setup_peers.sh                       # once: the peers' venvs (vLLM's holds the client)
    python -m bench.serve_peers [--engines pagebus vllm llamacpp] [--dtype auto]
        [--workloads 64x128x128@32 8x1024x64@1] [--llamacpp-formats q4_1] [--peer-dir DIR] [--rounds 2]

Each server starts in turn on a free 127.0.0.1 port with its best flags for the machine and is
polled until /v1/models answers (bounded); all stay up. Then, --rounds times, every workload runs
against each server in turn (the order rotating from round to round, each run on a settled
machine: bench/interleave.py), from vLLM's own benchmark client (`vllm bench serve --backend
openai --dataset-name random --ignore-eos --temperature 0` through
bench/peer_runners/vllm_bench_serve.py in the vLLM peer venv, tokenizer = the HF directory
setup_peers.sh writes); then every server is stopped. A workload NxINxOUT@C is N prompts of IN
random tokens, OUT output tokens each, at most C in flight. Each server's figures for a workload
are its round of the median tok/s, every round's under "rounds"; ratios are paired by round.
- pagebus: `pagebus serve --dtype D --no-enable-prefix-caching` (this repo's venv).
- vllm: `vllm.entrypoints.openai.api_server --dtype D --enforce-eager --no-enable-prefix-caching`
  (eager: torch.compile costs 64-96 s per start on 2 cores and its cache does not reload).
- llamacpp: `llama_cpp.server` (llama-cpp-python[server], through bench/peer_runners/llamacpp_server.py,
  which lets it accept the client's request ids) with each GGUF of --llamacpp-server-formats
  (default the Q4_1 original, llama.cpp's fastest format of this model); it runs one request at a
  time, which is how that server works.
D is --dtype (auto: bfloat16 where the CPU has native bf16, else float32), the same for pagebus and
vLLM. Without the vLLM peer, bench/serve.py's client (the same definitions) measures instead and
each result names its client. A server that fails to start is reported, not fatal; a peer not set up
is "skipped". ratios: pagebus / best peer per workload (output tok/s: higher is better, target
>= 1.5; P99 TTFT: lower is better, target <= 0.5), the median over rounds of the ratio within a
round. Prints one JSON object; logs on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import emit, log, setup_logging
from bench.interleave import rotated, wait_for_quiet
from bench.peer_runners.ceilings import cpu_info, native_bf16
from bench.ports import free_port

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
DEFAULT_PEER_DIR = "~/.cache/pagebus/peers"
NOT_SET_UP = "not set up; run bench/setup_peers.sh"
ENGINES = ("pagebus", "vllm", "llamacpp")
DEFAULT_WORKLOADS = ("64x128x128@32", "8x1024x64@1")
TARGET_OUTPUT_RATIO = 1.5  # pagebus output tok/s >= 1.5 x the best peer's
TARGET_TTFT_RATIO = 0.5  # pagebus P99 TTFT <= 0.5 x the best peer's
# pagebus's start-up log lines ("model loaded in 1.2s", "engine ready in 3.4s"): its split.
_SPLIT = re.compile(r"([a-z][a-z ]*?) (?:ready )?in ([\d.]+) ?s\b")


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.num_prompts}x{self.input_len}x{self.output_len}@{self.concurrency}"


def parse_workload(text: str) -> Workload:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)@(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"workload {text!r} is not NxINxOUT@CONCURRENCY")
    return Workload(*(int(g) for g in m.groups()))


def pick_dtype(requested: str) -> str:
    """auto: bfloat16 only where the CPU computes it natively, else float32 (bf16 is emulated)."""
    if requested != "auto":
        return requested
    return "bfloat16" if native_bf16(cpu_info()["flags"]) else "float32"


def load_manifest(peer_dir: Path, peer: str) -> dict[str, Any] | None:
    path = peer_dir / peer / "peer.json"
    return json.loads(path.read_text()) if path.is_file() else None


def peer_env(manifest: dict[str, Any]) -> dict[str, str]:
    """Our environment without PYTHONPATH (this repo is not the peer's), plus the peer's settings."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | manifest.get("env", {})


def _tail(path: Path, n: int = 15) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    base_url: str  # http://127.0.0.1:PORT (no /v1)
    log_path: Path
    model: str = ""  # the served model id, from /v1/models
    ready_s: float = 0.0


def start_server(
    name: str, cmd: list[str], env: dict[str, str] | None, port: int, log_dir: Path, deadline_s: float
) -> Server:
    """Start a server and poll /v1/models until it answers; RuntimeError (with its log tail) if it
    exits or misses the deadline. ready_s: from the exec to the first answer."""
    log_path = log_dir / f"{name}.log"
    log.info("%s: %s", name, shlex.join(cmd))
    t0 = time.perf_counter()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(name, proc, f"http://127.0.0.1:{port}", log_path)
    while time.perf_counter() - t0 < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{srv.base_url}/v1/models", timeout=2) as r:
                srv.model = json.loads(r.read())["data"][0]["id"]
                srv.ready_s = round(time.perf_counter() - t0, 2)
                return srv
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.2)  # polling a process we do not control, under a deadline
    stop_server(srv)
    raise RuntimeError(f"{name} did not answer within {deadline_s:.0f} s: {_tail(log_path)}")


def stop_server(srv: Server, grace_s: float = 60.0) -> None:
    """SIGTERM to the server, which stops its own children; then SIGKILL to whatever is left of its
    process group (its own session, so nothing else of ours)."""
    if srv.proc.poll() is None:
        srv.proc.terminate()
        try:
            srv.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0f s; killing it", srv.name, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)


def startup_split(log_path: Path) -> dict[str, float]:
    """Every "<what> in <seconds>s" the engine logged while starting."""
    split = {}
    for line in _tail(log_path, 400):
        if m := _SPLIT.search(line):
            split[m[1].strip()] = float(m[2])
    return split


def pagebus_cmd(dtype: str, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "pagebus.frontends.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--no-enable-prefix-caching", *extra,
    ]  # fmt: skip


def vllm_cmd(manifest: dict[str, Any], dtype: str, port: int, max_model_len: int) -> list[str]:
    return [
        manifest["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", manifest["models"]["hf_dir"],
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--no-enable-prefix-caching", "--seed", "0",
    ]  # fmt: skip


def llamacpp_cmd(
    manifest: dict[str, Any], fmt: str, port: int, n_ctx: int, opts: argparse.Namespace
) -> list[str]:
    return [
        manifest["python"], str(RUNNERS / "llamacpp_server.py"), "--model", manifest["models"][fmt],
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
        "--n_threads", str(opts.threads), "--n_threads_batch", str(opts.threads),
        "--n_batch", str(opts.llamacpp_n_batch), "--n_ubatch", str(opts.llamacpp_n_ubatch),
        "--use_mmap", "False",  # mmap reads stall on these VMs; hold the weights in RAM
        "--disable_ping_events", "True",  # SSE comment lines between chunks; not every client skips them
        "--interrupt_requests", "False",  # queue concurrent requests; by default a new one aborts the running one
    ]  # fmt: skip


def _ms(d: dict[str, Any], metric: str) -> dict[str, float | None]:
    keys = {"p50": f"median_{metric}_ms", "p99": f"p99_{metric}_ms", "mean": f"mean_{metric}_ms"}
    return {k: None if d.get(v) is None else round(d[v], 2) for k, v in keys.items()}


def run_vllm_client(
    vllm: dict[str, Any], srv: Server, w: Workload, out_dir: Path, timeout_s: float, seed: int
) -> dict[str, Any]:
    """vLLM's benchmark client against srv; its result JSON, reduced to what we compare."""
    fname = f"{srv.name}_{w.name.replace('@', '_c')}.json"
    cmd = [
        vllm["python"], str(RUNNERS / "vllm_bench_serve.py"), "--backend", "openai", "--base-url", srv.base_url,
        "--endpoint", "/v1/completions", "--model", srv.model, "--tokenizer", vllm["models"]["hf_dir"],
        "--dataset-name", "random", "--random-input-len", str(w.input_len),
        "--random-output-len", str(w.output_len), "--num-prompts", str(w.num_prompts),
        "--max-concurrency", str(w.concurrency), "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", fname,
    ]  # fmt: skip
    if srv.name.startswith("llamacpp"):
        # llama_cpp.server has no ignore_eos: min_tokens holds EOS back instead. Its default
        # repeat_penalty 1.1 would make it the only engine not greedy.
        cmd += ["--extra-body", json.dumps({"min_tokens": w.output_len, "repeat_penalty": 1.0})]
    log.info("client: %s", shlex.join(cmd))
    with open(out_dir / f"{fname}.log", "wb") as out:
        proc = subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=peer_env(vllm), timeout=timeout_s, cwd=RUNNERS
        )
    if proc.returncode != 0 or not (out_dir / fname).is_file():
        raise RuntimeError(
            f"vllm.benchmarks.serve exited {proc.returncode}: {_tail(out_dir / f'{fname}.log')}"
        )
    d = json.loads((out_dir / fname).read_text())
    return {
        "client": "vllm.benchmarks.serve",
        "completed": d.get("completed"),
        "failed": d.get("failed", w.num_prompts - (d.get("completed") or 0)),
        "errors": sorted({e for e in d.get("errors") or [] if e})[:3],
        "duration_s": round(d["duration"], 3),
        "total_input_tokens": d.get("total_input_tokens"),
        "total_output_tokens": d.get("total_output_tokens"),
        "output_throughput": round(d["output_throughput"], 2),
        "ttft_ms": _ms(d, "ttft"),
        "tpot_ms": _ms(d, "tpot"),
        "itl_ms": _ms(d, "itl"),
        "e2el_ms": _ms(d, "e2el"),
    }


def run_own_client(srv: Server, w: Workload, timeout_s: float, seed: int) -> dict[str, Any]:
    """bench/serve.py's client (vLLM's definitions) where vLLM's is not installed."""
    from bench import serve

    args = argparse.Namespace(
        model_name=srv.model, num_requests=w.num_prompts, input_len=w.input_len, output_len=w.output_len,
        seed=seed, api_key=None, base_url=f"{srv.base_url}/v1", slo=[],
    )  # fmt: skip
    r = asyncio.run(asyncio.wait_for(serve.run_level(args, w.concurrency, None), timeout_s))
    keep = {
        k: r[k] for k in ("completed", "failed", "duration_s", "total_output_tokens", "output_throughput")
    }
    pick = lambda d: {k: round(d[k], 2) for k in ("p50", "p99", "mean")}  # noqa: E731
    out = {"client": "bench.serve", **keep, "errors": r["errors"]}
    return (
        out
        | {f"{m}_ms": pick(r[f"{m}_ms"]) for m in ("ttft", "tpot", "itl")}
        | {"e2el_ms": pick(r["e2e_ms"])}
    )


def server_configs(opts: argparse.Namespace, peer_dir: Path, max_len: int) -> list[tuple[str, Any]]:
    """(name, cmd builder or a reason it is skipped) for each server to measure, in order."""
    out: list[tuple[str, Any]] = []
    for engine in opts.engines:
        if engine == "pagebus":
            out.append(("pagebus", lambda port: (pagebus_cmd(opts.dtype, port, opts.pagebus_flags), None)))
            continue
        manifest = load_manifest(peer_dir, engine)
        if engine == "vllm":
            out.append(("vllm", {"skipped": NOT_SET_UP} if manifest is None else
                        lambda port, m=manifest: (vllm_cmd(m, opts.dtype, port, max_len), peer_env(m))))  # fmt: skip
            continue
        for fmt in opts.llamacpp_server_formats:
            name = f"llamacpp_{fmt}"
            if manifest is None or fmt not in manifest["models"]:
                out.append((name, {"skipped": NOT_SET_UP}))
            else:
                out.append((name, lambda port, m=manifest, f=fmt: (llamacpp_cmd(m, f, port, max_len, opts), peer_env(m))))  # fmt: skip
    return out


def start_one(
    name: str, build: Any, opts: argparse.Namespace, out_dir: Path
) -> tuple[Server | None, dict[str, Any]]:
    """The server started and what its start says (command, model, ready_s, pagebus's split), or
    None and its error."""
    port = free_port()
    cmd, env = build(port)
    try:
        srv = start_server(name, cmd, env, port, out_dir, opts.ready_timeout)
    except RuntimeError as e:
        log.error("%s", e)
        return None, {"error": str(e), "command": shlex.join(cmd)}
    result: dict[str, Any] = {"command": shlex.join(cmd), "model": srv.model, "ready_s": srv.ready_s}
    if name == "pagebus":
        result["startup_split_s"] = startup_split(srv.log_path)
    return srv, result


def serve_once(
    srv: Server, w: Workload, opts: argparse.Namespace, vllm: dict[str, Any] | None, out_dir: Path
) -> dict[str, Any]:
    """One client run of workload w against srv: its figures, or its error."""
    load = round(os.getloadavg()[0], 2)
    try:
        if vllm is not None:
            r = run_vllm_client(vllm, srv, w, out_dir, opts.client_timeout, opts.seed)
        else:
            r = run_own_client(srv, w, opts.client_timeout, opts.seed)
    except (RuntimeError, subprocess.TimeoutExpired, TimeoutError) as e:
        log.error("%s %s: %s", srv.name, w.name, e)
        r = {"error": f"{type(e).__name__}: {e}"}
    log.info("%s %s: %s tok/s, P99 TTFT %s ms", srv.name, w.name, r.get("output_throughput"),
             r.get("ttft_ms", {}).get("p99"))  # fmt: skip
    return {"loadavg_1m_at_start": load} | r


def _p99(r: dict[str, Any]) -> float | None:
    return (r.get("ttft_ms") or {}).get("p99")


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A workload's figures over its rounds: the round of the median output tok/s (the lower of
    the middle two), with every round's tok/s and P99 TTFT under "rounds" (None where it failed)."""
    ok = sorted((r for r in runs if r.get("output_throughput")), key=lambda r: r["output_throughput"])
    rounds = [{"output_throughput": r.get("output_throughput"), "p99_ttft_ms": _p99(r)} for r in runs]
    return (ok[(len(ok) - 1) // 2] if ok else runs[-1]) | {"rounds": rounds}


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float | None:
    """The median over rounds of a's figure / b's in the same round."""
    pairs = [(x[key], y[key]) for x, y in zip(a, b, strict=False) if x.get(key) and y.get(key)]
    return round(statistics.median([x / y for x, y in pairs]), 3) if pairs else None


def _ratio(pb: dict[str, Any], peer: dict[str, Any], key: str, unpaired: float) -> float:
    paired = _paired(pb.get("rounds") or [], peer.get("rounds") or [], key)
    return paired if paired is not None else round(unpaired, 3)


def ratios(engines: dict[str, dict[str, Any]], workloads: list[Workload]) -> dict[str, Any]:
    """Per workload: pagebus / the best peer, for output tok/s and for P99 TTFT; paired by round
    (the median of the ratios within a round) where both carry rounds, else their figures'."""
    out: dict[str, Any] = {}
    for w in workloads:
        by_engine = {n: r.get(w.name, {}) for n, r in engines.items()}
        pb = by_engine.pop("pagebus", {})
        peers = {n: r for n, r in by_engine.items() if r.get("output_throughput")}
        entry: dict[str, Any] = {"pagebus_output_throughput": pb.get("output_throughput"),
                                 "pagebus_p99_ttft_ms": _p99(pb)}  # fmt: skip

        if peers and entry["pagebus_output_throughput"]:
            best_tp = max(peers, key=lambda n: peers[n]["output_throughput"])
            r = _ratio(pb, peers[best_tp], "output_throughput",
                       entry["pagebus_output_throughput"] / peers[best_tp]["output_throughput"])  # fmt: skip
            entry["output_throughput"] = {"best_peer": best_tp, "ratio": r, "target": TARGET_OUTPUT_RATIO,
                                          "met": r >= TARGET_OUTPUT_RATIO}  # fmt: skip
        ttfts = {n: t for n, p in peers.items() if (t := _p99(p))}
        if ttfts and entry["pagebus_p99_ttft_ms"]:
            best_ttft = min(ttfts, key=lambda n: ttfts[n])
            r = _ratio(pb, peers[best_ttft], "p99_ttft_ms", entry["pagebus_p99_ttft_ms"] / ttfts[best_ttft])
            entry["p99_ttft"] = {"best_peer": best_ttft, "ratio": r, "target": TARGET_TTFT_RATIO,
                                 "met": r <= TARGET_TTFT_RATIO}  # fmt: skip
        out[w.name] = entry
    return out


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Every server, every workload; the "engines" and "ratios" of the JSON. The servers start one
    after another and stay up; then each round runs every workload against each server in turn,
    the order rotating, each run on a settled machine (bench/interleave.py): these VMs' memory
    speed changes by ~30% within seconds, and servers timed minutes apart compared those moments
    (one engine's code read 1.59x and 1.49x vLLM's served tok/s in two runs 35 minutes apart)."""
    peer_dir = Path(opts.peer_dir).expanduser()
    vllm = load_manifest(peer_dir, "vllm") if opts.client in ("auto", "vllm") else None
    if opts.client == "vllm" and vllm is None:
        raise SystemExit(f"--client vllm: the vLLM peer is {NOT_SET_UP}")
    longest = max(w.input_len + w.output_len for w in opts.workloads)
    max_len = max(2048, -(-(longest + 64) // 256) * 256)  # the client's re-tokenized text may run long
    engines: dict[str, dict[str, Any]] = {}
    live: dict[str, Server] = {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="serve_peers.") as d:
        try:
            for name, build in server_configs(opts, peer_dir, max_len):
                if isinstance(build, dict):
                    engines[name] = build
                    continue
                srv, engines[name] = start_one(name, build, opts, Path(d))
                if srv is not None:
                    live[name], runs[name] = srv, {w.name: [] for w in opts.workloads}
                    engines[name] |= {"settle_s_max": 0.0, "runs_begun_busy": 0}
            for r in range(opts.serve_rounds):
                for w in opts.workloads:
                    for name in rotated(list(live), r):
                        waited, quiet = wait_for_quiet()
                        e = engines[name]
                        e["settle_s_max"] = max(e["settle_s_max"], round(waited, 2))
                        e["runs_begun_busy"] += not quiet
                        runs[name][w.name].append(serve_once(live[name], w, opts, vllm, Path(d)))
                        if live[name].proc.poll() is not None:
                            rc = live[name].proc.returncode
                            e["error"] = f"exited with {rc} while serving: {_tail(live[name].log_path)}"
                            stop_server(live.pop(name))
        finally:
            for srv in live.values():
                stop_server(srv)
    for name, by_workload in runs.items():
        for wname, got in by_workload.items():
            if got:
                engines[name][wname] = median_round(got)
    return {"client": "vllm.benchmarks.serve" if vllm else "bench.serve", "engines": engines,
            "ratios": ratios(engines, opts.workloads)}  # fmt: skip


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def add_args(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """The options, shared with bench/peers.py (which passes prefix="serve-" for the ambiguous ones)."""
    ap.add_argument(f"--{prefix}workloads", dest="workloads", nargs="+", type=parse_workload,
                    default=[parse_workload(w) for w in DEFAULT_WORKLOADS], help="NxINxOUT@CONCURRENCY")  # fmt: skip
    ap.add_argument(f"--{prefix}engines", dest="engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--llamacpp-server-formats", dest="llamacpp_server_formats", nargs="+", default=["q4_1"],
                    help="GGUFs (setup_peers.sh names: q4_1 f32 f16 bf16 q8_0) llama.cpp's server runs")  # fmt: skip
    ap.add_argument("--pagebus-serve-flags", dest="pagebus_flags", type=shlex.split, default=[],
                    help="extra flags for pagebus serve, one quoted string")  # fmt: skip
    ap.add_argument("--client", choices=("auto", "vllm", "bench"), default="auto",
                    help="auto: vLLM's client where the vLLM peer is set up, else bench/serve.py's")  # fmt: skip
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a server to answer")
    ap.add_argument("--client-timeout", type=float, default=1800.0, help="seconds per workload")
    ap.add_argument(f"--{prefix}rounds", dest="serve_rounds", type=positive_int, default=2,
                    help="rounds: each runs every workload against each server in turn, ratios paired by round")  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    ap.add_argument("--llamacpp-n-batch", type=int, default=2048)
    ap.add_argument("--llamacpp-n-ubatch", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.dtype = pick_dtype(args.dtype)
    return args


def main() -> None:
    setup_logging()
    args = parse_args()
    res = run(args)
    cfg = {k: v for k, v in vars(args).items() if k != "workloads"} | {
        "workloads": [w.name for w in args.workloads]
    }
    emit({
        "bench": "serve_peers",
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "machine": cpu_info(),
        "config": cfg,
        **res,
    })  # fmt: skip


if __name__ == "__main__":
    main()
