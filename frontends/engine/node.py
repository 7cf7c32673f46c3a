"""A worker node: `pagebus serve --nnodes N --node-rank K` with K > 0 runs only this node's share
of the workers; the head (node 0) serves. See bus/nodes.py for the endpoints.

The node connects to the head's liveness port first (retrying until the head is up), then spawns
its workers, which join the head's step broadcast, handshake and rendezvous over TCP. It exits
when its workers do: 0 when the head shut them down, non-zero when one died (the others are
stopped) or when the head's connection closed (the head is gone: no worker is left behind).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import socket
import time

import msgspec
from pagebus.bus.config import EngineConfig
from pagebus.bus.nodes import liveness_address, local_ranks, node_endpoints
from pagebus.bus.proc import describe_death, shutdown, spawn

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 600.0  # how long a worker node waits for the head to come up


def _connect_to_head(cfg: EngineConfig) -> socket.socket:
    addr = liveness_address(cfg)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(addr, timeout=5.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no head node at {addr[0]}:{addr[1]} after {CONNECT_TIMEOUT_S:.0f}s: {e}"
                ) from e
            time.sleep(0.5)


def run_worker_node(cfg: EngineConfig, model_path: str) -> int:
    """Run this node's workers until they exit; the exit code for the process."""
    from pagebus.workers.main import worker_main  # imports torch only inside the worker processes

    head = _connect_to_head(cfg)
    head.settimeout(None)
    ep = node_endpoints(cfg)
    cfg_bytes = msgspec.msgpack.encode(cfg)
    ranks = local_ranks(cfg)
    log.info(
        "node %d of %d: workers %s, head %s:%d",
        cfg.node_rank,
        cfg.nnodes,
        list(ranks),
        cfg.master_addr,
        cfg.master_port,
    )
    args = (ep["handshake"], ep["results"], cfg.master_addr, cfg.master_port, ep["steps"])
    procs = [
        spawn(worker_main, f"worker-{r}", "worker", r, (cfg_bytes, model_path, r, b"", *args)) for r in ranks
    ]
    try:
        alive = {p.sentinel: p for p in procs}
        while alive:
            ready = multiprocessing.connection.wait([head, *alive])
            if head in ready:
                # A head that shuts down sends Shutdown first: give the workers a moment to obey.
                for p in alive.values():
                    p.join(5.0)
                if all(p.exitcode == 0 for p in procs):
                    return 0
                log.error("the head node closed its connection; stopping this node's workers")
                return 1
            for s in ready:
                p = alive.pop(s)  # type: ignore[arg-type]  # only sentinels (ints) here: the head returned above
                p.join(1.0)
                if p.exitcode != 0:
                    log.error(
                        "%s; stopping this node's workers", describe_death("worker", p.rank, p.exitcode)
                    )
                    return 1
        log.info("every worker of node %d exited", cfg.node_rank)
        return 0
    finally:
        shutdown(procs, timeout=2.0)
        head.close()
