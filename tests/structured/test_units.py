"""Engine-free checks: constraint checks, tool-call parsing and streaming, tools in the prompt,
and the worker's matchers (rebuilt after preemption, masking only constrained rows)."""

from __future__ import annotations

import json

import pytest
import torch
from pagebus.bus.messages import SamplingParams, StructuredOutputsParams
from pagebus.bus.validation import ParamError, check_sampling_params
from pagebus.frontends.structured.tools import ToolMode, ToolStream, chat_prompt, parse_tool_calls
from pagebus.frontends.structured.validate import check_structured
from pagebus.workers.sampling import Sampler, SampleRow
from pagebus.workers.structured import GrammarStates, load_vocab

AUTO = ToolMode("auto", frozenset({"get_weather"}))
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", "Let me check.\n"),  # Hermes / Qwen
        (f"<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>", None),  # two calls
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None),  # Llama 3 JSON
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
        (f"[TOOL_CALLS] [{CALL}]", None),  # Mistral
    ],
)
def test_auto_parses_each_format_and_streams_the_same(text: str, content: str | None) -> None:
    got_content, calls = parse_tool_calls(text, AUTO)
    assert got_content == content
    assert calls and all(
        c.name == "get_weather" and json.loads(c.arguments) == {"city": "Paris"} for c in calls
    )
    st = ToolStream(AUTO)
    sent = "".join(st.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, streamed = st.finish(completed=True)
    assert sent + rest == (content or "")
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    "text", ["Hello <tool there", '{"name": "other_tool", "arguments": {}}', "<tool_call>{broken", "[1, 2]"]
)
def test_auto_leaves_non_calls_as_content(text: str) -> None:
    assert parse_tool_calls(text, AUTO) == (text, [])
    st = ToolStream(AUTO)
    sent = "".join(st.feed(ch) for ch in text)
    rest, calls = st.finish(completed=True)
    assert (sent + rest, calls) == (text, [])


def test_a_cut_off_call_is_content_not_a_call() -> None:
    st = ToolStream(ToolMode("named", frozenset({"f"}), "f"))
    assert st.feed('{"city": "Pa') == ""
    assert st.finish(completed=False) == ('{"city": "Pa', [])


def test_tools_render_hermes_style_for_a_template_without_tools(default_model: str) -> None:
    from pagebus.frontends.tokenizer import Tokenizer

    tok = Tokenizer.from_model(default_model)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    text = chat_prompt(tok, convo, True, [tool])
    assert "<tools>\n" + json.dumps(tool) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("c", "words"),
    [
        (StructuredOutputsParams(json="{nope"), "not valid JSON"),
        (StructuredOutputsParams(json={"type": "object", "required": "a"}), "required"),
        (StructuredOutputsParams(json={"properties": {"x": {"if": {}}}}), "'if' (at /properties/x)"),
        (StructuredOutputsParams(regex="(a"), "invalid regex"),
        (StructuredOutputsParams(grammar="root ::= x"), 'Rule "x" is not defined'),
    ],
)
def test_check_structured_names_the_problem(c: StructuredOutputsParams, words: str) -> None:
    with pytest.raises(ParamError, match=None) as e:
        check_structured(c)
    assert words in str(e.value)


def test_exactly_one_constraint() -> None:
    with pytest.raises(ParamError, match="exactly one"):
        check_sampling_params(SamplingParams(structured_outputs=StructuredOutputsParams()))
    check_structured(
        StructuredOutputsParams(json={"type": "object", "properties": {"not": {"type": "string"}}})
    )


@pytest.fixture(scope="module")
def grammars(default_model: str) -> GrammarStates:
    return GrammarStates(default_model, 49152, [2])


def test_vocab_from_gguf_blanks_control_tokens(default_model: str) -> None:
    tokens, kind = load_vocab(default_model)
    assert (len(tokens), kind) == (49152, "BYTE_LEVEL")
    assert tokens[:3] == ["", "", ""] and tokens[17] == "!"


def test_matcher_is_rebuilt_after_preemption_and_free_rows_are_untouched(
    grammars: GrammarStates, default_model: str
) -> None:
    from pagebus.frontends.tokenizer import Tokenizer

    tok = Tokenizer.from_model(default_model)
    c = StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}")
    p = SamplingParams(temperature=0.0, structured_outputs=c)
    free = SamplingParams(temperature=0.0)
    sampler = Sampler(0)
    sampler.grammars = grammars
    g = torch.Generator().manual_seed(0)
    out: list[int] = []
    for _ in range(12):
        logits = torch.randn(2, 49152, generator=g)
        want_free = int(logits[1].argmax())
        ids, _ = sampler(
            logits, [SampleRow(p, [1], list(out), 0, (2,), "s0"), SampleRow(free, [1], [], 0, (2,), "s1")]
        )
        assert ids[1] == want_free  # the unconstrained row keeps its exact argmax
        if ids[0] == 2:
            break
        out.append(ids[0])
    text = tok.decode(out)
    assert len(text) == 10 and text[4] == "-" and text[7] == "-", text
    # preempted and recomputed: the output shrank, then regrew; the matcher follows the output
    logits = torch.randn(1, 49152, generator=g)
    a, _ = sampler(logits.clone(), [SampleRow(p, [1], out[:3], 0, (2,), "s0")])
    b, _ = sampler(logits.clone(), [SampleRow(p, [1], out[:3], 0, (2,), "")])  # replayed afresh
    assert a == b
    assert tok.decode(out[:3] + a)[: 3 + len(tok.decode(a))].replace("-", "").isdigit()
    done, _ = sampler(torch.randn(1, 49152, generator=g), [SampleRow(p, [1], out, 0, (2,), "s0")])
    assert done == [2]  # complete: only EOS is allowed
