"""A tokenizer built from `tokenizer.json` with the `tokenizers` library alone (no transformers, no torch).

It reproduces what transformers' fast tokenizer does for encode, decode and `apply_chat_template`,
so that tokenizer processes start in ~0.2 s instead of ~2 s (importing transformers costs the rest).
Known gap: `clean_up_tokenization_spaces` is ignored; transformers 5 ignores it for BPE models too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pagebus.frontends.model_files import resolve_model, tokenizer_dir

# transformers' named special tokens, in its order (all_special_ids follows it).
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the conversation."""


class Tokenizer:
    """Encode, decode and chat-format text for one model; cheap to build in any process."""

    def __init__(self, directory: str) -> None:
        d = Path(directory)
        self._tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        # transformers disables a tokenizer.json's padding and truncation unless a call asks for them.
        self._tok.no_padding()
        self._tok.no_truncation()
        cfg_file = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        self.special_tokens_map: dict[str, str] = {
            attr: tok for attr in _SPECIAL_ATTRS if (tok := _token_text(cfg.get(attr))) is not None
        }
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        extra_tokens = [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        special = dict.fromkeys([*self.special_tokens_map.values(), *(t for t in extra_tokens if t)])
        self.all_special_ids: list[int] = [i for t in special if (i := self._tok.token_to_id(t)) is not None]
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens_map.get("bos_token"))
        self.eos_token_id: int | None = self.token_to_id(self.special_tokens_map.get("eos_token"))
        self.chat_template: str | dict[str, str] | None = _load_chat_template(d, cfg)

    @classmethod
    def from_model(
        cls, model: str | None, tokenizer: str | None = None, cache_dir: str | None = None
    ) -> Tokenizer:
        """The tokenizer of `EngineConfig(model, tokenizer)`: None means the default model."""
        return cls(tokenizer_dir(tokenizer or resolve_model(model), cache_dir=cache_dir))

    # ------------------------------------------------------------------ ids and text
    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' `vocab_size`)."""
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Every id the tokenizer knows, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers' `apply_chat_template(tokenize=False)`.

        Encode the result with `add_special_tokens=False`: the template already holds them.
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        template = self._select_template(tools)
        # As transformers does: a key set to None (OpenAI's content=None) counts as absent.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        # Explicit kwargs win over the special tokens, as in transformers.
        variables = {**self.special_tokens_map, **template_kwargs}
        try:
            return _compile(template).render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed: {e}") from None

    def _select_template(self, tools: list[dict[str, Any]] | None) -> str:
        t = self.chat_template
        if t is None:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer.chat_template); use the completions API "
                "with a plain prompt instead"
            )
        if isinstance(t, str):
            return t
        if tools is not None and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        raise ChatTemplateError(f"this model has several chat templates and none is the default: {sorted(t)}")


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_chat_template(d: Path, cfg: dict[str, Any]) -> str | dict[str, str] | None:
    """transformers 5 layout (chat_template.jinja, additional_chat_templates/) or the config key."""
    named: dict[str, str] = {}
    if (d / "chat_template.jinja").is_file():
        named["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(t := cfg.get("chat_template"), str):
        named["default"] = t
    elif isinstance(t, list):  # transformers 4: [{"name": ..., "template": ...}]
        named.update({x["name"]: x["template"] for x in t})
    extra_dir = d / "additional_chat_templates"
    if extra_dir.is_dir():
        named.update({f.stem: f.read_text(encoding="utf-8") for f in sorted(extra_dir.glob("*.jinja"))})
    if not named:
        return None
    return named["default"] if list(named) == ["default"] else named


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks; we just render it."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces jinja's tojson, which escapes HTML characters that templates want verbatim.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # The environment transformers uses: templates come from model files, hence the sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def token_text_fn(model: str | None, tokenizer: str | None) -> Callable[[int], str]:
    """Token id -> text, as logprobs show it; the tokenizer loads on first use (most requests
    never ask), in this process (cheap: tokenizers only)."""
    tok: list[Tokenizer] = []

    @functools.lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        if not tok:
            tok.append(Tokenizer.from_model(model, tokenizer))
        return tok[0].decode([token_id], skip_special_tokens=False)

    return token_text
