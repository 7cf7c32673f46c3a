"""The process groups of one rank and the few collectives the model uses.

NCCL on CUDA, gloo on CPU, rendezvous over TCP at the address and port the scheduler process
chose. Every collective has a timeout (COLLECTIVE_TIMEOUT_S): a rank whose peer died gets an
error instead of waiting forever in an all-reduce (gloo also fails at once when the peer's
socket closes).

Parallel layers take the context that is current while the model is built (`building`), so
their forward needs no global and a model never asks which rank it runs on.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pagebus.workers.distributed.layout import Layout

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # also bounds the rendezvous: every rank must arrive within it


@dataclass
class Parallel:
    """One rank's layout and groups; with world size 1 every operation is a no-op."""

    layout: Layout
    tp_group: Any = None  # dist.ProcessGroup of this stage's ranks
    cpu_group: Any = None  # gloo group over every rank, for small host-side objects

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place."""
        if self.layout.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every tp rank's x along the last dimension (equal shapes)."""
        if self.layout.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        """Send activations to the same tp rank of the next stage."""
        dst = self.layout.rank + self.layout.tp_size
        for t in tensors:
            dist.send(t.contiguous(), dst)

    def recv_prev(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Receive activations shaped like `like` (filled in place) from the previous stage."""
        src = self.layout.rank - self.layout.tp_size
        for t in like:
            dist.recv(t, src)
        return like

    def broadcast_object(self, obj: object) -> Any:
        """The result rank's `obj` on every rank (others pass None)."""
        if self.layout.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.layout.result_rank, group=self.cpu_group)
        return box[0]


SINGLE = Parallel(Layout())
_current: ContextVar[Parallel] = ContextVar("pagebus_parallel", default=SINGLE)


def current() -> Parallel:
    """The context a layer being built belongs to (SINGLE outside `building`)."""
    return _current.get()


@contextlib.contextmanager
def building(p: Parallel) -> Iterator[Parallel]:
    token = _current.set(p)
    try:
        yield p
    finally:
        _current.reset(token)


def init_distributed(layout: Layout, master_addr: str, master_port: int, device: torch.device) -> Parallel:
    """Join the job's process group and build the tensor-parallel groups (every rank must create
    every group, in the same order)."""
    if layout.world_size == 1:
        return Parallel(layout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL binds each rank's communicators to the current device
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        world_size=layout.world_size,
        rank=layout.rank,
        timeout=timeout,
    )
    tp_group = None
    for stage in range(layout.pp_size):
        ranks = Layout(layout.tp_size, layout.pp_size, stage * layout.tp_size).tp_group_ranks()
        g = dist.new_group(ranks, timeout=timeout)
        if stage == layout.pp_rank:
            tp_group = g
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    log.info("joined %s process group: %s", backend, layout.describe())
    return Parallel(layout, tp_group, cpu_group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
