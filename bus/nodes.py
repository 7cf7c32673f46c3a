"""Several machines: where a worker on another node finds the head, and how it hears the steps.

The head node (node rank 0) runs the frontends, the tokenizer pool, the scheduler and its own
workers; every other node runs only workers (`pagebus serve --node-rank K`). All of them derive
the same endpoints from `--master-addr` and `--master-port`: torch.distributed's rendezvous on
the port itself, then on the next ports the step broadcast (ZeroMQ PUB/SUB over tcp://; the shm
ring stays the local path), the workers' handshake and their results, and a liveness listener
whose connection tells a worker node at once that the head is gone. The head binds only on the
address given. Nothing on these ports is authenticated: the network between nodes must be trusted.
"""

from __future__ import annotations

from typing import Any

import zmq
from pagebus.bus.config import EngineConfig


def world_size(cfg: EngineConfig) -> int:
    return cfg.tensor_parallel_size * cfg.pipeline_parallel_size


def local_ranks(cfg: EngineConfig) -> range:
    """The worker ranks node `cfg.node_rank` runs: an equal, contiguous share of the world."""
    per = world_size(cfg) // cfg.nnodes
    return range(cfg.node_rank * per, (cfg.node_rank + 1) * per)


def node_endpoints(cfg: EngineConfig) -> dict[str, str]:
    a, p = cfg.master_addr, cfg.master_port
    return {
        "steps": f"tcp://{a}:{p + 1}",
        "handshake": f"tcp://{a}:{p + 2}",
        "results": f"tcp://{a}:{p + 3}",
    }


def liveness_address(cfg: EngineConfig) -> tuple[str, int]:
    return cfg.master_addr, cfg.master_port + 4


class StepSubscriber:
    """A remote worker's step plan source: the same bytes the shm ring carries, over PUB/SUB."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # never drop a step
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def read(self, timeout_s: float | None = None) -> bytes:
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no step from the head")
        data: bytes = self.sock.recv()
        return data

    def close(self) -> None:
        self.sock.close(linger=0)
