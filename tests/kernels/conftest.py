"""Kernel tests run the Triton launchers through the interpreter on CPU, or compiled on CUDA."""

import os

import torch

# Must happen before any @triton.jit module is imported: the decorator reads it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The box is shared and has 2 cores; one thread keeps the tests from fighting other work.
torch.set_num_threads(1)
