"""Frontends: the Python API, the HTTP server, the batch pipe, and the engine they share (engine/).

The public names are re-exported by the package root: `from pagebus import LLM,
SamplingParams`. LLM is imported lazily so that processes which only need the light
frontend modules never import torch.
"""

from __future__ import annotations

from typing import Any

from pagebus.bus.messages import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagebus.frontends.llm import LLM

        return LLM
    raise AttributeError(name)
