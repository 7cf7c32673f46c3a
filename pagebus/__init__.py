"""pagebus: an LLM inference and serving engine.

`from pagebus import LLM, SamplingParams` is the Python API. The internal packages keep
their own top-level folders in the repository (`bus/`, `scheduler/`, `workers/`,
`frontends/`, `kernels/`) and are installed as `pagebus.bus`, `pagebus.scheduler`, ...
through pyproject's package-dir mapping, so a wheel puts one import name in site-packages.

In a source tree (an editable install, or the repository on PYTHONPATH) those folders sit
beside this one, so the repository root joins this package's search path: both layouts
import the same way. `LLM` is imported lazily: processes that only need the light modules
(tokenizer pool, scheduler, HTTP frontend) never import torch.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_root, "pyproject.toml")) and os.path.isfile(
    os.path.join(_root, "bus", "__init__.py")
):
    __path__.append(_root)


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagebus.frontends.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagebus.bus.messages import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from pagebus.bus.messages import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'pagebus' has no attribute {name!r}")
