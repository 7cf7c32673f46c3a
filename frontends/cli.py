"""The `pagebus` command: `generate`, `serve`, `systemd-unit` and `run-batch`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagebus.bus.config import EngineConfig
from pagebus.bus.logs import configure_logging
from pagebus.bus.messages import SamplingParams
from pagebus.frontends.args import add_engine_args, engine_config_from_args
from pagebus.frontends.service.config import render, subparser


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _generate(args: argparse.Namespace) -> int:
    from pagebus.frontends.llm import LLM

    cfg = engine_config_from_args(args)
    llm = LLM(**_cfg_kwargs(cfg))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seed=args.sampling_seed,
        stop=args.stop,
    )
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "outputs": [{"text": o.text, "finish_reason": o.finish_reason} for o in out.outputs],
                    }
                )
            )
        else:
            for o in out.outputs:
                print(f"{prompt}{o.text}" if not args.chat else o.text)
    return 0


def _cfg_kwargs(cfg: EngineConfig) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(cfg)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Serve options also come from --config and PAGEBUS_* (flag > env > file > default)."""
    args = parser.parse_args(argv)
    if args.command not in ("serve", "systemd-unit"):
        return args
    from pagebus.frontends.service.config import apply

    return apply(parser, argv)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagebus", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (arguments, or lines of stdin) and print them")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--log-level", default="WARNING")
    add_engine_args(gen)
    _add_sampling_args(gen)
    from pagebus.frontends.http.options import add_serve_args
    from pagebus.frontends.service.unit import add_unit_args

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    unit = sub.add_parser("systemd-unit", help="print a systemd unit that serves with the given serve flags")
    for p in (srv, unit):
        p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
        add_engine_args(p)
        add_serve_args(p)
    add_unit_args(unit)
    bat = sub.add_parser(
        "run-batch", help="answer JSONL requests (OpenAI Batch or short form) from a file or stdin"
    )
    bat.add_argument("--log-level", default="WARNING")
    add_engine_args(bat)
    from pagebus.frontends.batch.main import add_batch_args

    add_batch_args(bat)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except ValueError as e:  # a bad config file or PAGEBUS_* variable
        print(f"pagebus: error: {e}", file=sys.stderr)
        return 2
    tag = "http-0" if args.command == "serve" else "frontend-0"
    configure_logging(args.log_level.upper(), getattr(args, "log_format", "text"), tag)
    try:
        if args.command in ("serve", "systemd-unit") and args.print_config:
            print(render(subparser(parser, args), args, _cfg_kwargs(EngineConfig())), end="")
            return 0
        if args.command == "systemd-unit":
            from pagebus.frontends.service.unit import render_unit, serve_argv

            print(render_unit(args, serve_argv(argv[1:])), end="")
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve" and getattr(args, "node_rank", None):
            from pagebus.frontends.args import engine_config_from_args
            from pagebus.frontends.engine.node import run_worker_node
            from pagebus.frontends.model_files import resolve_model

            cfg = engine_config_from_args(args)  # a worker node: no HTTP, only its workers
            return run_worker_node(cfg, resolve_model(cfg.model))
        if args.command == "serve":
            from pagebus.frontends.http.server import main as serve_main

            # SIGHUP re-reads --config and the flags with a fresh parser (no stale file defaults).
            return serve_main(args, lambda: _parse(build_parser(), argv))
        if args.command == "run-batch":
            from pagebus.frontends.batch.main import main as batch_main

            return batch_main(args)
    except (ValueError, FileNotFoundError) as e:
        # User errors (bad path, unsupported architecture, bad option) end with one clear line.
        print(f"pagebus: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
