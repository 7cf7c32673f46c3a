"""`pagebus serve -pp 2` on the default model (fp32, two stages of 15 layers over gloo, activations
sent point to point): the greedy text and logprobs of the 8 oracle prompts equal one in-process
rank's, each stage holds its own layers, and /metrics names the layout."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.distributed.test_served_tp import assert_greedy_equals_one_rank
from tests.frontends.http.server_proc import Server, run_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    args = ["-pp", "2", "--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--max-num-seqs", "8"]
    with run_server(*args) as s:
        yield s


def test_pp2_gives_one_rank_s_greedy_text_and_logprobs(server: Server, llm_fp32) -> None:
    assert_greedy_equals_one_rank(server, llm_fp32)
    layout = re.findall(
        r"layout: rank (\d)/2 \(tp 0/1, pp (\d)/2\) on cpu: layers (\d+)-(\d+) of 30", server.log()
    )
    assert sorted(layout) == [("0", "0", "0", "14"), ("1", "1", "15", "29")], server.log()[-3000:]
    m = server.metrics()
    assert m["pagebus:parallel_config_info{pipeline_parallel_size=2,tensor_parallel_size=1}"] == 1.0
