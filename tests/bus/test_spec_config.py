"""--speculative-config as vLLM spells it: a JSON object on the CLI, a dict in LLM(...)."""

from __future__ import annotations

import argparse

import pytest
from pagebus.bus.config import SpeculativeConfig, make_engine_config
from pagebus.frontends.args import add_engine_args, engine_config_from_args


def test_cli_json_and_dict_give_the_same_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    from_cli = engine_config_from_args(args).speculative_config
    from_dict = make_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert (
        from_cli
        == from_dict.speculative_config
        == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"method": "ngram"', "not valid JSON"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "invalid engine option"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, '"model"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "invalid engine option"),
    ],
)
def test_bad_configs_are_refused_with_a_reason(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine_config(speculative_config=spec)
