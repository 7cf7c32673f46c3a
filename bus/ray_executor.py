"""`--distributed-executor-backend ray`: the workers as Ray actors on an existing Ray cluster.

The scheduler process joins the cluster (`--ray-address`, else RAY_ADDRESS, else the cluster that
`ray start --head` left on this machine), reserves one placement-group bundle per rank (one GPU
each on GPUs; `--num-threads` CPUs, default 1, on CPUs) and starts `workers.main.worker_main` in one
actor per bundle. Ray only places and watches them: torch.distributed still carries the
collectives, and the step plan, handshake and results travel over the same ZeroMQ tcp:// path a
worker on another node uses (bus/nodes.py). When every actor sits on the scheduler's node the bus
and the rendezvous stay on the loopback; otherwise they bind the head's node address, which the
network between the nodes must be trusted with (as with --nnodes).

Each actor looks like a spawned process to the scheduler (`RayWorker`, a `bus.proc.Child`): a
thread waits on its Ray task and closes a pipe when the task ends, so the scheduler's poller wakes
on an actor's death as on a process sentinel. Closing kills the actors and removes the placement
group; the user's cluster keeps running. Ray also ends the actors if the scheduler process dies,
as their owner.

Ray is an optional extra (`pip install 'pagebus[ray]'`), imported only here and only when asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import msgspec
from pagebus.bus.config import EngineConfig
from pagebus.bus.logs import LogFormat, configure_logging, current_format
from pagebus.bus.nodes import world_size
from pagebus.bus.proc import describe_exit

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a cluster that cannot hold the bundles by then is reported, not waited on
LOOPBACK = "127.0.0.1"


class RayExecutorError(RuntimeError):
    """Ray is missing, the cluster cannot be reached, or it cannot place the workers; the message says
    what to do."""


def import_ray() -> ModuleType:
    # Ray folds similar log lines of different actors into one ("[repeated 2x]"); each rank's
    # start-up layout and errors must reach the log as they are.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray
    except ImportError as e:
        raise RayExecutorError(
            f"--distributed-executor-backend ray needs Ray ({e}): pip install 'pagebus[ray]', "
            "or use the default --distributed-executor-backend mp"
        ) from None
    return ray


class PagebusWorker:
    """The actor (`ray::PagebusWorker.run` in ps): where it runs, a free port there, and one long
    call that runs the worker."""

    def where(self) -> tuple[str, str, int]:
        ray = import_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self, host: str) -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            port: int = s.getsockname()[1]
            return port

    def run(
        self, target: Callable[..., None], args: Sequence[Any], tag: str, level: int, fmt: LogFormat
    ) -> None:
        configure_logging(level, fmt, tag)
        target(*args)


class RayWorker:
    """One rank's actor, seen as a `bus.proc.Child`: its sentinel becomes readable when its Ray task
    ends, by returning (exit code 0) or by an error or the actor's death (1, reason kept)."""

    def __init__(self, ray: ModuleType, actor: Any, rank: int, pid: int, node_ip: str) -> None:
        self.role, self.rank = "worker", rank
        self._ray, self._actor, self._pid, self._node_ip = ray, actor, pid, node_ip
        self._done = threading.Event()
        self._code: int | None = None
        self._reason = ""
        self._r, self._w = os.pipe()

    def start(self, target: Callable[..., None], args: Sequence[Any]) -> None:
        level = logging.getLogger().getEffectiveLevel()
        ref = self._actor.run.remote(target, args, self.tag, level, current_format())
        threading.Thread(target=self._watch, args=(ref,), name=f"ray-{self.tag}", daemon=True).start()

    def _watch(self, ref: Any) -> None:
        try:
            self._ray.get(ref)
            self._code = 0
        except Exception as e:  # a worker error, the actor's death, or its cancellation
            self._code = 1
            self._reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._done.set()
        os.close(self._w)  # the sentinel reads EOF: readable

    @property
    def name(self) -> str:
        return self.tag

    @property
    def tag(self) -> str:
        return f"{self.role}-{self.rank}"

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        return self._r

    @property
    def exitcode(self) -> int | None:
        return self._code if self._done.is_set() else None

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already dead, or the cluster already gone
            self._ray.kill(self._actor, no_restart=True)

    def describe_death(self) -> str:
        where = f"Ray actor, pid {self._pid} on {self._node_ip}"
        if self._code == 1 and self._reason:
            return f"worker {self.rank} ({where}) died: {self._reason}"
        return f"worker {self.rank} ({where}) {describe_exit(self.exitcode)}"

    def close(self) -> None:
        os.close(self._r)


