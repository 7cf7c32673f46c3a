"""The in-process Python API on the default model: batching, blocks, stops, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagebus.bus.messages import SamplingParams

from tests.workers.oracle import first_divergence

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "warm",
    "mat",
    "while",
    "rain",
    "fell",
    "over",
    "quiet",
    "hills",
    "and",
    "rivers",
]
PROMPTS = [" ".join(WORDS[: 1 + (i * 7) % len(WORDS)]) * (1 + i % 4) for i in range(16)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def _all_blocks_free(llm) -> bool:
    st = llm.engine.stats()
    return st.num_free_blocks == st.num_total_blocks and st.num_running == 0 and st.num_waiting == 0


def _near_tie(a, b) -> bool:
    """Same tokens, or the first divergence is within each other's top-2 (vLLM's rule)."""
    j = first_divergence(a.token_ids, b.token_ids)
    if j is None:
        return True
    return a.token_ids[j] in b.logprobs[j] and b.token_ids[j] in a.logprobs[j]


def test_batch_invariance_with_staggered_joins(llm_fp32) -> None:
    alone = [llm_fp32.generate([p], GREEDY)[0].outputs[0] for p in PROMPTS]
    ids: dict[str, int] = {}
    done = {}
    step = 0
    while len(done) < len(PROMPTS):
        if step < len(PROMPTS):  # a new prompt joins the running batch at every step
            ids[llm_fp32.add_request(PROMPTS[step], GREEDY)] = step
        for out in llm_fp32.step():
            if out.finished:
                done[ids[out.request_id]] = out.outputs[0]
        step += 1
    mismatches = [i for i in range(len(PROMPTS)) if done[i].token_ids != alone[i].token_ids]
    assert all(_near_tie(done[i], alone[i]) for i in mismatches), mismatches
    assert len(mismatches) <= 1, mismatches
    assert _all_blocks_free(llm_fp32)


def test_default_sampling_and_blocks_return(llm_fp32) -> None:
    outs = llm_fp32.generate(["The capital of France is"] * 3, SamplingParams(max_tokens=8, seed=7, n=2))
    assert [len(o.outputs) for o in outs] == [2, 2, 2]
    assert all(0 < len(c.token_ids) <= 8 for o in outs for c in o.outputs)
    assert all(c.finish_reason in ("stop", "length") for o in outs for c in o.outputs)
    assert _all_blocks_free(llm_fp32)


def test_seeded_sampling_reproducible_across_batches(llm_fp32) -> None:
    p = SamplingParams(temperature=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm_fp32.generate(["Tell me a story"], p)[0].outputs[0].token_ids
    batch = llm_fp32.generate(
        ["Tell me a story", "Another prompt here", "x"], [p, SamplingParams(temperature=1.0), p]
    )
    assert batch[0].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids != alone or True  # other prompt: just must not crash


def test_stop_string_truncates_and_frees(llm_fp32) -> None:
    base = llm_fp32.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=20))[0]
    text = base.outputs[0].text
    stop = text[3:6]
    out = llm_fp32.generate(
        ["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop])
    )[0]
    c = out.outputs[0]
    assert c.text == text[: text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    llm_fp32.step()  # the abort of the stopped sample is applied between steps
    assert _all_blocks_free(llm_fp32)


def test_max_tokens_and_length_reason(llm_fp32) -> None:
    out = llm_fp32.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_prompt_over_max_model_len_is_an_error_not_a_crash(llm_fp32) -> None:
    too_long = list(range(10, 10 + llm_fp32.engine.max_model_len + 1))
    out = llm_fp32.generate([{"prompt_token_ids": too_long}, "ok"], SamplingParams(max_tokens=2))
    assert out[0].outputs[0].finish_reason == "error" and "max_model_len" in (out[0].error or "")
    assert out[1].outputs[0].finish_reason in ("stop", "length")


def test_bad_sampling_params_raise_clear_errors(llm_fp32) -> None:
    with pytest.raises(ValueError, match="top_p"):
        llm_fp32.generate(["x"], SamplingParams(top_p=0.0))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--block-size", "12"], "power of two"),
    ],
)
def test_cli_user_errors_are_one_line(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagebus.frontends.cli", "generate", "hi", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_cli_generate_greedy(default_model: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagebus.frontends.cli", "generate", "The capital of France is", "--max-tokens", "4", "--json", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
