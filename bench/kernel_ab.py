"""Builds of the CPU kernels side by side: kernels/csrc/cpu_ops.cpp as it is ("base") and edited
copies of it, each compiled under a module name of its own, one engine per build in this process,
their timed runs interleaved (bench/interleave.py) so that the box's drift falls on every build
alike. Prints one JSON object: each build's figures, its throughput over base's paired by round,
and whether its greedy tokens are base's.

    cp kernels/csrc/cpu_ops.cpp /tmp/wide.cpp   # then edit the copy
    python -m bench.kernel_ab --variant wide=/tmp/wide.cpp --control --num-requests 32 --single

Every call into an engine (its construction, warm-up, timed runs) happens inside its own build's
`kernels.cpu_native.using_build`: the compiled ops are looked up when called, while a layer's
matmul and the model's decode stack keep the functions of the build active when they were made.
An engine made or run under another build would run parts of both, and its ratio would say
nothing (a harness that swapped builds only while constructing engines ran every engine's decode
steps on the last build's stack). `--control` adds a second build of the unedited source: the
spread of its ratio is what these rounds cannot tell from noise on this machine.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import cpu_flags, emit, log, setup_logging
from bench.interleave import Interleaved, LocalEngine, runs_tps
from bench.peer_runners._harness import Generate

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "csrc" / "cpu_ops.cpp"
CHECK_TOKENS = 32  # new tokens of the token comparison


def parse_variant(text: str) -> tuple[str, Path]:
    """NAME=PATH, NAME a short identifier (it goes into the module name)."""
    name, sep, path = text.partition("=")
    if not sep or not name.isidentifier() or name in ("base", "control"):
        raise argparse.ArgumentTypeError(
            f"--variant wants NAME=PATH, NAME an identifier other than base and control: {text!r}"
        )
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"--variant {name}: no file {path}")
    return name, Path(path)


def add_build_options(ap: argparse.ArgumentParser) -> None:
    """--variant NAME=PATH (repeatable) and --control, as every A/B of kernel builds takes them."""
    ap.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an edited copy of kernels/csrc/cpu_ops.cpp (repeat for more)",
    )
    ap.add_argument("--control", action="store_true", help="add a second build of the unedited source")


def build_sources(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(name, source) of each build to compare: base (the source as it is), control (the same
    again) when asked, then the variants."""
    return [("base", SOURCE), *((("control", SOURCE),) if args.control else ()), *args.variant]


def build(name: str, source: Path) -> Any:
    """`source` compiled as a module named by the build and its text, cached like the default build."""
    from pagebus.kernels import cpu_native

    text = source.read_bytes()
    digest = hashlib.sha256(cpu_native.build_digest().encode() + text).hexdigest()[:10]
    # torch's loader wants the source in the build directory's own place: a copy per build
    with cpu_native.build_directory_for(f"pagebus_cpu_ops_ab_{name}_{digest}") as directory:
        copy = Path(directory) / "cpu_ops.cpp"
        if not copy.exists() or copy.read_bytes() != text:
            copy.write_bytes(text)
    log.info("building %s from %s (1-2 min unless cached)", name, source)
    return cpu_native.load_build(copy.parent.name, copy)


class BuildEngine:
    """pagebus's `LLM` made and run with one build of the kernels in place."""

    def __init__(self, module: Any, make: Callable[[], tuple[Generate, Any]]) -> None:
        self.module = module
        with self.active():
            self._generate, self.llm = make()

    def active(self) -> Any:
        from pagebus.kernels.cpu_native import using_build

        return using_build(self.module)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        with self.active():
            return self._generate(prompts, max_tokens)

    def tokens(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from pagebus import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        with self.active():
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def stack_module(self) -> str | None:
        """The module the model's decode stack came from (None: no stack was made)."""
        stack = getattr(self.llm.engine.runner.model.model, "_stack", None)
        return None if stack is None or stack[1] is None else type(stack[1]).__module__


def ratio_spread(a: list[float], b: list[float]) -> dict[str, float]:
    """The per-round ratios a / b: their median, lowest and highest."""
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    return {"median": round(statistics.median(r), 4), "min": round(r[0], 4), "max": round(r[-1], 4)}


def paired_ratios(
    res: dict[str, Any], base: dict[str, Any], sizes: list[int], single: bool
) -> dict[str, Any]:
    """Throughput over base's for each size (and single-stream decode), spread over the rounds."""
    out: dict[str, Any] = {}
    for key, n in [*((f"offline_{n}", n) for n in sizes), *((("single_decode", None),) if single else ())]:
        a, b = runs_tps(res, n), runs_tps(base, n)
        if a and len(a) == len(b):
            out[key] = ratio_spread(a, b)
    return out


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_options(ap)
    ap.add_argument("--num-requests", type=int, nargs="*", default=[], help="offline batch sizes to time")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--single", action="store_true", help="time the single stream too")
    ap.add_argument("--single-input-len", type=int, default=32)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="float16")
    ap.add_argument("--quantization", default="fp16", help="fp16 (float16 weight tiles) or none")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.variant and not args.control:
        ap.error("nothing to compare: give --variant NAME=PATH or --control")
    if not args.num_requests and not args.single:
        ap.error("nothing to time: give --num-requests N... or --single")

    from pagebus.kernels.cpu_native import native_ops

    from bench.peers import pagebus_generate
    from bench.throughput import make_prompts

    quant = None if args.quantization == "none" else args.quantization
    sources = dict(build_sources(args))
    modules = {name: native_ops() if name == "base" else build(name, src) for name, src in sources.items()}
    engines = {
        name: BuildEngine(mod, lambda: pagebus_generate(args.dtype, args.kv_cache_dtype, quant))
        for name, mod in modules.items()
    }
    run = Interleaved([LocalEngine(name, e.generate) for name, e in engines.items()], args.rounds)
    longest = max(args.num_requests, default=1)
    prompts = [p for p, _ in make_prompts(longest, args.input_len, args.output_len, 0.0, args.seed)]
    if args.num_requests:
        run.run_offline(prompts, args.num_requests, args.output_len)
    if args.single:
        single = make_prompts(1, args.single_input_len, args.single_output_len, 0.0, args.seed + 1)[0][0]
        run.run_single(single, args.single_output_len)
    results = run.results()
    check = prompts[:4]
    base_tokens = engines["base"].tokens(check, CHECK_TOKENS)
    builds: dict[str, Any] = {}
    for name, e in engines.items():
        builds[name] = {
            "source": str(sources[name]),
            "module": e.module.__name__,
            "decode_stack_from": e.stack_module(),
            "same_tokens_as_base": e.tokens(check, CHECK_TOKENS) == base_tokens,
            "vs_base": paired_ratios(results[name], results["base"], args.num_requests, args.single),
        }
    emit({
        "bench": "kernel_ab",
        "command": " ".join(sys.argv),
        "cpu_flags": cpu_flags(),
        "config": {k: v for k, v in vars(args).items() if k != "variant"},
        "builds": builds,
        "results": results,
    })  # fmt: skip
    mixed = [n for n, b in builds.items() if b["decode_stack_from"] not in (None, b["module"])]
    if mixed:
        log.error("engines ran another build's decode stack: %s", mixed)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
