"""Tensor and pipeline parallelism: the rank layout (layout.py) and the process groups and
collectives (state.py) that the parallel layers and the runner use."""
