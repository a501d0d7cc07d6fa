"""A checkpoint's chat template (Jinja), rendered as `transformers`' `apply_chat_template` does.

A Hugging Face checkpoint ships its chat template as Jinja text (`chat_template.jinja`, or the
`chat_template` field of `tokenizer_config.json` in older folders). What a model was trained on
is that template's output, byte for byte, so dew renders it in the same Jinja environment as
`transformers`:

- a sandbox that cannot change the values it is given (`ImmutableSandboxedEnvironment`);
- `trim_blocks` and `lstrip_blocks`, and the `loopcontrols` extension (`{% break %}`);
- a `tojson` filter that writes plain `json.dumps` (Jinja's own escapes `<`, `>` and `&` for
  HTML, which no model saw), with its `indent`, `separators`, `sort_keys` and `ensure_ascii`;
- `raise_exception(message)`, which templates call to refuse a conversation, and
  `strftime_now(format)`, the local time now (Llama 3.2 writes today's date);
- `{% generation %}` blocks, which mark the assistant's text for training masks, render their
  body;
- the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as variables, and
  `messages`, `tools`, `add_generation_prompt` and any extra keyword (`enable_thinking=False`
  for Qwen3, `date_string` for Llama 3.x).

`tests/test_chat_templates.py` compares the output with `transformers` for the real templates of
Qwen2.5, Qwen3, Llama 3.2 and Mistral.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens a tokenizer hands its template, as `transformers` does.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat template refused a conversation (its `raise_exception`) or failed rendering it."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, rendered as it is (transformers
    records where it falls, for assistant masks; dew's masks come from the sampled ids)."""

    tags = {"generation"}

    def parse(self, parser):
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    """A template's source compiled once per process (every call of every session renders it)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _check_sources(instance, attribute, value) -> None:
    if not value:
        raise ValueError("ChatTemplate: sources must hold at least one template")
    for name, source in value.items():
        if not isinstance(name, str) or not isinstance(source, str):
            raise TypeError(
                f"ChatTemplate: sources must map names to template text, got {name!r}: "
                f"{type(source).__name__}"
            )
        try:
            _compiled(source)
        except jinja2.exceptions.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"ChatTemplate: template {name!r} does not parse: {error.message} "
                f"(line {error.lineno})"
            ) from None
        except RecursionError:  # Jinja's parser and compiler recurse once per nested block
            raise ChatTemplateError(
                f"ChatTemplate: template {name!r} does not parse: it nests deeper than Python's "
                "recursion limit"
            ) from None
    if len(value) > 1 and "default" not in value:
        raise ValueError(
            f"ChatTemplate: named templates {sorted(value)} need one named 'default' to render "
            "conversations without tools"
        )


def _check_special_tokens(instance, attribute, value) -> None:
    for name, text in value.items():
        if name not in SPECIAL_TOKEN_NAMES or not isinstance(text, str):
            raise ValueError(
                f"ChatTemplate: special_tokens maps one of {SPECIAL_TOKEN_NAMES} to its text, "
                f"got {name!r}: {text!r}"
            )


@attrs.frozen
class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Args:
        sources: the Jinja text by name: one template is `{"default": text}`; folders that ship
            several (a list in `tokenizer_config.json`) render conversations with tools with the
            one named `tool_use` when there is one, as `transformers` does.
        special_tokens: the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) and
            their text, handed to the template as variables.

    Raises:
        ChatTemplateError: naming the template that does not parse.
        ValueError: for an empty mapping, or several templates and none named `default`.
    """

    sources: Mapping[str, str] = attrs.field(converter=dict, validator=_check_sources)
    special_tokens: Mapping[str, str] = attrs.field(
        factory=dict, converter=dict, validator=_check_special_tokens
    )

    @classmethod
    def of(cls, text: str, **special_tokens: str) -> ChatTemplate:
        """One template's text, with special tokens given by name (`bos_token="<s>"`)."""
        return cls({"default": text}, special_tokens)

    def source(self, tools: bool = False) -> str:
        """The template text that renders a conversation (with tools, or without)."""
        if tools and "tool_use" in self.sources:
            return self.sources["tool_use"]
        return self.sources.get("default", next(iter(self.sources.values())))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The text of a conversation under the template, as `apply_chat_template(...,
        tokenize=False)` writes it.

        Args:
            messages: OpenAI-style messages (`role`, `content`, an assistant's `tool_calls`
                whose `function.arguments` are objects, a tool result's `tool_call_id`).
            tools: function tools as JSON schemas (`{"type": "function", "function": {...}}`),
                or None for none.
            add_generation_prompt: end with what opens the assistant's reply.
            **kwargs: extra template variables (`enable_thinking=False`, `date_string=...`);
                they override the special tokens of the same name.

        Raises:
            ChatTemplateError: with the template's own message when it refuses the conversation
                (`raise_exception`), or the type and message of any exception it raises on it
                (a missing field, a division by zero, ...).
        """
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
            raise TypeError(f"render: messages must be a sequence, got {type(messages).__name__}")
        if not messages:
            raise ValueError("render: messages must hold at least one message")
        template = _compiled(self.source(tools is not None))
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(
                messages=messages,
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as error:
            raise ChatTemplateError(
                f"the chat template refused the conversation: {error}"
            ) from None
        except Exception as error:
            # Whatever the template's own code raises on the values it is given (a missing
            # field, arithmetic on a length, a filter on an unexpected type, runaway recursion)
            # is a failure on this conversation, not of the caller: the gateway answers it 400.
            raise ChatTemplateError(
                f"the chat template failed on the conversation: {type(error).__name__}: {error}"
            ) from None
