"""End-to-end GPU check: a random-weight Llama-3-8B-shaped model, driven in-process.

    python -m bench.gpu_e2e [--tiny] [--concurrency 1 32 256] [--json-out PATH]

Builds the model from a config.json alone (load_format=dummy, bf16; no checkpoint, no
tokenizer) and drives the Scheduler and ModelRunner classes directly with token-id prompts,
as the in-process engine does. Reports decode output tok/s at each concurrency, with CUDA
graphs on and off, against the HBM roofline (weight bytes + KV bytes read per step over the
measured copy bandwidth), and prefill tok/s against the tensor-core roofline (the measured
bf16 matmul rate); both ceilings are measured in the same run. `--tiny` runs a tiny model
on whatever device there is (the CPU in tests), so the logic is exercised anywhere.

Prints one JSON object and writes it to --json-out, else to $OUT/gpu_check.json when $OUT is
set. `--combine DIR` instead merges the parts bench/gpu_check.sh left in DIR into that JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

log = logging.getLogger("bench.gpu_e2e")

LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)


def write_llama_config(folder: str, shape: dict[str, Any]) -> str:
    """An HF Llama config.json in folder (nothing else): what load_format=dummy needs."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **shape,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return folder


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ceilings(device: Any, tiny: bool) -> dict[str, float]:
    """Memory bandwidth (a large device-to-device copy: read + write) and bf16 matmul FLOP/s."""
    import torch

    n_bytes = (64 << 20) if tiny else (4 << 30)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    reps = 3 if tiny else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    bw = 2 * n_bytes * reps / (time.perf_counter() - t0)
    del src, dst
    n = 256 if tiny else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    a @ b
    _sync(device)
    reps = 3 if tiny else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    return {"copy_bandwidth_gb_s": bw / 1e9, "matmul_bf16_tflop_s": flops / 1e12}


class Engine:
    """The Scheduler + ModelRunner pair, stepped by hand with token-id prompts."""

    def __init__(self, runner: Any, cfg: Any) -> None:
        self.runner = runner
        self.cfg = cfg
        self.rng = random.Random(0)
        self.vocab = runner.model_config.vocab_size
        self._next = 0
        self.sched: Any = None

    def reset(self) -> None:
        """After a failed run: a fresh scheduler, and the runner forgets every sequence."""
        from pagebus.bus.messages import ExecuteBatch

        self.sched = None
        self.runner.execute(ExecuteBatch(0, [], [], list(self.runner.seqs)))

    def run(self, num_seqs: int, prompt_len: int, output_len: int) -> dict[str, Any]:
        """Run num_seqs requests to completion; time prefill steps and full-batch decode steps
        separately (each step ends with its sampled ids on the host, so wall time is honest)."""
        from pagebus.bus.messages import AddRequest, SamplingParams
        from pagebus.scheduler.scheduler import Scheduler

        r = self.runner
        # One scheduler for every run: it tells the runner which sequences finished.
        if self.sched is None:
            self.sched = Scheduler(self.cfg, r.num_blocks, r.max_model_len, None, hash_seed=b"bench")
        sched = self.sched
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for _ in range(num_seqs):
            self._next += 1
            ids = [self.rng.randrange(3, self.vocab) for _ in range(prompt_len)]
            rejected = sched.add_request(
                AddRequest(request_id=f"r{self._next}", prompt_token_ids=ids, params=params)
            )
            if rejected:
                raise RuntimeError(f"request rejected: {rejected[0].error}")
        out = {
            "prefill_s": 0.0,
            "prefill_tokens": 0,
            "decode_s": 0.0,
            "decode_steps": 0,
            "decode_ctx_tokens": 0,
        }
        out_tokens = 0
        warm = False  # the first full-batch decode step is not timed: it may compile kernels
        while sched.has_unfinished():
            batch = sched.schedule()
            if batch is None:
                raise RuntimeError("the scheduler has work but planned no step (KV cache too small?)")
            sizes = [s.num_scheduled_tokens for s in (*batch.new_seqs, *batch.cached_seqs)]
            ctx = sum(
                s.num_computed_tokens + s.num_scheduled_tokens for s in (*batch.new_seqs, *batch.cached_seqs)
            )
            t0 = time.perf_counter()
            result = r.execute(batch)
            dt = time.perf_counter() - t0
            sched.update(batch, result)
            out_tokens += len(result.token_ids)
            if max(sizes) > 1:
                out["prefill_s"] += dt
                out["prefill_tokens"] += sum(sizes)
            elif len(sizes) == num_seqs and not warm:
                warm = True
            elif len(sizes) == num_seqs:
                out["decode_s"] += dt
                out["decode_steps"] += 1
                out["decode_ctx_tokens"] += ctx
        if out_tokens != num_seqs * output_len:
            raise RuntimeError(f"expected {num_seqs * output_len} output tokens, got {out_tokens}")
        return out


