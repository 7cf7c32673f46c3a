"""Two "nodes" on this machine: `pagebus serve --nnodes 2` as the head and `--node-rank 1` as a
worker node, on 127.0.0.1, serving a tiny random-weight model (the default model's tokenizer) at
TP=2 with one rank per node. A streaming request runs end to end; SIGKILL of the worker node's
rank fails the in-flight request with engine_dead, both launchers exit non-zero and no process
is left on either "node"."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bench.gpu_e2e import write_llama_config
from bench.ports import free_port
from tests.frontends.http.server_proc import ROOT, run_server, wait_all_exited

SHAPE = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512,
)  # fmt: skip


def _descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _worker_pid(parent: int, rank: int) -> int:
    for p in psutil.Process(parent).children(recursive=True):
        if f"pagebus::worker-{rank}" in " ".join(p.cmdline()):
            return p.pid
    raise AssertionError(f"no worker-{rank} under pid {parent}")


def test_two_nodes_serve_a_stream_and_a_killed_remote_rank_ends_both(tmp_path, default_model: str) -> None:
    write_llama_config(str(tmp_path), SHAPE)
    master = free_port(5)  # the rendezvous and the bus's ports
    common = [
        "--model", str(tmp_path), "--tokenizer", default_model, "--load-format", "dummy", "-tp", "2",
        "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master), "--num-kv-blocks", "64",
        "--max-model-len", "256",
    ]  # fmt: skip
    log = open(tmp_path / "node1.log", "wb")  # noqa: SIM115
    node = subprocess.Popen(
        [sys.executable, "-m", "pagebus.frontends.cli", "serve", "--dtype", "float32", *common, "--node-rank", "1"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        with run_server(*common) as head:
            body = {"prompt": "Count:", "max_tokens": 8, "ignore_eos": True, "stream": True}
            status, _, raw = head.request("POST", "/v1/completions", body)
            assert status == 200, raw
            chunks = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]
            assert len(chunks) == 8 and chunks[-1]["choices"][0]["finish_reason"] == "length", raw
            assert raw.decode().rstrip().endswith("data: [DONE]")

            engine = _descendants(head.proc.pid) + _descendants(node.pid) + [node.pid]
            conn = http.client.HTTPConnection("127.0.0.1", head.port, timeout=60)
            body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.readline().startswith(b"data: ")
            os.kill(_worker_pid(node.pid, 1), signal.SIGKILL)
            t0 = time.monotonic()
            rest = resp.read()
            assert time.monotonic() - t0 < 30
            assert b'"code":"engine_dead"' in rest, rest[-500:]
            conn.close()
            assert head.proc.wait(60) != 0, head.log()[-3000:]
            assert node.wait(30) != 0
            wait_all_exited(engine, 15, "every process of both nodes to exit")
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(10)
        log.close()


def test_a_layout_that_does_not_divide_over_the_nodes_is_refused() -> None:
    from pagebus.bus.config import make_engine_config

    with pytest.raises(ValueError, match=r"\(2\) must be a multiple of nnodes \(3\)"):
        make_engine_config(nnodes=3, tensor_parallel_size=2)
