"""The runner's step inputs on CPU: no op reads step metadata back from a tensor, the
persistent block table follows the scheduler's deltas, padded decode steps (what a CUDA graph
replays) give the eager tokens, load_format=dummy needs only a config.json, and the CUDA-only
options are accepted and inert here."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from pagebus.bus.config import EngineConfig, cuda_graph_batch_sizes
from pagebus.bus.messages import CachedSeq, ExecuteBatch, NewSeq, SamplingParams
from pagebus.kernels.paged_attention import paged_attention_ref
from pagebus.workers.runner import ModelRunner
from torch.overrides import TorchFunctionMode

from bench.gpu_e2e import TINY, write_llama_config
from tests.workers.drive import drive_greedy

_READBACKS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.numpy,
}


class NoReadback(TorchFunctionMode):
    """Fails on any tensor -> Python value conversion: on CUDA each one is a host sync."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READBACKS:
            raise AssertionError(f"{func.__name__} read a tensor back during the forward")
        return func(*args, **(kwargs or {}))


def _tiny_runner(tmp_path, num_kv_blocks: int = 128, **kw: Any) -> ModelRunner:
    write_llama_config(str(tmp_path), TINY)
    cfg = EngineConfig(
        model=str(tmp_path), load_format="dummy", dtype="float32", num_kv_blocks=num_kv_blocks, **kw
    )
    runner = ModelRunner(cfg, str(tmp_path))
    with torch.no_grad():  # wider than the dummy init, so greedy tokens are far from ties
        for p in runner.model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
    return runner


