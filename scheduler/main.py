"""The scheduler process: a thin loop around `Scheduler` that owns the sockets (no torch here).

    tokenizer pools --ROUTER--> [scheduler] --shm ring--> workers --PUSH--> [scheduler]
    [scheduler] --PUSH per pool (one StepOutput per step, only that pool's requests)--> pools

It spawns the workers itself: it writes their ring and must notice a dead worker at once, so it
holds their sentinels. Idle, it blocks in one zmq.Poller (inputs, results, sentinels): ~0% CPU.
Any worker death or fatal error sends EngineDead to every pool and exits non-zero.
With `-pp M` and M steps in flight (bus/config.py steps_in_flight) it plans a step of each idle
virtual engine (scheduler/virtual.py) before waiting for the oldest result; with one stage and
async scheduling it keeps two steps of one Scheduler in flight, so the workers find step N+1 in
the ring when they finish step N.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from pagebus.bus.codec import Codec, pack_frames
from pagebus.bus.config import EngineConfig, async_scheduling, steps_in_flight
from pagebus.bus.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    BatchResult,
    EngineDead,
    ExecuteBatch,
    FinishReason,
    FromWorker,
    Hello,
    ModelFacts,
    Ready,
    SeqUpdate,
    Shutdown,
    StartupFailed,
    StepOutput,
    ToScheduler,
    WorkerFailed,
)
from pagebus.bus.nodes import liveness_address, local_ranks, node_endpoints, world_size
from pagebus.bus.proc import Child, StartupError, freeze_heap, shutdown, spawn, wait_ready
from pagebus.bus.shm import ShmRingWriter
from pagebus.bus.sockets import Channel, make_socket
from pagebus.scheduler.scheduler import Scheduler
from pagebus.scheduler.virtual import VirtualEngines

if TYPE_CHECKING:
    from pagebus.bus.ray_executor import RayWorkers

log = logging.getLogger(__name__)

LINGER_MS = 2_000
SEND_TIMEOUT_S = 30.0  # a pool that stops reading for this long is as good as dead
RING_TIMEOUT_S = 60.0
DIST_ADDR = "127.0.0.1"  # one box: the rendezvous listens on the loopback only
INBOUND_HWM = 10_000
PEER_DEATH_WAIT_S = 0.5  # after a rank's collective failed: time for a dead peer's sentinel to show  # ROUTER input: per-pool pipe; senders block (not drop) when it is full


class EngineFatal(RuntimeError):
    """The engine cannot go on; the message is the client-safe reason."""


def scheduler_main(
    cfg_bytes: bytes, model_path: str, addrs: dict[str, str], n_pools: int, worker_target: Callable[..., None]
) -> None:
    """Entry point. `worker_target` is `workers.main.worker_main`, passed in so this module never
    imports the worker package (and with it torch)."""
    cfg = msgspec.msgpack.decode(cfg_bytes, type=EngineConfig)
    ctx: zmq.Context[Any] = zmq.Context()
    hs = Channel(make_socket(ctx, zmq.PUSH, addrs["handshake"], bind=False, linger_ms=LINGER_MS))
    hs.send(Hello(version=PROTOCOL_VERSION, role="scheduler", rank=0, pid=os.getpid()))
    world, local = world_size(cfg), local_ranks(cfg)  # this node runs ranks 0 .. len(local) - 1
    ray_workers = _place_on_ray(cfg, hs, ctx) if cfg.distributed_executor_backend == "ray" else None
    ring = None if ray_workers else ShmRingWriter(len(local), addrs["ring"], ctx=ctx)
    results = Channel.open(ctx, zmq.PULL, addrs["worker_out"], bind=True, recv_type=FromWorker)
    whs = make_socket(ctx, zmq.PULL, addrs["worker_handshake"], bind=True, linger_ms=0)
    ring_handle = msgspec.msgpack.encode(ring.handle) if ring else b""
    pub: zmq.Socket[Any] | None = None
    liveness: socket.socket | None = None
    workers: Sequence[Child]
    if ray_workers is not None:  # every actor hears the steps over tcp://, like a worker node's
        host = f"tcp://{ray_workers.bus_host}:*"
        pub = make_socket(ctx, zmq.PUB, host, bind=True, hwm=0, linger_ms=LINGER_MS)
        results.sock.bind(host)
        whs.bind(host)
        steps_ep, res_ep, hs_ep = (_bound(s) for s in (pub, results.sock, whs))
        actor_cfg = msgspec.msgpack.encode(ray_workers.actor_config(cfg))
        dist = (ray_workers.dist_addr, ray_workers.dist_port)
        workers = ray_workers.start(
            worker_target, lambda r: (actor_cfg, model_path, r, b"", hs_ep, res_ep, *dist, steps_ep, 0)
        )
    elif cfg.nnodes > 1:  # the other nodes' workers reach the same sockets over tcp:// (bus/nodes.py)
        ep = node_endpoints(cfg)
        results.sock.bind(ep["results"])
        whs.bind(ep["handshake"])
        pub = make_socket(ctx, zmq.PUB, ep["steps"], bind=True, hwm=0, linger_ms=LINGER_MS)
        liveness = socket.create_server(liveness_address(cfg), backlog=64)  # never accepted: see bus/nodes.py
        dist_addr, dist_port = cfg.master_addr, cfg.master_port
    else:
        dist_addr, dist_port = DIST_ADDR, _free_port() if world > 1 else 0  # the ranks' rendezvous
    steps = _Steps(ring, pub)
    if ray_workers is None:
        workers = [
            spawn(
                worker_target,
                f"worker-{r}",
                "worker",
                r,
                (cfg_bytes, model_path, r, ring_handle, addrs["worker_handshake"], addrs["worker_out"])
                + ((dist_addr, dist_port) if world > 1 else ()),
            )
            for r in local
        ]
    outs = {
        f"tok-{i}".encode(): Channel(make_socket(ctx, zmq.PUSH, addrs[f"tok_step_{i}"], bind=False))
        for i in range(n_pools)
    }
    # Bound before the workers load, not once they are ready: the pools and the launcher connect
    # at their start, and a connect that finds no socket yet is retried only every 100 ms (zmq's
    # reconnect interval), so a late bind held the first requests back by up to that much.
    inbound = make_socket(ctx, zmq.ROUTER, addrs["scheduler_in"], bind=True, hwm=INBOUND_HWM)
    code = 1
    try:
        try:
            ready = wait_ready(whs, workers, {("worker", r) for r in range(world)}, 3600.0)
        except StartupError as e:  # tell the launcher which worker failed, not just "scheduler exited"
            role, rank = (e.role, e.rank) if e.role is not None and e.rank is not None else ("scheduler", 0)
            hs.send(StartupFailed(role=role, rank=rank, reason=str(e)))
            raise
        f0 = _model_facts(ready, world, cfg.tensor_parallel_size)
        depth = steps_in_flight(cfg, f0.device)  # as every worker derives it from its device
        lookahead = async_scheduling(cfg, depth)
        log.info("pipeline steps in flight: %d; async scheduling: %s", depth, "on" if lookahead else "off")
        if cfg.async_scheduling and not lookahead:  # asked for, but the pipeline keeps steps in flight
            log.warning(
                "async_scheduling is off: %d pipeline steps in flight already overlap planning and running",
                depth,
            )
        sched: Scheduler | VirtualEngines = (
            VirtualEngines(cfg, f0.num_kv_blocks, f0.max_model_len, f0.eos_token_id, depth)
            if depth > 1
            else Scheduler(cfg, f0.num_kv_blocks, f0.max_model_len, f0.eos_token_id, lookahead=lookahead)
        )
        pids = [p.pid or 0 for p in workers]
        freeze_heap()
        hs.send(Ready(role="scheduler", rank=0, model=f0, worker_pids=pids))
        loop = _Loop(sched, steps, results, inbound, outs, workers)
        try:
            loop.run()
            code = 0
        except EngineFatal as e:
            log.error("engine dead: %s", e)
            loop.broadcast(EngineDead(reason=str(e)))
        except Exception as e:
            log.error("scheduler failed:\n%s", traceback.format_exc())
            loop.broadcast(EngineDead(reason=f"scheduler failed: {type(e).__name__}: {e}"))
    finally:
        inbound.close()
        if code == 0:
            try:
                steps.write(pack_frames(Codec().encode(Shutdown(drain=False))), timeout_s=5.0)
            except TimeoutError:
                log.warning("could not send Shutdown to the workers")
        shutdown(workers, timeout=10.0 if code == 0 else 0.5)
        if ray_workers is not None:
            ray_workers.close()
        steps.close()
        if liveness is not None:
            liveness.close()  # resets the worker nodes' connections: they stop their workers
        for ch in (hs, results, *outs.values()):
            ch.close()
        whs.close()
        ctx.term()
    if code:
        raise SystemExit(code)


def _place_on_ray(cfg: EngineConfig, hs: Channel, ctx: zmq.Context[Any]) -> RayWorkers:
    """Join the Ray cluster and place one actor per rank; a failure (no Ray, no cluster, too few
    resources) reaches the launcher as StartupFailed with what to do."""
    from pagebus.bus.ray_executor import RayWorkers  # Ray is imported only when asked for

    try:
        return RayWorkers(cfg)
    except Exception as e:
        hs.send(StartupFailed(role="scheduler", rank=0, reason=str(e)))
        hs.close()
        ctx.term()
        raise


def _bound(sock: zmq.Socket[Any]) -> str:
    """The endpoint a socket bound on port * got."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _free_port() -> int:
    """A TCP port free on the loopback now (the rank-0 worker binds it a moment later)."""
    with socket.socket() as s:
        s.bind((DIST_ADDR, 0))
        port: int = s.getsockname()[1]
        return port


