"""`pagebus serve -tp 2` on the default model (fp32, two worker processes over gloo): the same
greedy text and chosen-token logprobs as one in-process rank, each rank holding about half the
weights, the scheduler using the smaller rank's KV block count, the layout on /metrics; last, a
SIGKILLed rank fails the in-flight request, the server exits non-zero and no process is left.

Every test runs twice: with the default executor (`mp`, spawned processes) and with
`--distributed-executor-backend ray` on a Ray head this module starts on the machine (2 CPUs, no
dashboard), where the workers are Ray actors; after the ray server's end the cluster still runs,
with every CPU free and the placement group removed.

Tests run in file order and share each backend's server; the last one ends it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.frontends.http.server_proc import (
    Server,
    engine_pid,
    free_port,
    run_server,
    wait_all_exited,
    wait_until,
)
from tests.workers.oracle import PROMPTS

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
# fp32: splitting a matmul's sum over two ranks moves logits by ~1e-5; a logprob by far less than this.
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """`ray start --head` on this machine alone; its address. Stopped (SIGTERM to `ray start
    --block`, which stops what it started) when the module is done."""
    tmp = tempfile.mkdtemp(prefix="pbray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    log_path = os.path.join(tmp, "head.log")
    port = free_port()
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", "--port", str(port),
        "--num-cpus", "2", "--include-dashboard=false", "--object-store-memory", str(80 << 20),
        "--temp-dir", tmp, "--disable-usage-stats",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def started() -> bool:
        with open(log_path) as f:
            text = f.read()
        assert proc.poll() is None, text
        return "Ray runtime started" in text

    try:
        wait_until(started, 60, "the Ray head to start")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=["mp", "ray"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    args = ["-tp", "2", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--max-num-seqs", "8"]
    if request.param == "ray":
        args += [
            "--distributed-executor-backend",
            "ray",
            "--ray-address",
            request.getfixturevalue("ray_head"),
        ]
    with run_server(*args) as s:
        yield s


def _ray_backend(server: Server) -> bool:
    return "--distributed-executor-backend" in list(server.proc.args)  # type: ignore[arg-type]


def _worker_pids(server: Server) -> dict[int, int]:
    """rank -> pid of each worker: spawned processes under the server, or its Ray actors (which
    the Ray cluster's raylet starts; the scheduler logs where it placed them)."""
    if not _ray_backend(server):
        return {r: engine_pid(server, "worker", r) for r in range(2)}
    placed = re.search(r"Ray placed 2 workers .*?: (.*)", server.log())
    assert placed, server.log()[-3000:]
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", placed.group(1))}


def _post(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw
    return json.loads(raw)  # type: ignore[no-any-return]


def test_greedy_text_and_logprobs_equal_one_rank(server: Server, llm_fp32) -> None:
    assert_greedy_equals_one_rank(server, llm_fp32)


def assert_greedy_equals_one_rank(server: Server, llm_fp32: Any) -> None:
    """The oracle prompts in one request, greedy: the text and chosen-token logprobs of an
    in-process TP=1 engine (also used by test_served_pp.py)."""
    from pagebus import SamplingParams

    body = {"prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    got = sorted(_post(server, body)["choices"], key=lambda c: c["index"])
    want = llm_fp32.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    )
    for prompt, choice, out in zip(PROMPTS, got, want, strict=True):
        ref = out.outputs[0]
        assert choice["text"] == ref.text, prompt
        ref_lps = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        lps = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < LOGPROB_ATOL, prompt


def test_each_rank_holds_about_half_the_weights_and_its_own_heads(server: Server, llm_fp32) -> None:
    model = llm_fp32.engine.runner.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    whole = sum(t.numel() * t.element_size() for t in tensors.values())
    log = server.log()
    layout = re.findall(
        r"layout: rank (\d)/2 .*?attention heads (\d+)-(\d+) of 9, .*?weight bytes (\d+)", log
    )
    assert sorted(r for r, *_ in layout) == ["0", "1"], log[-3000:]
    for _, _, _, nbytes in layout:
        assert 0.4 < int(nbytes) / whole < 0.6, (nbytes, whole)
    # 9 heads in 3 KV groups: 6 on rank 0, 3 on rank 1
    assert sorted((int(a), int(b)) for _, a, b, _ in layout) == [(0, 5), (6, 8)]
    # The rank with fewer KV heads fits more blocks; the scheduler takes the smaller count.
    per_rank = [int(n) for n in re.findall(r"KV cache: (\d+) blocks of 16 tokens(?:, \S+)? \(", log)]
    engine = re.findall(r"KV cache: (\d+) blocks of 16 tokens, \d+ tokens;", log)
    assert len(per_rank) == 2 and max(per_rank) == 2 * min(per_rank), log[-3000:]  # 2 KV heads vs 1
    assert engine == [str(min(per_rank))], log[-3000:]


def test_metrics_name_the_layout(server: Server) -> None:
    m = server.metrics()
    assert m["pagebus:parallel_config_info{pipeline_parallel_size=1,tensor_parallel_size=2}"] == 1.0


def test_sigkill_of_rank_1_fails_in_flight_and_the_server_exits_nonzero(server: Server) -> None:
    # Last: it ends the shared server.
    workers = _worker_pids(server)
    engine = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)] + list(
        workers.values()
    )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # decoding: rank 0 meets rank 1 in every all-reduce
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.monotonic()
    rest = resp.read()  # ends with an in-band error event, then [DONE]
    assert time.monotonic() - t0 < 30
    assert b'"code":"engine_dead"' in rest, rest[-500:]
    assert b"worker 1" in rest, rest[-500:]
    conn.close()
    assert server.proc.wait(60) != 0, server.log()[-3000:]

    wait_all_exited(engine, 15, "every engine process (and Ray actor) to exit after the server")
    if _ray_backend(server):
        _assert_ray_cluster_freed(server)


# Prints [free CPUs, the placement groups' states] of the cluster at argv[1].
_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="error")
print(json.dumps([ray.available_resources().get("CPU"), [g["state"] for g in ray.util.placement_group_table().values()]]))
"""


def _assert_ray_cluster_freed(server: Server) -> None:
    """The user's cluster still runs, with both CPUs free and no placement group left."""
    args = list(server.proc.args)  # type: ignore[arg-type]
    address = args[args.index("--ray-address") + 1]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, address], capture_output=True, text=True, timeout=60, check=True
    )
    cpus, states = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpus == 2.0 and set(states) <= {"REMOVED"}, out.stdout
