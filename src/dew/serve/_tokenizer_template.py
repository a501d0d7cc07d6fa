"""`TemplateTokenizer`: a Hugging Face checkpoint folder's tokenizer under the folder's own chat
template (Qwen2.5, Qwen3, Llama 3.x, Mistral and any other).

A conversation renders byte for byte as `transformers`' `apply_chat_template` renders it
(`dew.serve.chat_template`), and is tokenized as `transformers` tokenizes it; the template's
fixed pieces (the prefix, the generation prompt, a turn's suffix) are found by probing it with a
short conversation. `from_folder` reads the tokenizer, its templates and its named special
tokens from the folder's files. Re-exported by `dew.serve.tokenizer`, whose docstring says what
every tokenizer promises; kept in a module of its own so that each reads in one sitting.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dew._documents import read_document, read_text
from dew.serve._tokenizer_text import _ids, _TokenizersText
from dew.serve.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError

# The conversation a template is probed with for its fixed pieces (see TemplateTokenizer).
_PROBE_QUESTION = {"role": "user", "content": "dew probe question"}
_PROBE_REPLY = {"role": "assistant", "content": "dew probe reply"}


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a message: its content, its parts, its tool calls' fields."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


class TemplateTokenizer(_TokenizersText):
    """A checkpoint's tokenizer under the checkpoint's own chat template (a `Tokenizer`).

    `encode_chat` renders a conversation with the template (`ChatTemplate.render`, in the
    Jinja environment `transformers` uses) and tokenizes the text as `transformers` does, special
    tokens read as tokens: the ids are `apply_chat_template(..., tokenize=True)`'s. A message
    whose text spells one of the tokenizer's special tokens is refused, since the template's
    output would carry it as structure (a user cannot close a turn by writing `<|im_end|>`).

    The template's fixed pieces are found by rendering a probe conversation (one question, one
    reply), once:

    - `eos_id`: the special token the template writes right after an assistant's reply
      (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3, `</s>` for Mistral): the stop token the
      engine samples up to. Where the template writes none, the folder's `eos_token`.
    - `generation_prompt()`: what `add_generation_prompt` adds (`<|im_start|>assistant\\n`;
      nothing for Mistral, whose reply follows `[/INST]`).
    - `turn_suffix()`: what follows the reply's `eos_id` (`\\n` for Qwen, nothing for Llama).
    - `encode_turn(message)`: what the template writes for `message` after an assistant's reply.
    - `chat_prefix()`: the `bos_token`, where the template opens with it.

    Templates are not all incremental: Llama 3.x writes the tools into the first user turn,
    Mistral writes them before the last user turn, Qwen3 drops the reasoning of replies before
    the last question. A session that appends turns (`encode_turn`) keeps what the model saw;
    the gateway, which renders whole conversations, reports where an earlier turn's rendering
    changed (docs/gateway.md).

    Args:
        tokenizer: a `tokenizers.Tokenizer`; it is copied, not changed.
        template: the chat template, with the tokenizer's named special tokens.
        template_kwargs: extra template variables for every rendering (`{"enable_thinking":
            False}` for Qwen3); a call's own keywords override them.
        origin: where the template was read from (its file), named in errors; or None.

    Attributes:
        template: the `ChatTemplate`.
        template_kwargs: the extra variables.
        origin: where the template was read from, or None.
        bos_id, pad_id: the ids of the `bos_token` and `pad_token`, or None.

    Raises:
        ValueError: naming a special token of the template missing from the vocabulary, or a
            template that renders a question as no text (an empty template: every prompt
            would be empty).
    """

    def __init__(
        self,
        tokenizer: Any,
        template: ChatTemplate,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        origin: str | None = None,
    ):
        self._read(tokenizer, "TemplateTokenizer")
        self.origin = origin
        if not isinstance(template, ChatTemplate):
            raise TypeError(
                f"TemplateTokenizer: template must be a ChatTemplate, got {type(template).__name__}"
            )
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        for name, text in template.special_tokens.items():
            if text not in self._vocabulary:
                raise ValueError(
                    f"TemplateTokenizer: the {name} {text!r} is not in the tokenizer's vocabulary"
                )
        named = template.special_tokens
        self.bos_id = self._vocabulary[named["bos_token"]] if "bos_token" in named else None
        self.pad_id = self._vocabulary[named["pad_token"]] if "pad_token" in named else None
        texts = [self._tokenizer.id_to_token(token_id) for token_id in self.special_ids]
        self._special_texts = sorted(texts, key=len, reverse=True)
        self._forgery = (
            re.compile("|".join(re.escape(text) for text in self._special_texts))
            if self._special_texts
            else None
        )
        self._probe()

    def _probe(self) -> None:
        """Find `eos_id`, the generation prompt and the turn suffix from a probe conversation."""
        self._generation: str | None = None
        self._suffix: str | None = None
        eos_text = None
        try:
            asked = self.render([_PROBE_QUESTION])
            prompted = self.render([_PROBE_QUESTION], add_generation_prompt=True)
            answered = self.render([_PROBE_QUESTION, _PROBE_REPLY])
        except ChatTemplateError:
            asked = prompted = answered = None
        if prompted == "":
            where = "" if self.origin is None else f" {self.origin}"
            raise ValueError(
                f"TemplateTokenizer: the chat template{where} renders a question with the "
                "generation prompt as no text (is it empty?): every prompt would be empty"
            )
        asked, prompted, answered = asked or "", prompted or "", answered or ""
        if prompted.startswith(asked) and asked:
            self._generation = prompted[len(asked) :]
        reply = _PROBE_REPLY["content"]
        if reply in answered:
            after = answered[answered.rindex(reply) + len(reply) :]
            eos_text = next((t for t in self._special_texts if after.startswith(t)), None)
            if eos_text is not None:
                self._suffix = after[len(eos_text) :]
        if eos_text is None:
            eos_text = self.template.special_tokens.get("eos_token")
        if eos_text is None:
            raise ValueError(
                "TemplateTokenizer: the chat template closes no assistant reply with a special "
                "token, and there is no eos_token: nothing to stop sampling on"
            )
        self.eos_id = self._vocabulary[eos_text]
        self._eos_text = eos_text

    @classmethod
    def from_folder(
        cls,
        folder: str | os.PathLike,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TemplateTokenizer:
        """The tokenizer and chat template of a Hugging Face checkpoint folder.

        Reads `tokenizer.json`; the chat template from `chat_template.jinja` (and the named
        ones, such as `tool_use`, from `additional_chat_templates/NAME.jinja`), else the
        `chat_template` field of `tokenizer_config.json` (a string, or a list of named templates
        as older folders have it), else `chat_template.json`; the named special tokens
        (`bos_token`, `eos_token`, `pad_token`, ...) from `tokenizer_config.json`, and those it
        lacks from `generation_config.json`'s `bos_token_id`, `eos_token_id` (the first of a
        list) and `pad_token_id`.

        Args:
            folder: the checkpoint folder.
            chat_template: a template's text to use instead of the folder's (for a base model's
                folder, which ships none).
            template_kwargs: extra template variables for every rendering.

        Raises:
            FileNotFoundError: naming the folder, or the tokenizer.json it lacks.
            ValueError: naming the file and field that is malformed, a special token missing
                from the vocabulary, or a folder without a chat template.
        """
        import tokenizers

        root = os.fspath(folder)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"TemplateTokenizer.from_folder: no folder at {root!r}")
        path = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"TemplateTokenizer.from_folder: {root!r} has no tokenizer.json (a folder with "
                "only a slow tokenizer's files can be converted with transformers: "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as error:
            raise ValueError(
                f"TemplateTokenizer.from_folder: {path!r} does not load: {error}"
            ) from None
        config = _json_file(root, "tokenizer_config.json")
        sources, origin = _template_sources(root, config, chat_template)
        special = _special_tokens(root, config, tokenizer)
        try:
            template = ChatTemplate(sources, special)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{origin}: {error}") from None
        return cls(tokenizer, template, template_kwargs=template_kwargs, origin=origin)

    def __repr__(self) -> str:
        return f"TemplateTokenizer(vocab_size={self.vocab_size}, eos={self._eos_text!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """The template's text of a conversation (`ChatTemplate.render`, with the tokenizer's
        `template_kwargs` under the call's own)."""
        return self.template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{**self.template_kwargs, **kwargs},
        )

    def spelled_special(self, value: Any) -> str | None:
        """The first special token whose text a string inside `value` (a message, a tool)
        spells, or None: the template's output would carry it as structure."""
        if self._forgery is None:
            return None
        for text in _strings(value):
            found = self._forgery.search(text)
            if found:
                return found.group()
        return None

    def check_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Refuse messages and tools whose text spells a special token (`spelled_special`).

        Raises:
            ValueError: naming the message or tool and the token.
        """
        for where, values in (("messages", messages), ("tools", tools or ())):
            for index, value in enumerate(values):
                token = self.spelled_special(value)
                if token is not None:
                    raise ValueError(
                        f"{where}[{index}] spells the special token {token!r}; the chat "
                        "template's output would read it as structure"
                    )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """The token ids of a conversation under the template: `apply_chat_template(messages,
        tools=tools, add_generation_prompt=..., tokenize=True, **kwargs)`'s.

        Raises:
            ValueError: naming a message that spells a special token, or with the template's
                own message when it refuses the conversation (`ChatTemplateError`).
        """
        self.check_messages(messages, tools=tools)
        text = self.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode_rendered(text)

    def _piece(self, text: str | None, what: str) -> np.ndarray:
        if text is None:
            raise ValueError(
                f"TemplateTokenizer: the chat template has no fixed {what} (found by rendering "
                "a one-question, one-reply conversation)"
            )
        return self.encode_rendered(text)

    def chat_prefix(self) -> np.ndarray:
        """The `bos_token`'s id where the template opens a conversation with it, else none."""
        bos = self.template.special_tokens.get("bos_token")
        try:
            opens = bos is not None and self.render([_PROBE_QUESTION]).startswith(bos)
        except ChatTemplateError:
            opens = False
        return _ids([self.bos_id] if opens else [])

    def generation_prompt(self) -> np.ndarray:
        """The ids `add_generation_prompt` adds: what opens an assistant's reply."""
        return self._piece(self._generation, "generation prompt")

    def turn_suffix(self) -> np.ndarray:
        """The ids the template writes after an assistant reply's `eos_id`."""
        return self._piece(self._suffix, "text after a reply's stop token")

    def encode_turn(self, message: Mapping[str, Any]) -> np.ndarray:
        """The ids the template writes for `message` after an assistant's reply (what a session
        appends once the reply's `eos_id` and `turn_suffix()` are written).

        It is the text that follows the reply, its stop token and the turn suffix when the
        template renders a question, a reply and `message`. Where the template would also render
        the turns before `message` differently (Qwen3 drops the reasoning of replies before the
        latest question), that is not applied: a session keeps what the model saw.

        Raises:
            ValueError: where the template refuses the conversation (`ChatTemplateError`), or
                does not write the reply, its stop token and the turn suffix before `message`.
        """
        self.check_messages([message])
        text = self.render([_PROBE_QUESTION, _PROBE_REPLY, message])
        closed = _PROBE_REPLY["content"] + self._eos_text + (self._suffix or "")
        at = text.find(closed)
        if self._suffix is None or at < 0:
            raise ValueError(
                f"encode_turn: the chat template does not close a reply with {self._eos_text!r} "
                f"and a fixed suffix before a {message.get('role')!r} message"
            )
        return self.encode_rendered(text[at + len(closed) :])


