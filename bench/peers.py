"""pagebus side by side with the engines users would pick instead, on the same prompts.

    bench/setup_peers.sh                      # once: each peer in its own venv (~10 min)
    python -m bench.peers [--num-requests 32] [--input-len 128] [--output-len 128]
        [--single-output-len 128] [--peers hf llamacpp vllm] [--peer-dir ~/.cache/pagebus/peers]

Two workloads, both greedy with EOS ignored, timed by one protocol (bench/peer_runners/_harness.py):
- offline: --num-requests prompts submitted at once; output tok/s over the whole batch.
- single: one request alone; decode tok/s = (n - 1) / (t_n - t_1), and end-to-end tok/s.
pagebus runs in this process (bf16 by default); each peer runs its driver under its own venv's python.
llama.cpp runs twice: the BF16 rewrite of the model (same weights as pagebus) and the Q4_1 original.
A peer not set up is "skipped"; a peer that fails carries its error. ratios: pagebus / peer, so
> 1 means pagebus is faster. Prints one JSON object; logs on stderr.
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
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import emit, log, setup_logging
from bench.peer_runners._harness import Generate, measure
from bench.throughput import make_prompts

RUNNERS = Path(__file__).resolve().parent / "peer_runners"
PEERS = ("hf", "llamacpp", "vllm")
DEFAULT_PEER_DIR = "~/.cache/pagebus/peers"
NOT_SET_UP = "not set up; run bench/setup_peers.sh"


def pagebus_generate(dtype: str) -> tuple[Generate, Any]:
    from pagebus import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, seed=0, enable_prefix_caching=False)  # as the peers: no cache hits

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


def run_pagebus(job: dict[str, Any], dtype: str) -> dict[str, Any]:
    t = time.perf_counter()
    generate, llm = pagebus_generate(dtype)
    result = {"engine": "pagebus", "version": _pagebus_version(), "dtype": dtype}
    result["load_s"] = round(time.perf_counter() - t, 2)
    try:
        return result | measure(job, generate)
    finally:
        if hasattr(llm, "shutdown"):  # release its threads/processes before the peers take the cores
            llm.shutdown()


def peer_configs(peer: str, manifest: dict[str, Any], opts: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """name -> (model, options) for each configuration of a peer that is set up."""
    m = manifest["models"]
    if peer == "hf":
        return {"hf": {"model": m["hf_dir"], "options": {"threads": 2}}}
    if peer == "llamacpp":
        options = {"threads": 2, "n_batch": 2048, "ctx_per_seq": opts.ctx_per_seq}
        return {f"llamacpp_{q}": {"model": m[q], "options": options} for q in ("bf16", "q4_1") if q in m}
    return {"vllm": {"model": m["hf_dir"], "options": {"enforce_eager": not opts.vllm_compiled}}}


def run_peer(peer: str, manifest: dict[str, Any], job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one peer's driver with its venv's python; its stderr is relayed to ours."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | manifest.get("env", {})
    cmd = [manifest["python"], str(RUNNERS / f"{peer}_runner.py")]
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=RUNNERS,
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


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    pb = engines.get("pagebus", {})
    out = {}
    for name, r in engines.items():
        if name == "pagebus" or "error" in r or "skipped" in r:
            continue
        out[name] = {
            "offline_output_tokens_per_s": ratio(
                pb.get("offline", {}).get("output_tokens_per_s"), r.get("offline", {}).get("output_tokens_per_s")
            ),
            "single_decode_tokens_per_s": ratio(
                pb.get("single", {}).get("decode_tokens_per_s"), r.get("single", {}).get("decode_tokens_per_s")
            ),
            "single_output_tokens_per_s": ratio(
                pb.get("single", {}).get("output_tokens_per_s"), r.get("single", {}).get("output_tokens_per_s")
            ),
        }  # fmt: skip
    return out


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine() -> dict[str, Any]:
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
        "mem_gib": mem_gib, "loadavg_1m_at_start": _load(),
    }  # fmt: skip


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS)
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--dtype", default="bfloat16", help="pagebus's dtype (the peers run bf16 too)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-timeout", type=float, default=900.0, help="seconds per peer configuration")
    ap.add_argument("--ctx-per-seq", type=int, default=512, help="llama.cpp KV cells per sequence")
    ap.add_argument("--vllm-compiled", action="store_true", help="torch.compile vLLM (+64-96 s start)")
    args = ap.parse_args()
    longest = args.input_len + max(args.output_len, args.single_output_len)
    args.ctx_per_seq = max(args.ctx_per_seq, -(-longest // 256) * 256)
    return args


def main() -> None:
    setup_logging()
    args = parse_args()
    work = make_prompts(args.num_requests, args.input_len, args.output_len, 0.0, args.seed)
    job = {
        "prompts": [ids for ids, _ in work], "output_len": args.output_len,
        "single_output_len": args.single_output_len, "modes": ["offline", "single"],
    }  # fmt: skip
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    engines: dict[str, dict[str, Any]] = {}
    log.info("pagebus: %d x %d in x %d out", args.num_requests, args.input_len, args.output_len)
    try:
        engines["pagebus"] = {"loadavg_1m_at_start": _load()} | run_pagebus(job, args.dtype)
    except Exception as e:  # still report the peers
        log.exception("pagebus failed")
        engines["pagebus"] = {"error": f"{type(e).__name__}: {e}"}
    peer_dir = Path(args.peer_dir).expanduser()
    for peer in args.peers:
        manifest_path = peer_dir / peer / "peer.json"
        if not manifest_path.is_file():
            engines[peer] = {"skipped": NOT_SET_UP, "peer_dir": str(peer_dir)}
            continue
        manifest = json.loads(manifest_path.read_text())
        for name, cfg in peer_configs(peer, manifest, args).items():
            log.info("%s: %s", name, cfg["model"])
            load = _load()  # the machine may be shared: record how busy it was as each engine started
            result = run_peer(peer, manifest, job | cfg, args.peer_timeout)
            engines[name] = {"loadavg_1m_at_start": load} | result | {"model": cfg["model"]}
    emit({
        "bench": "peers",
        "date": started,
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "machine": machine(),
        "config": {k: getattr(args, k) for k in vars(args)},
        "engines": engines,
        "ratios": ratios(engines),
    })  # fmt: skip


if __name__ == "__main__":
    main()
