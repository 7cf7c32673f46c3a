"""Constrained decoding on the default model through the in-process engine: 50 JSON-schema
requests in one batch (greedy and seeded) all validate; regexes and choices hold; free requests
in the same batch get exactly the tokens they get alone; seeds, stop strings, max_tokens and n
behave as without a constraint; a preempted constrained sequence is rebuilt and still valid."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from pagebus.bus.messages import StructuredOutputsParams as SO

from pagebus import LLM, SamplingParams

pytestmark = pytest.mark.slow

SCHEMAS: list[dict[str, Any]] = [
    {  # nested object, enum, integer bounds
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "country": {"enum": ["FR", "DE", "US"]},
                },
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {  # arrays with bounds, numbers with bounds
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 3,
            },
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["scores", "ratio"],
        "additionalProperties": False,
    },
    {  # array of objects with enums
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {  # booleans, const, optional fields
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "kind": {"const": "event"},
            "note": {"type": "string", "maxLength": 10},
        },
        "required": ["ok", "kind"],
        "additionalProperties": False,
    },
    {  # a $ref and anyOf
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "label": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]},
        },
        "required": ["a", "label"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Write a JSON record for a customer.",
    "Here is the data as JSON:",
    "Output JSON only.",
    "Describe the item in JSON.",
    "JSON:",
]
FREE = [
    ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=12)),
    ("Once upon a time", SamplingParams(temperature=0.9, seed=11, max_tokens=12)),
    ("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=12)),
]
DATE = re.compile(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")
EMAIL = re.compile(r"[a-z]{2,8}\.[a-z]{2,8}@(example|mail)\.(com|org)")


def _schema_requests() -> list[tuple[str, SamplingParams, dict[str, Any]]]:
    out = []
    for i, schema in enumerate(SCHEMAS):
        for j, prompt in enumerate(PROMPTS):
            so = SO(json=schema)
            out.append(
                (prompt, SamplingParams(temperature=0.0, max_tokens=150, structured_outputs=so), schema)
            )
            seeded = SamplingParams(temperature=0.8, seed=100 * i + j, max_tokens=150, structured_outputs=so)
            out.append((prompt, seeded, schema))
    return out


def test_fifty_schemas_regexes_choices_and_free_rows_in_one_batch(llm_fp32: LLM) -> None:
    schema_reqs = _schema_requests()
    assert len(schema_reqs) == 50
    other: list[tuple[str, SamplingParams]] = [
        (
            "Today's date is",
            SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(regex=DATE.pattern)),
        ),
        (
            "Send it to",
            SamplingParams(
                temperature=1.0, seed=5, n=2, max_tokens=30, structured_outputs=SO(regex=EMAIL.pattern)
            ),
        ),
        (
            "The review 'awful' is",
            SamplingParams(
                temperature=1.0,
                seed=6,
                n=2,
                max_tokens=5,
                structured_outputs=SO(choice=["good", "bad", "so-so"]),
            ),
        ),
        (
            "Year first:",
            SamplingParams(
                temperature=0.0, max_tokens=20, stop=["-"], structured_outputs=SO(regex=DATE.pattern)
            ),
        ),
        ("A person:", SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=SO(json=SCHEMAS[0]))),
    ]
    batch = [(p, sp) for p, sp, _ in schema_reqs] + other + FREE
    outs = llm_fp32.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    for (_, sp, schema), o in zip(schema_reqs, outs[:50], strict=True):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (sp, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    date, email, choice, stopped, cut = outs[50:55]
    assert DATE.fullmatch(date.outputs[0].text) and date.outputs[0].finish_reason == "stop"
    assert all(EMAIL.fullmatch(c.text) for c in email.outputs)
    assert all(c.text in ("good", "bad", "so-so") for c in choice.outputs)
    assert stopped.outputs[0].text.isdigit() and len(stopped.outputs[0].text) == 4  # cut at the stop string
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4  # never "stop"
    # free rows: exactly their tokens alone; seeded constrained rows: the same output again
    alone = llm_fp32.generate([p for p, _ in FREE], [sp for _, sp in FREE], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[55:]] == [o.outputs[0].token_ids for o in alone]
    again = llm_fp32.generate([schema_reqs[1][0], "Hello"], [schema_reqs[1][1], FREE[1][1]], use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_preempted_constrained_sequences_are_rebuilt(default_model: str) -> None:
    """11 usable KV blocks for 6 sequences of ~5 blocks each force preemption and recompute;
    every output still validates, and a seeded one equals its run without preemption."""
    schema = SCHEMAS[0]
    small = LLM(default_model, dtype="float32", num_kv_blocks=12, max_model_len=128)
    prompts = [
        f"Customer number {i} of the shop, written as a JSON record for the database:" for i in range(6)
    ]
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=80, structured_outputs=SO(json=schema))
        for s in range(6)
    ]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    alone = small.generate(prompts[:1], params[:1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
