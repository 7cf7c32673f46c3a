"""Every `serve` option from three more places: a TOML file (`--config`), `PAGEBUS_*` variables, and
the defaults; precedence flag > env > file > default.

The names are the parser's own destinations (EngineConfig fields and the serve options), so a
TOML key is the flag without dashes (`max_model_len`, `max-model-len` also accepted) and the
variable is `PAGEBUS_` + its upper case (`PAGEBUS_MAX_MODEL_LEN`). An unknown key or variable is
an error naming it and the nearest valid name.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Mapping
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found]

ENV_PREFIX = "PAGEBUS_"
# The engine's own build and A/B switches and the directory of its caches, read where they act
# (kernels/cpu_native.py, bus/config.py cache_root), not serve options: set beside `pagebus serve`
# they reach the engine's processes instead of failing as unknown names.
ENGINE_SWITCHES = frozenset(
    {
        "PAGEBUS_CPU_KERNELS",
        "PAGEBUS_VERBOSE_BUILD",
        "PAGEBUS_K_TOKEN_PAIRS",
        "PAGEBUS_KV_HEADS_MAJOR",
        "PAGEBUS_CACHE_DIR",
    }
)
SECRET_OPTIONS = frozenset({"api_key"})
# Options that say what to do with the configuration rather than being part of it.
_NOT_CONFIG = frozenset({"help", "print_config", "command"})
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    pass


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options by destination; the first action wins for shared destinations
    (`--enable-prefix-caching` before `--no-prefix-caching`)."""
    out: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.option_strings and a.dest not in _NOT_CONFIG and a.dest != argparse.SUPPRESS:
            out.setdefault(a.dest, a)
    return out


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _unknown(name: str, valid: list[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]}?" if near else ""
    return ConfigError(f"unknown {where} {name}{hint}")


def _is_bool(a: argparse.Action) -> bool:
    return isinstance(
        a, argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction
    )


def _convert(a: argparse.Action, value: Any, where: str) -> Any:
    """Check and convert one value for action `a`: strings (from the environment, or TOML strings)
    are parsed as the flag would parse them; TOML's native values must have the flag's type."""
    if _is_bool(a):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if a.nargs in ("+", "*"):
        items = value.replace(",", " ").split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_scalar(a, v, where) for v in items]
    return _scalar(a, value, where)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _scalar(a: argparse.Action, value: Any, where: str) -> Any:
    typ: Any = a.type if callable(a.type) else str
    name = _TYPE_NAMES.get(typ) if isinstance(typ, type) else None
    expected = f"{where}: expected {name or getattr(typ, '__name__', 'a value')}"
    if isinstance(value, bool | list | dict) or (not isinstance(value, str) and typ is str):
        raise ConfigError(f"{expected}, got {value!r}")
    if isinstance(value, float) and typ is int:
        raise ConfigError(f"{expected}, got {value!r}")
    try:
        out = typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{expected}, got {value!r}") from None
    if a.choices is not None and out not in a.choices:
        raise ConfigError(f"{where}: {out!r} is not one of {list(a.choices)}")
    return out


def from_file(path: str, opts: Mapping[str, argparse.Action]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest not in opts or dest == "config":
            raise _unknown(key, sorted(d for d in opts if d != "config"), f"key in {path}:")
        out[dest] = _convert(opts[dest], value, f"{path}: {key}")
    return out


def from_env(environ: Mapping[str, str], opts: Mapping[str, argparse.Action]) -> dict[str, Any]:
    by_name = {env_name(d): d for d in opts}
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in ENGINE_SWITCHES:
            continue
        if name not in by_name:
            raise _unknown(name, sorted(by_name), "environment variable")
        dest = by_name[name]
        out[dest] = _convert(opts[dest], value, name)
    return out


def merged_defaults(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> dict[str, Any]:
    """Defaults that the file and the environment give, env over file. `args` is a first parse of
    the command line, read only for --config (a flag, else PAGEBUS_CONFIG)."""
    opts = options(parser)
    env = from_env(environ, opts)
    path = getattr(args, "config", None) or env.get("config")
    file = from_file(path, opts) if path else {}
    return {**file, **env}


def apply(
    parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Parse `argv` with the file and environment as the defaults, so given flags win."""
    env = os.environ if environ is None else environ
    first = parser.parse_args(argv)
    sub = subparser(parser, first)
    defaults = merged_defaults(sub, first, env)
    sub.set_defaults(**defaults)
    return parser.parse_args(argv)


def subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            chosen: argparse.ArgumentParser = a.choices[args.command]
            return chosen
    return parser


def render(
    parser: argparse.ArgumentParser, args: argparse.Namespace, fallback: Mapping[str, Any] | None = None
) -> str:
    """The merged configuration as a TOML file (usable as --config), secrets masked. An option left
    unset shows `fallback`'s value (the engine's defaults) or is commented out (TOML has no null)."""
    import json  # TOML basic strings accept JSON string escapes for everything json emits here

    lines = []
    for dest in sorted(options(parser)):
        if dest == "config":
            continue
        value = getattr(args, dest, None)
        if value is None and fallback is not None:
            value = fallback.get(dest)
        if value is None:
            lines.append(f"# {dest} = (unset)")
            continue
        if dest in SECRET_OPTIONS:
            value = "***"
        lines.append(f"{dest} = {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"
