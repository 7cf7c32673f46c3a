"""This checkout against another commit of the project, the whole engine, side by side.

    python -m bench.tree_ab --base fce8d6b [--rounds 16] [--requests 1] [--output-len 128]
        [--temperature 0.8 --top-p 0.95 --top-k 0]

The base commit goes into a git worktree under a temporary directory; each side runs in a
process of its own (`LLM.generate`, bf16 where the CPU has AVX-512 BF16, else float32) that
builds its engine once, then generates `--requests` prompts of 32 tokens x `--output-len` new
ones whenever told to, so the two sides' rounds interleave (the order alternates) and share the
machine's drift; the side not running waits on a pipe, idle. Each side compiles its own CPU
kernels (the build's name follows its source). Greedy unless `--temperature` (then seeded, so
both sides must draw the same tokens). Prints one JSON object: each side's median output tok/s
(prefill included), new / base paired by round, and whether the first request's tokens match.
`bench/step_ab.py` resolves smaller changes of the step path, where this one's rounds spread
by several percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import cpu_flags, emit, log, setup_logging

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bus", "frontends", "kernels", "scheduler", "workers")  # pyproject's package dirs


def package_view(tree: Path, into: Path) -> Path:
    """A directory whose `pagebus` package is `tree`'s (the editable install maps the name to
    this checkout alone): links to its folders, as pyproject's package-dir lays them out."""
    pkg = into / "pagebus"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").symlink_to(tree / "pagebus" / "__init__.py")
    for name in PACKAGES:
        (pkg / name).symlink_to(tree / name)
    return into


def worker(view: str, requests: int, output_len: int, dtype: str, sampling: dict[str, Any]) -> None:
    """One side: import pagebus from `view`, build the engine, run a round per line on stdin."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)
    ]
    sys.path.insert(0, view)
    import pagebus

    assert pagebus.__file__ is not None and pagebus.__file__.startswith(view), pagebus.__file__
    llm = pagebus.LLM(dtype=dtype)
    params = pagebus.SamplingParams(max_tokens=output_len, ignore_eos=True, seed=0, **sampling)
    prompts = [[1000 + 37 * i + j for j in range(32)] for i in range(requests)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        tps = requests * output_len / (time.perf_counter() - t0)
        print(json.dumps({"tps": tps, "tokens": out[0].outputs[0].token_ids}), flush=True)


class Side:
    def __init__(self, view: Path, args: argparse.Namespace, dtype: str) -> None:
        cmd = [sys.executable, "-m", "bench.tree_ab", "--worker", str(view)]
        cmd += ["--requests", str(args.requests), "--output-len", str(args.output_len), "--dtype", dtype]
        cmd += [
            "--temperature",
            str(args.temperature),
            "--top-p",
            str(args.top_p),
            "--top-k",
            str(args.top_k),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        line = self.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{view}: the engine did not start (exit {self.proc.wait()})")

    def round(self) -> dict[str, Any]:
        self.stdin.write("go\n")
        self.stdin.flush()
        result: dict[str, Any] = json.loads(self.stdout.readline())
        return result

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the commit to compare this checkout with")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        worker(args.worker, args.requests, args.output_len, args.dtype, sampling)
        return
    if not args.base:
        ap.error("--base: the commit to compare with")
    setup_logging()
    flags = cpu_flags()
    dtype = "bfloat16" if "avx512_bf16" in flags else "float32"
    with tempfile.TemporaryDirectory(prefix="tree_ab_") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-q", str(base_tree), args.base], cwd=ROOT, check=True
        )
        try:
            views = {
                "base": package_view(base_tree, Path(tmp) / "view_base"),
                "new": package_view(ROOT, Path(tmp) / "view_new"),
            }
            log.info("starting both engines (each builds its kernels on first use)")
            sides = {name: Side(view, args, dtype) for name, view in views.items()}
            tps: dict[str, list[float]] = {"base": [], "new": []}
            tokens: dict[str, list[int]] = {}
            for r in range(args.rounds):
                for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                    out = sides[name].round()
                    tps[name].append(out["tps"])
                    tokens[name] = out["tokens"]
                log.info("round %d: base %.1f, new %.1f tok/s", r + 1, tps["base"][-1], tps["new"][-1])
            for side in sides.values():
                side.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    ratios = [n / b for n, b in zip(tps["new"], tps["base"], strict=True)]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    emit(
        {
            "bench": "tree_ab",
            "base": args.base,
            "cpu_flags": flags,
            "dtype": dtype,
            "requests": args.requests,
            "output_len": args.output_len,
            "sampling": {
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "seed": 0,
            },
            "rounds": args.rounds,
            "base_tps_median": round(statistics.median(tps["base"]), 2),
            "new_tps_median": round(statistics.median(tps["new"]), 2),
            "new_over_base_paired_median": round(statistics.median(ratios), 4),
            "paired_quartiles": [round(q[0], 4), round(q[2], 4)],
            "same_tokens": tokens["base"] == tokens["new"],
            "machine_load": os.getloadavg()[0],
        }
    )


if __name__ == "__main__":
    main()