def _model_facts(ready: dict[tuple[str, int], Ready], world: int, tp: int) -> ModelFacts:
    """The result rank's facts, with the KV block count every rank can hold: one block id names
    the same block in each rank's cache (each holding its own heads and layers)."""
    facts = [ready[("worker", r)].model for r in range(world)]
    present = [f for f in facts if f is not None]
    if len(present) != world:
        raise StartupError("a worker sent Ready without its model facts (protocol error)")
    blocks = min(f.num_kv_blocks for f in present)
    return msgspec.structs.replace(present[world - tp], num_kv_blocks=blocks)


class _Steps:
    """The step broadcast: the shm ring to this node's workers and, with several nodes, the same
    bytes over PUB to the others' (which subscribe before they send Ready)."""

    def __init__(self, ring: ShmRingWriter | None, pub: zmq.Socket[Any] | None) -> None:
        self.ring, self.pub = ring, pub

    def write(self, payload: bytes, timeout_s: float) -> None:
        if self.ring is not None:
            self.ring.write(payload, timeout_s=timeout_s)
        if self.pub is not None:
            self.pub.send(payload)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        if self.pub is not None:
            self.pub.close()  # with linger: a last Shutdown still leaves


class _Loop:
    def __init__(
        self,
        sched: Scheduler | VirtualEngines,
        ring: _Steps,
        results: Channel,
        inbound: zmq.Socket[Any],
        outs: dict[bytes, Channel],
        workers: Sequence[Child],
    ) -> None:
        self.sched, self.ring, self.results, self.inbound = sched, ring, results, inbound
        # Steps sent and not yet answered, oldest first: one per virtual engine, or two with async
        # scheduling. The last stage runs them in order, so results come back in this order.
        self.in_flight: deque[ExecuteBatch] = deque()
        self.depth = sched.max_in_flight
        self.outs, self.workers = outs, workers
        self.codec = Codec()
        self.origin: dict[str, bytes] = {}  # request id -> the pool that owns it
        self.pending: list[SeqUpdate] = []  # rejections and aborts, sent with the next step
        self.draining = False
        self.stopping = False
        self.poller = zmq.Poller()
        self.poller.register(inbound, zmq.POLLIN)
        self.poller.register(results.sock, zmq.POLLIN)  # a WorkerFailed may arrive while idle
        self.sentinels = {p.sentinel: p for p in workers}
        for s in self.sentinels:
            self.poller.register(s, zmq.POLLIN)

    def run(self) -> None:
        while not self.stopping:
            busy = self.sched.has_unfinished() or bool(self.pending) or bool(self.in_flight)
            if self.draining and not busy:
                log.info("drained; exiting")
                return
            events = dict(self.poller.poll(0 if busy else None))  # idle: block, no busy loop
            self._check_workers(events)
            if self.inbound in events:
                self._drain_inbound()
            self._step()

    def _check_workers(self, events: dict[Any, int]) -> None:
        for s, p in self.sentinels.items():
            if s in events:
                p.join(1.0)
                raise EngineFatal(p.describe_death())
        if self.results.sock in events and not self.in_flight:  # else _wait_result reads it
            msg = self.results.recv_now()
            if isinstance(msg, WorkerFailed):
                raise self._failure(msg)
            raise EngineFatal(f"unexpected {type(msg).__name__} from a worker while idle")

    def _failure(self, msg: WorkerFailed) -> EngineFatal:
        """A rank whose peer died fails in its next collective, often before the peer's sentinel
        is seen: name the dead process when there is one, not the error it caused."""
        dead = multiprocessing.connection.wait(list(self.sentinels), timeout=PEER_DEATH_WAIT_S)
        for s in dead:
            p = self.sentinels[s]  # type: ignore[index]  # wait() typed wide; here only sentinels (ints)
            p.join(1.0)
            return EngineFatal(p.describe_death())
        return EngineFatal(f"worker {msg.rank} failed: {msg.reason}")

    def _drain_inbound(self) -> None:
        dec = self.codec.decoder(ToScheduler)
        while True:
            try:
                ident, *frames = self.inbound.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            match dec.decode(frames[0]):
                case AddRequest() as req:
                    self._add(ident, req)
                case AbortRequest(request_ids=ids, samples=samples):
                    self.pending.extend(self.sched.abort(ids, samples))
                case Shutdown(drain=drain):
                    log.info("shutdown (drain=%s)", drain)
                    self.draining = True
                    if not drain:
                        self.pending.extend(self.sched.abort(list(self.sched.requests)))
                        self.stopping = True

    def _add(self, ident: bytes, req: AddRequest) -> None:
        self.origin.setdefault(req.request_id, ident)
        if self.draining:  # intake is closed; say so rather than leave the request hanging
            self.pending.append(
                SeqUpdate(req.request_id, 0, [], FinishReason.ERROR, error="the engine is shutting down")
            )
            return
        self.pending.extend(self.sched.add_request(req))

    def _step(self) -> None:
        updates, self.pending = self.pending, []
        while len(self.in_flight) < self.depth:
            planned = self.sched.schedule()
            if planned is None:
                break
            self.ring.write(pack_frames(self.codec.encode(planned)), timeout_s=RING_TIMEOUT_S)
            self.in_flight.append(planned)
        batch = self.in_flight.popleft() if self.in_flight else None
        if batch is not None:
            updates.extend(self.sched.update(batch, self._wait_result(batch)))
        if updates:
            self._send(updates)
        elif batch is not None:
            # A step with no token out (a prefill chunk): the stats alone tell the frontend that
            # the engine moves, which its stall detection counts per step.
            stats = StepOutput(updates=[], stats=self.sched.stats())
            next(iter(self.outs.values())).send(stats, timeout_s=SEND_TIMEOUT_S)

    def _wait_result(self, batch: ExecuteBatch) -> BatchResult:
        poller = zmq.Poller()
        poller.register(self.results.sock, zmq.POLLIN)
        for s in self.sentinels:
            poller.register(s, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))  # sentinels wake us at once on a death
            if self.results.sock in events:
                msg = self.results.recv_now()
                if isinstance(msg, WorkerFailed):
                    raise self._failure(msg)
                if msg.step_id != batch.step_id:
                    raise EngineFatal(f"worker answered step {msg.step_id}, expected {batch.step_id}")
                return msg  # type: ignore[no-any-return]
            self._check_workers({k: v for k, v in events.items() if k in self.sentinels})

    def _send(self, updates: list[SeqUpdate]) -> None:
        by_pool: dict[bytes, list[SeqUpdate]] = {}
        for u in updates:
            ident = self.origin.get(u.request_id)
            if ident is not None:
                by_pool.setdefault(ident, []).append(u)
        stats = self.sched.stats()
        for ident, us in by_pool.items():
            ch = self.outs.get(ident)
            if ch is None:
                log.warning("updates for unknown pool %r dropped", ident)
                continue
            ch.send(StepOutput(updates=us, stats=stats), timeout_s=SEND_TIMEOUT_S)
        for rid in {u.request_id for u in updates}:
            if rid not in self.sched.requests:
                self.origin.pop(rid, None)

    def broadcast(self, msg: EngineDead) -> None:
        for ch in self.outs.values():
            try:
                ch.send(msg, timeout_s=1.0)
            except Exception:
                log.exception("could not send EngineDead")