class RayWorkers:
    """The placement group and one actor per rank (not yet running the worker: see `start`)."""

    def __init__(self, cfg: EngineConfig) -> None:
        ray = self._ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        address = cfg.ray_address or "auto"  # auto: RAY_ADDRESS, else this machine's running cluster
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        except Exception as e:  # ConnectionError and friends, varying by Ray version
            raise RayExecutorError(
                f"cannot join a Ray cluster at {address!r} ({type(e).__name__}: {e}); start one with "
                "`ray start --head` and pass its address with --ray-address or RAY_ADDRESS"
            ) from None
        world = world_size(cfg)
        self.workers: list[RayWorker] = []
        self._pg: Any = None
        try:
            bundle, actor_opts = _bundle(cfg, world, ray.cluster_resources())
            self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RayExecutorError(
                    f"the Ray cluster cannot place {world} workers of {bundle} each within "
                    f"{PLACEMENT_TIMEOUT_S:.0f}s (it has {ray.cluster_resources()}): add nodes or lower "
                    "tensor/pipeline_parallel_size"
                )
            host_cls = ray.remote(PagebusWorker)
            actors = [
                host_cls.options(
                    **actor_opts,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=r
                    ),
                ).remote()
                for r in range(world)
            ]
            places = ray.get([a.where.remote() for a in actors], timeout=PLACEMENT_TIMEOUT_S)
            self.workers = [
                RayWorker(ray, a, r, pid, ip)
                for r, (a, (_, ip, pid)) in enumerate(zip(actors, places, strict=True))
            ]
            here = ray.get_runtime_context().get_node_id()
            local = all(node == here for node, _, _ in places)
            # All on this node: the bus and the rendezvous stay on the loopback. Else the head's node
            # address, which every node reaches, and rank 0's for the rendezvous it hosts.
            self.bus_host = LOOPBACK if local else ray.util.get_node_ip_address()
            self.dist_addr = LOOPBACK if local else places[0][1]
            self.dist_port: int = ray.get(actors[0].free_port.remote(self.dist_addr))
            log.info(
                "Ray placed %d workers (%s each): %s",
                world,
                bundle,
                ", ".join(f"rank {r} pid {pid} on {ip}" for r, (_, ip, pid) in enumerate(places)),
            )
        except BaseException:
            self.close()
            raise

    def actor_config(self, cfg: EngineConfig) -> EngineConfig:
        """The config the actors run with: on CPUs, as many torch threads as the bundle's CPUs (the
        mp path divides the node's cores instead, which a Ray actor must not assume)."""
        if _use_gpus(cfg, self._ray.cluster_resources(), world_size(cfg)):
            return cfg
        return msgspec.structs.replace(cfg, num_threads=cfg.num_threads or 1)

    def start(self, target: Callable[..., None], args: Callable[[int], Sequence[Any]]) -> list[RayWorker]:
        """Run `target(*args(rank))` in every actor; the handles the scheduler watches."""
        for w in self.workers:
            w.start(target, args(w.rank))
        return self.workers

    def close(self) -> None:
        """Kill the actors, free their bundles, leave the cluster (which keeps running)."""
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            w.kill()
        for w in self.workers:
            w.join(5.0)
            w.close()
        if self._pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        with contextlib.suppress(Exception):
            self._ray.shutdown()


def _use_gpus(cfg: EngineConfig, resources: dict[str, float], world: int) -> bool:
    if cfg.device.startswith("cuda"):
        return True
    return cfg.device == "auto" and resources.get("GPU", 0) >= world


def _bundle(
    cfg: EngineConfig, world: int, resources: dict[str, float]
) -> tuple[dict[str, float], dict[str, Any]]:
    """One rank's placement-group bundle and the matching actor options."""
    if _use_gpus(cfg, resources, world):
        # Ray gives each actor its own CUDA_VISIBLE_DEVICES, so every rank sees its GPU as cuda:0.
        return {"GPU": 1.0}, {"num_gpus": 1, "num_cpus": 0}
    cpus = cfg.num_threads or 1
    return {"CPU": float(cpus)}, {"num_cpus": cpus}
