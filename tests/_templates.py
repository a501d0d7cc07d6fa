"""Each family's real chat template (tests/fixtures/templates) and a tokenizer built for it: a
small byte-level BPE with the family's special tokens, and `transformers`' fast tokenizer over it
as the reference `apply_chat_template`."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dew._torch_media import hide_broken_media_packages
from dew.serve.chat_template import ChatTemplate
from dew.serve.tokenizer import TemplateTokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

CORPUS = [
    "What is the weather in Paris? It is 22 degrees and sunny in Paris.",
    "You are a helpful assistant. And in Lyon? The weather in a city.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "parameters": {"type": "object"}}',
    "system user assistant tool function description properties required string",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython",
]

# A call id every family's template takes (Mistral's wants 9 alphanumeric characters).
CALL_ID = "abc123XYZ"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
            },
        },
    }
]


def conversation(reply: str = "It is 22 degrees and sunny in Paris.") -> list[dict]:
    """A system turn, a question, a tool call, its result, a reply and a follow-up question."""
    call = {
        "id": CALL_ID,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": "22 degrees and sunny"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And in Lyon?"},
    ]


@attrs.frozen
class Family:
    """A family's template, its tokenizer's special tokens and what a test renders it with.

    Args:
        template: the fixture's file name.
        specials: the special tokens (first ones get the lowest ids).
        added: added tokens that are not special (Qwen's `<tool_call>`).
        named: the named special tokens (`bos_token`, ...) and their text.
        kwargs: extra template variables.
        eos, generation, suffix: the fixed pieces the probe must find.
    """

    template: str
    specials: tuple[str, ...]
    named: dict
    eos: str
    generation: str
    suffix: str
    added: tuple[str, ...] = ()
    kwargs: dict = attrs.field(factory=dict)


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_NAMED = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
FAMILIES = {
    "qwen2.5": Family(
        "qwen2.5-instruct.jinja",
        QWEN_SPECIALS,
        QWEN_NAMED,
        eos="<|im_end|>",
        generation="<|im_start|>assistant\n",
        suffix="\n",
        added=("<tool_call>", "</tool_call>"),
    ),
    "qwen3": Family(
        "qwen3.jinja",
        QWEN_SPECIALS,
        QWEN_NAMED,
        eos="<|im_end|>",
        generation="<|im_start|>assistant\n",
        suffix="\n",
        added=("<tool_call>", "</tool_call>", "<think>", "</think>"),
    ),
    "qwen3-no-thinking": Family(
        "qwen3.jinja",
        QWEN_SPECIALS,
        QWEN_NAMED,
        eos="<|im_end|>",
        generation="<|im_start|>assistant\n<think>\n\n</think>\n\n",
        suffix="\n",
        added=("<tool_call>", "</tool_call>", "<think>", "</think>"),
        kwargs={"enable_thinking": False},
    ),
    "llama3.2": Family(
        "llama3.2-instruct.jinja",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        eos="<|eot_id|>",
        generation="<|start_header_id|>assistant<|end_header_id|>\n\n",
        suffix="",
        kwargs={"date_string": "26 Jul 2024"},
    ),
    "mistral": Family(
        "mistral-nemo-instruct-2407.jinja",
        (
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        eos="</s>",
        generation="",
        suffix="",
    ),
}


def family_tokenizer(family: Family) -> Tokenizer:
    """A byte-level BPE trained on `CORPUS` with the family's special and added tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken(text, special=False) for text in family.added])
    return tokenizer


def reference(family: Family):
    """`transformers`' tokenizer over the family's BPE, with its template set (transformers is
    imported here, so the tests that need only dew's side never load it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hide_broken_media_packages()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=family_tokenizer(family), **family.named)
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    return tokenizer


def template_tokenizer(name: str) -> TemplateTokenizer:
    """dew's tokenizer for a family, built without a folder."""
    family = FAMILIES[name]
    template = ChatTemplate.of((TEMPLATES / family.template).read_text(), **family.named)
    return TemplateTokenizer(family_tokenizer(family), template, template_kwargs=family.kwargs)


def save_folder(name: str, folder: Path) -> Path:
    """A checkpoint folder's tokenizer files for a family, as `transformers` saves them."""
    reference(FAMILIES[name]).save_pretrained(folder)
    return folder
