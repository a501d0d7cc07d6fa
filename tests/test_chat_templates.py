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

import numpy as np
import pytest

from _templates import (
    FAMILIES,
    QWEN_NAMED,
    TEMPLATES,
    TOOLS,
    conversation,
    family_tokenizer,
    reference,
    template_tokenizer,
)
from dew.data import Task
from dew.envs.environment import EnvironmentSource, Score
from dew.objectives.rl.sessions import Call, Label, Status, chains, check_session
from dew.serve.chat_template import ChatTemplate, ChatTemplateError
from dew.serve.tokenizer import HuggingFaceTokenizer, TemplateTokenizer
from dew.serve.tokenizer import Tokenizer as Protocol


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


def test_a_reply_and_the_next_question_appended_are_the_whole_conversations_ids():
    """The prompt, the reply's ids, the stop token, the turn suffix, the question's
    `encode_turn` and the generation prompt are the whole conversation's ids, for each
    family (without tools: Llama 3.2 and Mistral would move them)."""
    for name in ("qwen2.5", "qwen3", "llama3.2", "mistral"):
        ours = template_tokenizer(name)
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
    ours = template_tokenizer("mistral")
    with pytest.raises(ChatTemplateError, match="alternate user/assistant"):
        ours.encode_turn({"role": "assistant", "content": "twice"})


def test_llama_writes_todays_date_through_strftime_now():
    ours = TemplateTokenizer(
        family_tokenizer(FAMILIES["llama3.2"]), template_tokenizer("llama3.2").template
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


def test_a_folder_with_a_processors_chat_template_json_loads_it(tmp_path):
    spec = FAMILIES["qwen2.5"]
    family_tokenizer(spec).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(spec.named))
    text = (TEMPLATES / spec.template).read_text()
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": text}))
    assert TemplateTokenizer.from_folder(tmp_path).template.sources == {"default": text}


def test_named_templates_render_tools_with_tool_use_as_transformers_does(tmp_path):
    """Named templates as transformers saves them (additional_chat_templates/) and as older
    folders list them in tokenizer_config.json."""
    named = {
        "default": "{{ messages[0].content }}|plain<|im_end|>",
        "tool_use": "{{ messages[0].content }}|{{ tools | length }} tools<|im_end|>",
    }
    hf = reference(FAMILIES["qwen2.5"])
    hf.chat_template = named
    hf.save_pretrained(tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    family_tokenizer(FAMILIES["qwen2.5"]).save(str(old / "tokenizer.json"))
    listed = [{"name": name, "template": text} for name, text in named.items()]
    (old / "tokenizer_config.json").write_text(json.dumps({**QWEN_NAMED, "chat_template": listed}))
    question = [{"role": "user", "content": "Hi"}]
    for folder in (tmp_path / "new", old):
        ours = TemplateTokenizer.from_folder(folder)
        assert ours.render(question) == hf.apply_chat_template(question, tokenize=False)
        assert ours.render(question, tools=TOOLS) == "Hi|1 tools<|im_end|>"
        assert (
            hf.apply_chat_template(question, tools=TOOLS, tokenize=False) == "Hi|1 tools<|im_end|>"
        )


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
    tool = {"type": "function", "function": {"name": "f", "description": forged[0]["content"]}}
    with pytest.raises(ValueError, match=r"tools\[1\] spells the special token"):
        ours.encode_chat([{"role": "user", "content": "hi"}], tools=[*TOOLS, tool])


def test_a_template_that_refuses_a_conversation_says_why():
    ours = template_tokenizer("llama3.2")
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


class Replies:
    """An engine that answers each call with the next scripted reply and its stop token."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        self.prompts.append(np.asarray(prompt))
        text = self.replies[len(self.prompts) - 1]
        ids = np.append(self.tokenizer.encode(text), self.tokenizer.eos_id).astype(np.int32)
        return Call(np.asarray(prompt, np.int32), ids, np.full(len(ids), -0.5, np.float32), 0)


class Echo:
    """Asks again until it has seen two answers."""

    def __init__(self):
        self.seen = []

    def reset(self, task):
        return "What is the weather in Paris?"

    def step(self, action):
        self.seen.append(action)
        return "And in Lyon?", len(self.seen) >= 2


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3.2", "mistral"])
async def test_an_environment_session_under_each_template_is_one_chain_of_its_renderings(name):
    """A multi-turn environment session appends each turn with `encode_turn`: every prompt is
    the template's rendering of the conversation so far, and the calls merge into one chain."""
    ours = template_tokenizer(name)
    engine = Replies(ours, ["It is sunny.", "It is raining."])
    source = EnvironmentSource(
        engine,
        Echo,
        lambda env, episode: Score(1.0),
        max_turns=3,
        max_tokens=16,
        max_context=4096,
        tokenizer=ours,
    )
    session = check_session(await source.run(Task("0"), Label(0, 0, 0)))
    assert session.status is Status.COMPLETED and len(chains(session)) == 1
    conversation = [{"role": "user", "content": "What is the weather in Paris?"}]
    for prompt, reply in zip(engine.prompts, engine.replies, strict=True):
        assert prompt.tolist() == ours.encode_chat(conversation).tolist()
        conversation += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And in Lyon?"},
        ]