def _read_text(path: str) -> str:
    try:
        return read_text(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {path!r} does not read: {error}"
        ) from None


def _json_file(root: str, name: str) -> dict[str, Any]:
    """A folder's JSON object file, or {} when there is none."""
    path = os.path.join(root, name)
    if not os.path.isfile(path):
        return {}
    try:
        value = read_document(path)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {path!r} is not valid JSON: {error}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"TemplateTokenizer.from_folder: {path!r} must hold a JSON object")
    return value


def _template_sources(
    root: str, config: Mapping[str, Any], given: str | None
) -> tuple[dict[str, str], str]:
    """The folder's chat templates by name (see `TemplateTokenizer.from_folder`), and the file
    they were read from (or `chat_template=`, given)."""
    if given is not None:
        if not isinstance(given, str):
            raise TypeError(f"chat_template must be the template's text, got {given!r}")
        return {"default": given}, "chat_template="
    path = os.path.join(root, "chat_template.jinja")
    if os.path.isfile(path):
        sources = {"default": _read_text(path)}
        # Newer folders keep the other named templates (tool_use) one file each beside it.
        extra = os.path.join(root, "additional_chat_templates")
        if os.path.isdir(extra):
            for name in sorted(os.listdir(extra)):
                if name.endswith(".jinja"):
                    sources[name.removesuffix(".jinja")] = _read_text(os.path.join(extra, name))
        return sources, path
    where = os.path.join(root, "tokenizer_config.json")
    value = config.get("chat_template")
    if value is None:
        value = _json_file(root, "chat_template.json").get("chat_template")
        where = os.path.join(root, "chat_template.json")
    if isinstance(value, str):
        return {"default": value}, where
    if isinstance(value, list) and value:
        named = {}
        for index, entry in enumerate(value):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ValueError(
                    f"TemplateTokenizer.from_folder: {where!r} chat_template[{index}] must be an "
                    "object with a string 'name' and 'template'"
                )
            named[entry["name"]] = entry["template"]
        return named, where
    if value is not None:
        raise ValueError(
            f"TemplateTokenizer.from_folder: {where!r} chat_template must be a string or a "
            f"list of named templates, got {type(value).__name__}"
        )
    raise ValueError(
        f"TemplateTokenizer.from_folder: {root!r} has no chat template (chat_template.jinja, or "
        "chat_template in tokenizer_config.json): pass chat_template= the template's text"
    )


def _special_tokens(root: str, config: Mapping[str, Any], tokenizer: Any) -> dict[str, str]:
    """The named special tokens' text: tokenizer_config.json's, then generation_config.json's
    ids for those it lacks."""
    path = os.path.join(root, "tokenizer_config.json")
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):  # older files write an AddedToken's fields
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(
                f"TemplateTokenizer.from_folder: {path!r} {name} must be a string, got {value!r}"
            )
        special[name] = value
    generation = _json_file(root, "generation_config.json")
    for name in ("bos_token", "eos_token", "pad_token"):
        token_id = generation.get(name + "_id")
        if name in special or token_id is None:
            continue
        if isinstance(token_id, list) and token_id:
            token_id = token_id[0]
        text = tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None
        if text is None:
            raise ValueError(
                f"TemplateTokenizer.from_folder: {os.path.join(root, 'generation_config.json')!r}"
                f" {name}_id {token_id!r} is not an id of the tokenizer"
            )
        special[name] = text
    return special
