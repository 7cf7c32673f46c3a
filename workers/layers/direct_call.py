"""Modules whose call is their `forward`, without `nn.Module.__call__` in between.

`nn.Module.__call__` goes through `_wrapped_call_impl` and `_call_impl` (hook checks, two
Python frames) before `forward`: 2-3 us a call on CPUs. A decode step of the default model
makes ~330 module calls (11 a layer): with a model whose matmuls cost next to nothing
(bench/step_overhead.py, one thread), skipping them took a single-stream step from 5.9-6.2 to
4.0-5.5 ms of CPU.
The engine registers no hooks on its layers, so the layers of the hot path skip that dispatch:
a subclass that defines `forward` gets it as its `__call__` too.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class DirectCall(nn.Module):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.__dict__["forward"]  # type: ignore[method-assign]