def _drive(runner: ModelRunner, prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    return drive_greedy(runner, prompts)[0]


PROMPTS = {f"r{i}": ([(11 * i + 5 * j) % 500 + 3 for j in range(2 + 7 * i)], 3 + 2 * i) for i in range(5)}


def test_ref_attention_takes_the_host_lists() -> None:
    torch.manual_seed(0)
    blocks, bs, kvh, d = 8, 4, 2, 16
    k, v = torch.randn(blocks, bs, kvh, d), torch.randn(blocks, bs, kvh, d)
    table = torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 0]], dtype=torch.int32)
    lens, starts = [9, 5, 6], [0, 3, 4, 10]  # a prefill chunk, a decode, a whole prompt
    q = torch.randn(10, 4, d)
    want = paged_attention_ref(q, k, v, table, torch.tensor(lens), torch.tensor(starts), 0.25)
    # Metadata tensors on the meta device hold no values: any read of them would fail.
    meta_lens, meta_starts = torch.empty(3, device="meta"), torch.empty(4, device="meta")
    got = paged_attention_ref(
        q, k, v, table, meta_lens, meta_starts, 0.25,
        max_query_len=6, max_seq_len=9, seq_lens_host=lens, query_start_loc_host=starts,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_no_op_reads_a_tensor_back_in_the_forward(tmp_path, backend: str) -> None:
    runner = _tiny_runner(tmp_path, attention_backend=backend, max_num_batched_tokens=24)
    forward = runner.model.forward

    def guarded(fb: Any) -> torch.Tensor:
        with NoReadback():
            return forward(fb)

    runner.model.forward = guarded  # type: ignore[method-assign]
    prompts = {rid: p for rid, p in list(PROMPTS.items())[:3]}
    got = _drive(runner, prompts)  # prefill chunks, mixed steps and decodes
    runner.model.forward = forward  # type: ignore[method-assign]
    assert got == _drive(runner, prompts)


def test_block_table_rows_follow_the_deltas(tmp_path) -> None:
    runner = _tiny_runner(tmp_path, block_size=4, max_num_seqs=4)
    table = runner.inputs.block_table
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runner.execute(ExecuteBatch(0, [NewSeq("a", list(range(3, 10)), 7, params, [5, 9], 0, 7)], [], []))
    runner.execute(
        ExecuteBatch(1, [NewSeq("b", [4, 5, 6], 3, params, [11], 0, 3)], [CachedSeq("a", [], 7, 1)], [])
    )
    row_a, row_b = runner.seqs["a"].row, runner.seqs["b"].row
    assert row_a != row_b
    runner.execute(ExecuteBatch(2, [], [CachedSeq("a", [12], 8, 1), CachedSeq("b", [], 3, 1)], []))
    assert table[row_a, :3].tolist() == [5, 9, 12] and table[row_b, :1].tolist() == [11]
    # b leaves; c takes its row, and only c's own blocks matter in it
    runner.execute(ExecuteBatch(3, [NewSeq("c", [7] * 5, 5, params, [20, 21], 0, 5)], [], ["b"]))
    assert runner.seqs["c"].row == row_b and table[row_b, :2].tolist() == [20, 21]
    assert table[runner.inputs.pad_row].count_nonzero() == 0  # padding still reads block 0


def test_steps_planned_ahead_give_the_same_tokens(tmp_path) -> None:
    """Async scheduling: every step planned before the previous one's result, the worker taking
    the tokens it sampled itself; with chunked prefill and a cache small enough to preempt."""
    runner = _tiny_runner(tmp_path, num_kv_blocks=16, block_size=4, max_num_batched_tokens=16)
    want, _ = drive_greedy(runner, PROMPTS)
    got, sched = drive_greedy(runner, PROMPTS, lookahead=True)
    assert got == want
    assert sched.stats().num_preemptions > 0
    assert sched.num_free_blocks == sched.block_pool.num_usable


class EagerGraphs:
    """DecodeGraphs' interface on CPU: 'capturing' size B keeps the forward over B's fixed
    buffer views, and a replay runs it on whatever the step loaded there, as a graph would."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        self.sizes = sizes
        self.forwards = {size: runner._graph_forward(size) for size in sizes}
        self.replayed: list[int] = []

    def size_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def replay(self, size: int) -> torch.Tensor:
        self.replayed.append(size)
        return self.forwards[size]()


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_padded_decode_steps_give_the_eager_tokens(tmp_path, backend: str) -> None:
    runner = _tiny_runner(tmp_path, attention_backend=backend, max_num_batched_tokens=128)
    eager = _drive(runner, PROMPTS)
    graphs = EagerGraphs(runner, [2, 4, 8])
    runner.graphs = graphs  # type: ignore[assignment]
    padded = _drive(runner, PROMPTS)
    # One prefill step, then 5 decoding (padded to 8), 4 and 3 (to 4), 2 and 1 (to 2).
    assert set(graphs.replayed) == {2, 4, 8}
    assert padded == eager
    assert all(len(padded[rid]) == n for rid, (_, n) in PROMPTS.items())


def test_dummy_load_format_needs_only_a_config(tmp_path) -> None:
    write_llama_config(str(tmp_path), TINY)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=16), str(tmp_path))
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=16, load_format="dummy"), str(tmp_path))
    norms = [p for n, p in runner.model.named_parameters() if "norm" in n]
    mats = [p for p in runner.model.parameters() if p.dim() > 1]
    assert all(float(p.min()) >= 0.9 and float(p.max()) <= 1.1 for p in norms)
    assert all(0.005 < float(p.std()) < 0.05 for p in mats)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    res = runner.execute(ExecuteBatch(0, [NewSeq("s", [5, 6, 7], 3, params, [1], 0, 3)], [], []))
    assert len(res.token_ids) == 1 and 0 <= res.token_ids[0] < TINY["vocab_size"]


def test_cuda_graph_options_are_inert_on_cpu(tmp_path, caplog) -> None:
    assert cuda_graph_batch_sizes(EngineConfig()) == [1, 2, 4, *range(8, 257, 8)]
    assert cuda_graph_batch_sizes(EngineConfig(max_num_seqs=1024)) == [1, 2, 4, *range(8, 513, 8)]
    assert cuda_graph_batch_sizes(EngineConfig(cuda_graph_sizes=[20])) == [1, 2, 4, 8, 16]
    assert cuda_graph_batch_sizes(EngineConfig(cuda_graph_sizes=[3, 1, 300], max_num_seqs=8)) == [1, 3]
    from pagebus.frontends.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--cuda-graph-sizes", "1", "8", "--enforce-eager"]))
    assert cfg.cuda_graph_sizes == [1, 8] and cfg.enforce_eager
    with caplog.at_level("INFO", logger="pagebus.workers.runner"):
        runner = _tiny_runner(tmp_path, enforce_eager=True, cuda_graph_sizes=[1, 2])
    assert runner.graphs is None
    assert "not applicable" in caplog.text


def test_decode_step_views_are_kept_and_show_each_load() -> None:
    """A decode step's views (t == s == n_logits) are made once per size and read what each
    load wrote; other steps' are made afresh at the same addresses."""
    from pagebus.workers.input_batch import InputBuffers

    inputs = InputBuffers(max_seqs=4, max_tokens=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    first = inputs.load([7, 8], [3, 5], [19, 37], [0, 1], [4, 6], [0, 1, 2], [0, 1])
    second = inputs.load([9, 10], [4, 6], [20, 38], [1, 0], [5, 7], [0, 1, 2], [0, 1])
    assert second is first  # kept
    assert second.input_ids.tolist() == [9, 10] and second.positions.tolist() == [4, 6]
    assert second.slot_mapping.tolist() == [20, 38] and second.rows.tolist() == [1, 0]
    assert second.seq_lens.tolist() == [5, 7] and second.query_start_loc.tolist() == [0, 1, 2]
    prefill = inputs.load([1, 2, 3], [0, 1, 2], [0, 1, 2], [2], [3], [0, 3], [2])
    again = inputs.load([1, 2, 3], [0, 1, 2], [0, 1, 2], [2], [3], [0, 3], [2])
    assert again is not prefill and again.input_ids.data_ptr() == prefill.input_ids.data_ptr()
    assert again.logits_indices.tolist() == [2]
