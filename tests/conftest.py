"""Shared fixtures: the default model loaded once per session, and the HF oracle."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Tests share 2 cores with the processes they start; keep BLAS from oversubscribing.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What the engines derive from model files (converted tokenizers, the weight cache) goes to a
# directory of this session, inherited by every process the tests start, and removed at the end:
# the suite's many throwaway models never fill or evict the user's own caches.
_OWN_CACHE = None if "PAGEBUS_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="pagebus-test-cache.")
if _OWN_CACHE is not None:
    os.environ["PAGEBUS_CACHE_DIR"] = _OWN_CACHE


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _cuda_present() -> bool:
    # Decided without importing torch, which would be too late for TRITON_INTERPRET.
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


# Triton reads TRITON_INTERPRET when kernel modules are imported: without a GPU, every
# Triton test (kernels and the whole model on the triton backend) runs in the interpreter.
if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model() -> str:
    from pagebus.frontends.model_files import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def llm_fp32(default_model: str):
    from pagebus import LLM

    return LLM(default_model, dtype="float32", seed=0)


@pytest.fixture(scope="session")
def hf_oracle(default_model: str):
    """HF transformers running the same GGUF weights (dequantized by transformers) in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(default_model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok
