"""Shared set-up for the frontend tests: the default model's tokenizer, converted once per session.

Not a conftest.py (others may own that): test modules call these from their own fixtures. The
conversion (~6 s, transformers) happens on the first call; later calls reuse the on-disk cache.
"""

from __future__ import annotations

import pytest
from pagebus.frontends.model_files import default_model_path, tokenizer_dir


def shared_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tokenizer_dir(
        default_model_path(), cache_dir=str(tmp_path_factory.getbasetemp() / "pagebus-cache")
    )
