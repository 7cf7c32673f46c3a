"""`pagebus serve` options from flags, PAGEBUS_* variables and a TOML file: precedence, unknown names
with the nearest valid one, value errors, and --print-config with the key masked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pagebus.frontends.cli import _parse, build_parser, main
from pagebus.frontends.service.config import ENGINE_SWITCHES, ConfigError, apply


def parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    return apply(build_parser(), ["serve", *argv], env)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pagebus.toml"
    path.write_text(text)
    return str(path)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'port = 7001\nmax_model_len = 1024\nstall-timeout = 5\nlog_format = "json"\n')
    env = {"PAGEBUS_PORT": "7002", "PAGEBUS_MAX_MODEL_LEN": "2048"}
    a = parse(["--config", cfg, "--port", "7003"], env)
    assert a.port == 7003  # flag
    assert a.max_model_len == 2048  # env over file
    assert a.stall_timeout == 5.0 and a.log_format == "json"  # file over default
    assert a.drain_timeout == 30.0 and a.host == "127.0.0.1"  # defaults
    b = parse(["--config", cfg], env)
    assert b.port == 7002
    # PAGEBUS_CONFIG names the file when --config is not given.
    c = parse([], {"PAGEBUS_CONFIG": cfg})
    assert (c.port, c.max_model_len) == (7001, 1024)


def test_booleans_lists_and_engine_fields(tmp_path: Path) -> None:
    cfg = write(
        tmp_path, "enable_prefix_caching = false\ncuda_graph_sizes = [1, 2, 8]\nmetrics_public = true\n"
    )
    a = parse(["--config", cfg], {"PAGEBUS_ENFORCE_EAGER": "yes", "PAGEBUS_MODEL": "/m.gguf"})
    assert a.enable_prefix_caching is False and a.cuda_graph_sizes == [1, 2, 8]
    assert a.metrics_public is True and a.enforce_eager is True and a.model == "/m.gguf"
    assert parse(["--enable-prefix-caching", "--config", cfg], {}).enable_prefix_caching is True
    assert parse([], {"PAGEBUS_CUDA_GRAPH_SIZES": "4,16"}).cuda_graph_sizes == [4, 16]


def test_the_engines_own_switches_are_not_serve_options() -> None:
    """PAGEBUS_KV_HEADS_MAJOR=0 and the like beside `pagebus serve` reach the worker; each is a
    switch the package reads (its source names it in an environ lookup)."""
    args = parse([], dict.fromkeys(ENGINE_SWITCHES, "0") | {"PAGEBUS_PORT": "7003"})
    assert args.port == 7003
    root = Path(__file__).resolve().parents[3]
    sources = "".join(p.read_text() for d in ("kernels", "workers", "bus") for p in (root / d).rglob("*.py"))
    for name in ENGINE_SWITCHES:
        assert f'environ.get("{name}"' in sources, name


def test_unknown_names_are_errors_with_the_nearest_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_modle_len.*did you mean max_model_len\?"):
        parse(["--config", write(tmp_path, "max_modle_len = 5\n")], {})
    with pytest.raises(ConfigError, match=r"PAGEBUS_STALL_TIMOUT; did you mean PAGEBUS_STALL_TIMEOUT\?"):
        parse([], {"PAGEBUS_STALL_TIMOUT": "3"})
    with pytest.raises(ConfigError, match=r"PAGEBUS_PORT: expected an integer, got 'eighty'"):
        parse([], {"PAGEBUS_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"port: expected an integer, got 1.5"):
        parse(["--config", write(tmp_path, "port = 1.5\n")], {})
    with pytest.raises(ConfigError, match=r"dtype: 'fp8' is not one of"):
        parse(["--config", write(tmp_path, 'dtype = "fp8"\n')], {})
    with pytest.raises(ConfigError, match="cannot read config file"):
        parse(["--config", str(tmp_path / "missing.toml")], {})


def test_cli_reports_config_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEBUS_MAX_NUM_SEQ", "4")
    assert main(["serve", "--print-config"]) == 2
    assert "unknown environment variable PAGEBUS_MAX_NUM_SEQ; did you mean PAGEBUS_MAX_NUM_SEQS?" in (
        capsys.readouterr().err
    )


def test_print_config_masks_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEBUS_API_KEY", "sk-very-secret")
    cfg = write(tmp_path, "port = 9000\n")
    assert main(["serve", "--config", cfg, "--print-config", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "sk-very-secret" not in out
    lines = set(out.splitlines())
    assert {'api_key = "***"', "port = 9000", "max_model_len = 256", "block_size = 16"} <= lines
    # The output is itself a valid config file (the key aside).
    again = write(tmp_path, "\n".join(x for x in out.splitlines() if not x.startswith("api_key")))
    assert _parse(build_parser(), ["serve", "--config", again]).port == 9000
