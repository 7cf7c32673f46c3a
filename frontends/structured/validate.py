"""Deep checks of a structured-output constraint, so a bad one is refused before it reaches the
engine: the JSON schema against its metaschema (jsonschema), keywords xgrammar would silently
ignore, then the very conversion the worker will run (xgrammar's grammar from the schema, regex
or EBNF, without the tokenizer). Called by `TextProcessor` for every request, in the tokenizer
process (or the in-process engine); xgrammar is imported on the first constrained request.

The cheap shape checks (exactly one constraint, non-empty choices) are in
`bus.validation.check_sampling_params`, so the HTTP layer answers those with no engine round-trip.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pagebus.bus.constraints import choice_ebnf, json_schema_text
from pagebus.bus.messages import StructuredOutputsParams
from pagebus.bus.validation import ParamError

PARAM = "structured_outputs"

# Validation keywords xgrammar 0.2 accepts and ignores: a schema using them would be enforced only
# in part, so it is refused instead, naming the keyword.
UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "allOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
)
# Where subschemas sit: a keyword whose value is a schema, a list of them, or a map of them.
_SCHEMA_VALUED = (
    "items",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "additionalItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[18:24:37] /project/cpp/x.cc:94: "


def check_structured(c: StructuredOutputsParams) -> None:
    """Raise ParamError naming what is wrong with `c`; cached per distinct constraint."""
    try:
        _check_cached(
            json_schema_text(c), c.regex, tuple(c.choice) if c.choice is not None else None, c.grammar
        )
    except RecursionError:
        raise ParamError("the constraint is nested too deeply", PARAM) from None


@functools.lru_cache(maxsize=1024)
def _check_cached(
    schema_text: str | None, regex: str | None, choice: tuple[str, ...] | None, grammar: str | None
) -> None:
    import xgrammar as xgr  # heavy (imports torch): only once a constrained request arrives

    if schema_text is not None:
        schema = _schema(schema_text)
        _convert(lambda: xgr.Grammar.from_json_schema(schema_text, any_whitespace=False), "JSON schema")
        del schema
    elif regex is not None:
        _convert(lambda: xgr.Grammar.from_regex(regex), "regex")
    elif choice is not None:
        _convert(lambda: xgr.Grammar.from_ebnf(choice_ebnf(list(choice))), "choice")
    elif grammar is not None:
        _convert(lambda: xgr.Grammar.from_ebnf(grammar), "grammar")


def _schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ParamError(f"the JSON schema is not valid JSON: {e}", PARAM) from None
    if not isinstance(schema, dict):
        raise ParamError(f"a JSON schema must be an object, got {type(schema).__name__}", PARAM)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ParamError(f"invalid JSON schema at {where}: {e.message}", PARAM) from None
    unsupported_keyword(schema, "")
    return schema


def unsupported_keyword(node: Any, path: str) -> None:
    """Raise ParamError at the first schema keyword in UNSUPPORTED_KEYWORDS."""
    if not isinstance(node, dict):
        return
    for k in UNSUPPORTED_KEYWORDS:
        if k in node:
            raise ParamError(
                f"JSON schema keyword {k!r} (at {path or '/'}) is not supported by structured outputs; "
                f"unsupported: {', '.join(UNSUPPORTED_KEYWORDS)}",
                PARAM,
            )
    for k, v in node.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                unsupported_keyword(sub, f"{path}/{k}/{name}")
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            for i, sub in enumerate(v):
                unsupported_keyword(sub, f"{path}/{k}/{i}")
        elif k in _SCHEMA_VALUED:
            unsupported_keyword(v, f"{path}/{k}")


def _convert(build: Any, what: str) -> None:
    try:
        build()
    except Exception as e:  # whatever xgrammar raises, the request is what is wrong
        msg = _XGR_PREFIX.sub("", str(e).strip())
        raise ParamError(f"invalid {what}: {msg}", PARAM) from None
