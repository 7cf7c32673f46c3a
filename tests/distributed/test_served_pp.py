"""`pagebus serve -pp 2` on the default model (fp32, two stages of 15 layers over gloo, activations
sent point to point), at both pipeline depths: one step at a time (the CPU's auto) and two steps
in flight over two virtual engines (scheduler/virtual.py, forced). Each gives the greedy text and
logprobs of the 8 oracle prompts of one in-process rank (the same reference for both), each stage
holds its own layers, and /metrics names the layout."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.distributed.test_served_tp import assert_greedy_equals_one_rank
from tests.frontends.http.server_proc import Server, run_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[None, 2], ids=["auto_depth1", "depth2"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Server, int]]:
    args = ["-pp", "2", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--max-num-seqs", "8"]
    depth = request.param
    if depth is not None:
        args += ["--pipeline-steps-in-flight", str(depth)]
    with run_server(*args) as s:
        yield s, depth or 1  # auto on CPU workers: one step at a time


def test_pp2_gives_one_rank_s_greedy_text_and_logprobs(server: tuple[Server, int], llm_fp32) -> None:
    srv, depth = server
    assert_greedy_equals_one_rank(srv, llm_fp32)
    assert f"pipeline steps in flight: {depth}" in srv.log(), srv.log()[-3000:]
    layout = re.findall(
        r"layout: rank (\d)/2 \(tp 0/1, pp (\d)/2\) on cpu: layers (\d+)-(\d+) of 30", srv.log()
    )
    assert sorted(layout) == [("0", "0", "0", "14"), ("1", "1", "15", "29")], srv.log()[-3000:]
    m = srv.metrics()
    assert m["pagebus:parallel_config_info{pipeline_parallel_size=2,tensor_parallel_size=1}"] == 1.0
