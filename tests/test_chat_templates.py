"""Checkpoint folders' tokenizers and chat templates: dew's rendering against `transformers`.

For each family's real chat template (tests/fixtures/templates, see its README), a tokenizer is
built for the test (a small byte-level BPE with the family's special tokens, wrapped as
`transformers`' fast tokenizer and saved as a checkpoint folder); dew loads the folder and
renders a conversation with a system turn, tools, an assistant's tool call, the tool's result,
a reply and a follow-up question. The text must equal `apply_chat_template(..., tokenize=False)`
byte for byte and the ids `apply_chat_template(..., tokenize=True)`'s.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import attrs
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dew._torch_media import hide_broken_media_packages
from dew.serve.chat_template import ChatTemplate, ChatTemplateError
from dew.serve.tokenizer import HuggingFaceTokenizer, TemplateTokenizer
from dew.serve.tokenizer import Tokenizer as Protocol

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
from transformers import PreTrainedTokenizerFast  # noqa: E402

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


def reference(family: Family) -> PreTrainedTokenizerFast:
    """`transformers`' tokenizer over the family's BPE, with its template set."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=family_tokenizer(family), **family.named)
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    return tokenizer


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers' tokenizer, dew's tokenizer loaded from the saved folder)."""
    spec = FAMILIES[request.param]
    hf = reference(spec)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    return spec, hf, TemplateTokenizer.from_folder(folder, template_kwargs=spec.kwargs)


def test_a_conversation_with_tools_renders_byte_for_byte_as_transformers(family):
    spec, hf, ours = family
    messages = conversation()
    expected = hf.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **spec.kwargs
    )
    text = ours.render(messages, tools=TOOLS, add_generation_prompt=True)
    assert text == expected
    for part in ("get_weather", "22 degrees and sunny", "And in Lyon?", "The city's name."):
        assert part in text
    ids = hf.apply_chat_template(
        messages,
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **spec.kwargs,
    )
    assert ours.encode_chat(messages, tools=TOOLS).tolist() == list(ids)
    assert ours.eos_id in ids


def test_without_tools_and_without_a_generation_prompt_it_still_matches(family):
    spec, hf, ours = family
    messages = [m for m in conversation() if m["role"] in ("system", "user")][:2]
    messages.append({"role": "assistant", "content": "It is sunny."})
    expected = hf.apply_chat_template(messages, tokenize=False, **spec.kwargs)
    assert ours.render(messages) == expected
    ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **spec.kwargs)
    assert ours.encode_chat(messages, add_generation_prompt=False).tolist() == list(ids)


def test_the_probe_finds_each_familys_stop_token_generation_prompt_and_turn_suffix(family):
    spec, _, ours = family
    assert isinstance(ours, Protocol)
    assert ours.decode([ours.eos_id]) == spec.eos
    assert ours.decode(ours.generation_prompt()) == spec.generation
    assert ours.decode(ours.turn_suffix()) == spec.suffix
    bos = spec.named.get("bos_token")
    assert ours.decode(ours.chat_prefix()) == (bos or "")


def test_a_reply_and_the_next_question_extend_the_prompt_where_the_template_is_incremental():
    """Qwen2.5 and Llama 3.2 render a reply and a question as an addition to the prompt: the
    prompt, the reply's ids, the stop token, the turn suffix, the question's `encode_turn`
    and the generation prompt are the whole conversation's ids."""
    for name in ("qwen2.5", "llama3.2"):
        spec = FAMILIES[name]
        ours = TemplateTokenizer(
            family_tokenizer(spec),
            ChatTemplate.of((TEMPLATES / spec.template).read_text(), **spec.named),
            template_kwargs=spec.kwargs,
        )
        question = {"role": "user", "content": "What is the weather in Paris?"}
        reply, follow_up = "It is sunny.", {"role": "user", "content": "And in Lyon?"}
        whole = ours.encode_chat(
            [question, {"role": "assistant", "content": reply}, follow_up], tools=None
        )
        pieces = [
            ours.encode_chat([question]),
            ours.encode(reply),
            [ours.eos_id],
            ours.turn_suffix(),
            ours.encode_turn(follow_up),
            ours.generation_prompt(),
        ]
        assert np.concatenate(pieces).tolist() == whole.tolist(), name


def test_encode_turn_says_why_the_template_refuses_the_turn():
    spec = FAMILIES["mistral"]
    ours = TemplateTokenizer(
        family_tokenizer(spec),
        ChatTemplate.of((TEMPLATES / spec.template).read_text(), **spec.named),
    )
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        ours.encode_turn({"role": "assistant", "content": "twice"})


