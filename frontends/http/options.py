"""`pagebus serve` flags; light to import (no uvicorn), since the CLI builds every parser up front."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="Bearer token required on every route but /health")
    g.add_argument("--api-key-file", default=None, help="read the API key from this file")
    g.add_argument("--served-model-name", default=None, help="model id clients send (default: file name)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="refuse new requests (429) while more than this many await their first token",
    )
    g.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    g.add_argument("--allowed-origins", default=None, help="comma-separated CORS origins ('*' for any)")
    g.add_argument("--tokenizer-workers", type=int, default=1)
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    d = p.add_argument_group("daemon")
    d.add_argument(
        "--config", default=None, help="TOML file of options (keys: flag names); flags and env win"
    )
    d.add_argument(
        "--print-config", action="store_true", help="print the merged options (secrets masked), exit"
    )
    d.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    d.add_argument("--log-requests", action="store_true", help="log prompts and outputs (off: never logged)")
    d.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="seconds with requests in flight but no engine step before /health turns 503 (0: off)",
    )
    d.add_argument(
        "--stats-interval", type=float, default=10.0, help="seconds between stats lines while busy"
    )
    d.add_argument(
        "--health-probe-timeout",
        type=float,
        default=30.0,
        help="seconds a one-token /health?probe=generate generation may take",
    )


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key (or $PAGEBUS_API_KEY), else the contents of --api-key-file, stripped."""
    if args.api_key and args.api_key_file:
        raise ValueError("give one of api_key and api_key_file, not both")
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"API key file {args.api_key_file!r} is empty")
        return key
    return None
