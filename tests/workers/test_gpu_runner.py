"""The runner on CUDA: a decode step never synchronises with the host, CUDA-graph replays give
the eager step's tokens, and the profiled KV budget leaves a maximal prefill step room to run.
Models are built from a config.json alone (load_format=dummy), so no checkpoint is needed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from pagebus.bus.config import EngineConfig
from pagebus.bus.messages import CachedSeq, ExecuteBatch, NewSeq, SamplingParams
from pagebus.workers.runner import ModelRunner

from bench.gpu_e2e import write_llama_config
from tests.workers.drive import drive_greedy

pytestmark = pytest.mark.gpu

SMALL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


@pytest.fixture(autouse=True)
def _free_cuda_memory() -> Iterator[None]:
    yield  # each test's runner (KV cache, graphs) goes before the next one measures memory
    gc.collect()
    torch.cuda.empty_cache()


def _runner(tmp_path, **kw: object) -> ModelRunner:
    write_llama_config(str(tmp_path), SMALL)
    return ModelRunner(
        EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda", **kw), str(tmp_path)
    )


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 1000 + 3 for j in range(n)]


def test_decode_steps_never_sync(tmp_path) -> None:
    # One size N means vLLM's pattern up to N: 1, 2, 4, then multiples of 8.
    r = _runner(tmp_path, dtype="bfloat16", kv_cache_memory=64 << 20, max_num_seqs=8, cuda_graph_sizes=[4])
    assert r.graphs is not None and r.graphs.sizes == [1, 2, 4]  # 3 sequences replay the size-4 graph
    # Each of the two checked decodes (the 2nd and the 4th) moves a sequence into a new block.
    lens = [13, 15, 46]
    next_block = iter(range(1, 1000))
    blocks = {f"s{i}": [next(next_block) for _ in range(-(-n // 16))] for i, n in enumerate(lens)}
    new = [NewSeq(f"s{i}", _prompt(i, n), n, GREEDY, blocks[f"s{i}"], 0, n) for i, n in enumerate(lens)]
    r.execute(ExecuteBatch(0, new, [], []))
    ctx = list(lens)

    def decode_batch(step: int) -> ExecuteBatch:
        cached = []
        for i in range(3):
            sid = f"s{i}"
            grow = [next(next_block) for _ in range(-(-(ctx[i] + 1) // 16) - len(blocks[sid]))]
            blocks[sid].extend(grow)
            cached.append(CachedSeq(sid, grow, ctx[i], 1))
            ctx[i] += 1
        return ExecuteBatch(step, [], cached, [])

    graphs = r.graphs
    step = 1
    for mode in (graphs, None):  # a graph replay, then the eager path
        r.graphs = mode
        r.execute(decode_batch(step))  # warm: any kernel specialization compiles here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            res = r.execute(decode_batch(step + 1))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(res.token_ids) == 3
        step += 2
    r.graphs = graphs


def _drive(r: ModelRunner, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    return drive_greedy(r, prompts)[0]


def test_graph_replay_gives_the_eager_tokens(tmp_path) -> None:
    # fp32, so the padded batch's matmuls cannot flip a near-tie that bf16 rounding might
    r = _runner(
        tmp_path, dtype="float32", kv_cache_memory=128 << 20, max_num_seqs=16, max_num_batched_tokens=64,
        cuda_graph_sizes=[1, 2, 4, 8],
    )  # fmt: skip
    assert r.graphs is not None
    with torch.no_grad():  # wider than the dummy init, so logits are far from ties
        for p in r.model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    # Different lengths and output counts: the batch shrinks 5 -> 1 (padded to 8, 4, 2, 1).
    prompts = {f"r{i}": (_prompt(i, 3 + 9 * i), 4 + 3 * i) for i in range(5)}
    graphs = r.graphs
    replays = 0
    replay = graphs.replay

    def counting_replay(size: int) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(size)

    graphs.replay = counting_replay  # type: ignore[method-assign]
    with_graphs = _drive(r, prompts)
    assert replays > 0
    r.graphs = None
    eager = _drive(r, prompts)
    r.graphs = graphs
    assert with_graphs == eager
    assert all(len(with_graphs[rid]) == n for rid, (_, n) in prompts.items())

    # A pure-decode step where one sequence does not sample (a one-token prefill chunk): the
    # replay's logits are gathered, not sliced.
    base = 200
    a, b = _prompt(9, 10), _prompt(8, 6)
    r.execute(ExecuteBatch(base, [NewSeq("a", a, 10, GREEDY, [base], 0, 10)], [], []))
    mixed = ExecuteBatch(
        base + 1, [NewSeq("b", b, 6, GREEDY, [base + 1], 0, 1)], [CachedSeq("a", [], 10, 1)], []
    )
    got = r.execute(mixed)
    r.graphs = None
    r.execute(ExecuteBatch(base + 2, [NewSeq("a", a, 10, GREEDY, [base + 2], 0, 10)], [], ["a", "b"]))
    want = r.execute(
        ExecuteBatch(base + 3, [NewSeq("b", b, 6, GREEDY, [base + 3], 0, 1)], [CachedSeq("a", [], 10, 1)], [])
    )
    r.graphs = graphs
    assert got.seq_ids == want.seq_ids == ["a"] and got.token_ids == want.token_ids


def test_profiled_kv_budget_leaves_room_for_a_maximal_prefill(tmp_path) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    util = min(1.0, (total - free + (4 << 30)) / total)  # 4 GiB beyond what is in use now
    seqs, per_seq = 64, 64
    r = _runner(
        tmp_path,
        dtype="bfloat16",
        gpu_memory_utilization=util,
        max_num_seqs=seqs,
        max_num_batched_tokens=seqs * per_seq,
    )
    blocks_per_seq = per_seq // r.cfg.block_size
    assert r.num_blocks > seqs * blocks_per_seq  # the budget came out of the profile, not a default
    new = [
        NewSeq(f"p{i}", _prompt(i, per_seq), per_seq, GREEDY,
               list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)), 0, per_seq)
        for i in range(seqs)
    ]  # fmt: skip
    res = r.execute(ExecuteBatch(0, new, [], []))
    assert len(res.token_ids) == seqs
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    # Everything on the device (weights, KV cache, the step's activations still cached, graphs)
    # stays within the share asked for, give or take allocator rounding.
    assert total - free_after <= util * total + (64 << 20)