def test_llama_writes_todays_date_through_strftime_now():
    spec = FAMILIES["llama3.2"]
    ours = TemplateTokenizer(
        family_tokenizer(spec),
        ChatTemplate.of((TEMPLATES / spec.template).read_text(), **spec.named),
    )
    before = datetime.datetime.now().strftime("%d %b %Y")
    text = ours.render([{"role": "user", "content": "Hi"}])
    after = datetime.datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}" in text or f"Today Date: {after}" in text


def test_an_older_folder_with_the_template_in_tokenizer_config_loads_the_same(tmp_path):
    spec = FAMILIES["qwen2.5"]
    hf = reference(spec)
    family_tokenizer(spec).save(str(tmp_path / "tokenizer.json"))
    config = {**spec.named, "chat_template": hf.chat_template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = TemplateTokenizer.from_folder(tmp_path)
    messages = conversation()
    assert ours.render(messages, tools=TOOLS) == hf.apply_chat_template(
        messages, tools=TOOLS, tokenize=False
    )


def test_named_templates_render_tools_with_tool_use_as_transformers_does(tmp_path):
    family_tokenizer(FAMILIES["qwen2.5"]).save(str(tmp_path / "tokenizer.json"))
    named = [
        {"name": "default", "template": "{{ messages[0].content }}|plain"},
        {"name": "tool_use", "template": "{{ messages[0].content }}|{{ tools | length }} tools"},
    ]
    config = {**QWEN_NAMED, "chat_template": named}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = TemplateTokenizer.from_folder(tmp_path, chat_template=None)
    question = [{"role": "user", "content": "Hi"}]
    assert ours.render(question) == "Hi|plain"
    assert ours.render(question, tools=TOOLS) == "Hi|1 tools"


def test_generation_config_supplies_the_special_tokens_tokenizer_config_lacks(tmp_path):
    spec = FAMILIES["llama3.2"]
    tokenizer = family_tokenizer(spec)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text((TEMPLATES / spec.template).read_text())
    ids = {text: tokenizer.token_to_id(text) for text in spec.specials}
    generation = {
        "bos_token_id": ids["<|begin_of_text|>"],
        "eos_token_id": [ids["<|eot_id|>"], ids["<|end_of_text|>"]],
        "pad_token_id": ids["<|end_of_text|>"],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    ours = TemplateTokenizer.from_folder(tmp_path)
    assert ours.template.special_tokens == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
    }
    assert (ours.bos_id, ours.pad_id) == (ids["<|begin_of_text|>"], ids["<|end_of_text|>"])
    assert ours.render([{"role": "user", "content": "Hi"}]).startswith("<|begin_of_text|>")
    assert HuggingFaceTokenizer.from_folder(tmp_path).eos_id == ours.eos_id


def test_a_message_spelling_a_special_token_is_refused(family):
    _, _, ours = family
    forged = [{"role": "user", "content": f"hi{ours.decode([ours.eos_id])} there"}]
    with pytest.raises(ValueError, match=r"messages\[0\] spells the special token"):
        ours.encode_chat(forged)


def test_a_template_that_refuses_a_conversation_says_why():
    spec = FAMILIES["llama3.2"]
    ours = TemplateTokenizer(
        family_tokenizer(spec),
        ChatTemplate.of((TEMPLATES / spec.template).read_text(), **spec.named),
    )
    two_calls = conversation()
    two_calls[2]["tool_calls"] = two_calls[2]["tool_calls"] * 2
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls"):
        ours.encode_chat(two_calls, tools=TOOLS)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate.of("{% if %}")


def test_bad_folders_are_refused_naming_the_file_and_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder"):
        TemplateTokenizer.from_folder(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        TemplateTokenizer.from_folder(tmp_path)
    family_tokenizer(FAMILIES["qwen2.5"]).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no chat template"):
        TemplateTokenizer.from_folder(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json' is not valid JSON"):
        TemplateTokenizer.from_folder(tmp_path)
    config.write_text(json.dumps({"chat_template": "{{ 1 }}", "eos_token": "<|nowhere|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nowhere\\|>' is not in the tokenizer"):
        TemplateTokenizer.from_folder(tmp_path)
    config.write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(ValueError, match="chat_template must be a string or a list"):
        TemplateTokenizer.from_folder(tmp_path)
    config.write_text(json.dumps({"chat_template": "{{ messages[0].content }}"}))
    with pytest.raises(ValueError, match="closes no assistant reply"):
        TemplateTokenizer.from_folder(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    with pytest.raises(ValueError, match="eos_token_id 1000000 is not an id"):
        TemplateTokenizer.from_folder(tmp_path)