def _model_bytes(runner: Any) -> tuple[int, int, int]:
    """(bytes of every parameter, of those a decode step reads, non-embedding parameter count)."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    embed_bytes = 0 if runner.model_config.tie_word_embeddings else embed.numel() * embed.element_size()
    params = sum(p.numel() for p in model.parameters()) - (
        0 if runner.model_config.tie_word_embeddings else embed.numel()
    )
    return total, total - embed_bytes, params


def _error(what: str, e: BaseException) -> str:
    log.error("%s failed:\n%s", what, traceback.format_exc())
    return f"{what}: {type(e).__name__}: {e}"


def run_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement that fails is named in result["errors"]; the others still run."""
    import msgspec
    import torch
    from pagebus.bus.config import make_engine_config
    from pagebus.workers.device import kv_bytes_per_block
    from pagebus.workers.runner import ModelRunner

    shape = TINY if args.tiny else LLAMA3_8B
    errors: list[str] = []
    result: dict[str, Any] = {
        "bench": "gpu_e2e",
        "model": "tiny" if args.tiny else "llama-3-8b-shaped",
        "shape": shape,
    }
    # The ceilings first, while the memory they need is surely free.
    ceil = measure_ceilings(torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.tiny)
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        write_llama_config(folder, shape)
        cfg = make_engine_config(
            model=folder,
            load_format="dummy",
            dtype=args.dtype,
            max_model_len=min(args.max_model_len, shape["max_position_embeddings"]),
            max_num_seqs=max(args.concurrency),
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            cuda_graph_sizes=args.cuda_graph_sizes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}),
        )
        t0 = time.perf_counter()
        try:
            runner = ModelRunner(cfg, folder)
        except Exception as e:
            if cfg.enforce_eager:
                raise
            errors.append(_error("start-up with CUDA graphs (retrying eagerly)", e))
            runner = None
        if runner is None:  # outside the except block: the failed runner's memory is free now
            gc.collect()
            torch.cuda.empty_cache()
            cfg = msgspec.structs.replace(cfg, enforce_eager=True)
            t0 = time.perf_counter()
            runner = ModelRunner(cfg, folder)
        startup_s = time.perf_counter() - t0
    dev = runner.device
    result["device_type"] = dev.type
    result["dtype"] = str(runner.dtype).removeprefix("torch.")
    graphs = runner.graphs
    result["startup"] = {
        "seconds": startup_s,
        "num_kv_blocks": runner.num_blocks,
        "cuda_graph_sizes": graphs.sizes if graphs else [],
        "graph_capture_s": graphs.capture_s if graphs else 0.0,
        "graph_memory_mib": graphs.memory_bytes / (1 << 20) if graphs else 0.0,
    }
    result["ceilings"] = ceil
    bw = ceil["copy_bandwidth_gb_s"] * 1e9
    peak_flops = ceil["matmul_bf16_tflop_s"] * 1e12
    total_bytes, decode_weight_bytes, nonembed_params = _model_bytes(runner)
    kv_per_token = kv_bytes_per_block(runner.model_config, cfg.block_size, runner.dtype) // cfg.block_size
    result["weight_gib"] = total_bytes / (1 << 30)
    eng = Engine(runner, cfg)

    decode = []
    modes = [("on", graphs), ("off", None)] if graphs else [("off", None)]
    for conc in args.concurrency:
        for mode, g in modes:
            runner.graphs = g
            try:
                eng.run(min(conc, 2), args.prompt_len, 2)  # warm-up: compiles this size's kernels
                m = eng.run(conc, args.prompt_len, args.output_len)
            except Exception as e:
                errors.append(_error(f"decode at concurrency {conc}, CUDA graphs {mode}", e))
                eng.reset()
                continue
            finally:
                runner.graphs = graphs
            steps = m["decode_steps"]
            # Per step: every weight once, plus each sequence's whole context of K and V.
            bytes_read = steps * decode_weight_bytes + m["decode_ctx_tokens"] * kv_per_token
            tok_s = conc * steps / m["decode_s"] if m["decode_s"] else 0.0
            roof = conc * steps / (bytes_read / bw) if bytes_read else 0.0
            decode.append(
                {
                    "concurrency": conc,
                    "cuda_graphs": mode,
                    "decode_steps": steps,
                    "output_tok_s": tok_s,
                    "ms_per_step": 1e3 * m["decode_s"] / steps if steps else 0.0,
                    "roofline_tok_s": roof,
                    "fraction_of_roofline": tok_s / roof if roof else 0.0,
                    "kv_gib_read_per_step": m["decode_ctx_tokens"] * kv_per_token / max(steps, 1) / (1 << 30),
                }
            )
            log.info("decode %s", decode[-1])
    result["decode"] = decode

    # Prefill: whole prompts, one output token each, max_num_batched_tokens per step.
    args.prefill_len = min(args.prefill_len, runner.max_model_len - 1)
    try:
        p = eng.run(args.prefill_seqs, args.prefill_len, 1)
    except Exception as e:
        errors.append(_error("prefill", e))
        result["errors"] = errors
        return result
    tokens = p["prefill_tokens"] or args.prefill_seqs * args.prefill_len
    mc = runner.model_config
    # Matmuls: 2 FLOPs per parameter per token (lm_head only for the last token of each prompt);
    # attention: QK^T and PV over the causal half, 2 * 2 * heads * head_dim * L^2 / 2 per layer.
    lm_head = mc.hidden_size * mc.vocab_size
    flops = 2 * (nonembed_params - lm_head) * tokens + 2 * lm_head * args.prefill_seqs
    flops += args.prefill_seqs * mc.num_layers * 2 * mc.num_heads * mc.head_dim * args.prefill_len**2
    seconds = p["prefill_s"]
    result["prefill"] = {
        "seqs": args.prefill_seqs,
        "prompt_len": args.prefill_len,
        "tokens": tokens,
        "tok_s": tokens / seconds if seconds else 0.0,
        "tflop_s": flops / seconds / 1e12 if seconds else 0.0,
        "roofline_tok_s": tokens / (flops / peak_flops),
        "fraction_of_roofline": (flops / seconds) / peak_flops if seconds else 0.0,
    }
    log.info("prefill %s", result["prefill"])
    result["errors"] = errors
    return result


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def combine(folder: str) -> dict[str, Any]:
    """Merge gpu_check.sh's parts: pytest (rc + summary), kernels_gpu and gpu_e2e JSON."""
    out: dict[str, Any] = {"bench": "gpu_check"}
    for part in ("pytest", "kernels_gpu", "gpu_e2e"):
        rc_path = os.path.join(folder, f"{part}.rc")
        rc_text = _read(rc_path).strip()
        rc = int(rc_text) if rc_text.lstrip("-").isdigit() else None
        entry: dict[str, Any] = {"rc": rc, "timed_out": rc in (124, 137)}
        json_text = _read(os.path.join(folder, f"{part}.json")).strip()
        if json_text:
            try:
                entry["result"] = json.loads(json_text.splitlines()[-1])
            except ValueError as e:
                entry["parse_error"] = str(e)
        if rc != 0 or part == "pytest":
            entry["log_tail"] = _read(os.path.join(folder, f"{part}.log"))[-3000:]
        entry["ok"] = rc == 0
        out[part] = entry
    out["ok"] = all(out[p]["ok"] for p in ("pytest", "kernels_gpu", "gpu_e2e"))
    return out


def _emit(result: dict[str, Any], json_out: str | None) -> None:
    from bench.common import device_name, git_sha

    line = json.dumps({"git_sha": git_sha(), "device": device_name(), **result})
    path = json_out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if path and path != "-":
        with open(path, "w") as f:
            f.write(line + "\n")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model, on any device (tests)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode runs")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of the decode runs")
    p.add_argument("--prefill-seqs", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: profiled on CUDA)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json-out", default=None, help="where to write the JSON too ('-': nowhere)")
    p.add_argument("--combine", metavar="DIR", default=None, help="merge gpu_check.sh's parts in DIR")
    args = p.parse_args(argv)
    if args.combine:
        result = combine(args.combine)
        _emit(result, args.json_out)
        return 0 if result["ok"] else 1
    try:
        result = run_e2e(args)
        result["ok"] = not result["errors"]
    except Exception as e:  # one JSON object either way, naming what failed
        log.error("gpu_e2e failed:\n%s", traceback.format_exc())
        result = {"bench": "gpu_e2e", "ok": False, "error": f"{type(e).__name__}: {e}"}
    _emit(result, args.json_out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
