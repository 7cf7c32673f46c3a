"""The transformers-free Tokenizer against transformers' own tokenizer for the default model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from pagebus.frontends.model_files import default_model_path
from pagebus.frontends.tokenizer import ChatTemplateError, Tokenizer

from tests.frontends.tokenizer_fixtures import shared_tokenizer_dir

TEXTS = [
    "Hello world",
    "",
    " leading space and trailing  ",
    "whitespace runs:   \t\t\n\n\n  \r\n end",
    "emoji 😀👍🏽 🇫🇷 family 👨‍👩‍👧",
    "CJK 你好，世界。日本語のテキスト 한국어",
    "mixed: café naïve Ωμέγα ∑ x² — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "<|im_start|>not closed <|im_end",
    "code: def f(x):\n    return x ** 2  # comment",
    "numbers 1234567890 3.14159 1e-10",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello! 你好"},
        {"role": "user", "content": "  spaces\n\nand lines  "},
    ],
]


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return shared_tokenizer_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def tok(tok_dir: str) -> Tokenizer:
    return Tokenizer(tok_dir)


@pytest.fixture(scope="session")
def hf() -> Any:
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
    )


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(tok: Tokenizer, hf: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert (
            tok.encode(text, add_special_tokens) == hf(text, add_special_tokens=add_special_tokens).input_ids
        ), text


def test_no_bos_added_like_transformers(tok: Tokenizer) -> None:
    # SmolLM2's HF tokenizer adds no BOS; we follow it rather than the GGUF's llama.cpp convention.
    assert tok.encode("Hello")[0] != tok.bos_token_id


@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers(tok: Tokenizer, hf: Any, skip: bool) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    odd = [0, 1, 2, 3, 200, 13223, 224, 5000, 49151]  # special tokens and a lone emoji byte
    assert tok.decode(odd, skip) == hf.decode(odd, skip_special_tokens=skip)


def test_special_tokens_and_vocab(tok: Tokenizer, hf: Any) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert tok.all_special_ids == hf.all_special_ids
    assert tok.special_tokens_map == hf.special_tokens_map
    assert (tok.vocab_size, len(tok)) == (hf.vocab_size, len(hf)) == (49152, 49152)
    ids = tok.encode("Hello wörld 😀<|im_end|>")
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(tok: Tokenizer, hf: Any, add_generation_prompt: bool) -> None:
    for chat in CHATS:
        ours = tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        theirs = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
    # The rendered prompt already holds its special tokens: encode it without adding more.
    prompt = tok.apply_chat_template(CHATS[0])
    assert tok.encode(prompt, add_special_tokens=False) == hf.apply_chat_template(
        CHATS[0], add_generation_prompt=True, return_dict=False
    )


CUSTOM_TEMPLATES = [
    # tojson keeps HTML characters and non-ASCII verbatim; transformers overrides jinja's filter.
    "{{ messages | tojson }}{{ tools | tojson(indent=2) }}",
    # trim_blocks / lstrip_blocks whitespace handling.
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n",
    # loop controls, namespace, special-token variables, the generation tag.
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}"
    "{% endfor %}{{ ns.n }}{{ bos_token }}{% if add_generation_prompt %}>{% endif %}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_custom_templates_equal_transformers(tok_dir: str, hf: Any, template: str) -> None:
    t = Tokenizer(tok_dir)
    t.chat_template = template
    chat = [{"role": "user", "content": "<b>&'\"é😀"}, *CHATS[2]]
    tools = [{"type": "function", "function": {"name": "f", "description": "<x>"}}]
    assert t.apply_chat_template(chat, tools=tools) == hf.apply_chat_template(
        chat, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def test_template_kwargs_and_none_fields(tok_dir: str) -> None:
    t = Tokenizer(tok_dir)
    t.chat_template = "{{ flag }}{% for m in messages %}{{ 'tc' in m }}{% endfor %}"
    out = t.apply_chat_template([{"role": "assistant", "content": "x", "tc": None}], flag="F")
    assert out == "FFalse"  # a None field counts as absent, as in transformers


def _tokenizer_copy(src: str, dest: Path, config: dict[str, Any]) -> Tokenizer:
    dest.mkdir()
    shutil.copy(Path(src) / "tokenizer.json", dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(str(dest))


def test_no_chat_template_is_a_clear_error(tok_dir: str, tmp_path: Path) -> None:
    t = _tokenizer_copy(tok_dir, tmp_path / "plain", {"eos_token": "<|im_end|>"})
    assert t.chat_template is None and t.eos_token_id == 2 and t.bos_token_id is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_template_errors_become_chat_template_errors(tok_dir: str, tmp_path: Path) -> None:
    cfg = {
        "chat_template": "{% if messages[0].role != 'system' %}{{ raise_exception('need system') }}{% endif %}"
    }
    t = _tokenizer_copy(tok_dir, tmp_path / "strict", cfg)
    with pytest.raises(ChatTemplateError, match="need system"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        t.apply_chat_template([])


def test_named_templates_in_config(tok_dir: str, tmp_path: Path) -> None:
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    t = _tokenizer_copy(
        tok_dir, tmp_path / "named", {"chat_template": named, "bos_token": {"content": "<|im_start|>"}}
    )
    msgs = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(msgs) == "D"
    assert t.apply_chat_template(msgs, tools=[{"type": "function"}]) == "T"
    assert t.bos_token_id == 1  # an AddedToken dict in the config


def test_from_model_uses_the_cache(tok_dir: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    t = Tokenizer.from_model(None, cache_dir=str(tmp_path_factory.getbasetemp() / "pagebus-cache"))
    assert t.encode("Hello world") == [19556, 905]
    assert Tokenizer.from_model("ignored-when-tokenizer-given", tokenizer=tok_dir).eos_token_id == 2
