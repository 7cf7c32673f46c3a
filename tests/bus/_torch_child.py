"""A child whose module imports torch, as the engine's roles do, for tests of `_child_main`."""

from __future__ import annotations

import os
from typing import Any

import torch


def report_cores(out: Any) -> None:
    """Puts (niceness, torch threads) of this child, as `_child_main` left them."""
    out.put((os.nice(0), torch.get_num_threads()))
