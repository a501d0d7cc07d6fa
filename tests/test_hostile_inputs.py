"""Issue 48's hostile inputs: checkpoint configs, config files, chat templates, the gateway and
`dew train`'s options. Each must be refused in one line naming the user's own field, file or
option, before anything runs or is allocated; none may hang, run away or end in a traceback.

Each test names its item of issue 48 in its docstring.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import openai
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from _gateway import ScriptedEngine
from _hf_folders import chat_checkpoint
from _templates import FAMILIES, family_tokenizer
from dew._documents import MAX_BYTES
from dew.models import hf
from dew.serve.chat_template import ChatTemplate
from dew.serve.tokenizer import TemplateTokenizer
from dew.train import TrainConfig
from test_gateway import gateway
from test_hostile_cli import refusal

# The openai client leaves its stream's event iterator unclosed (see test_gateway.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator '.*' was garbage collected:ResourceWarning"
)

# A Qwen3 (the family with per-head query and key norms) small enough to write in a moment.
SHAPE = dict(
    vocab=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2, head_dim=8, max_len=64
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Qwen3 checkpoint folder written by dew's own `save` (transformers' layout)."""
    folder = tmp_path_factory.mktemp("qwen3") / "checkpoint"
    model = hf.HFModel(hf.HFConfig("Qwen3ForCausalLM", **SHAPE, qk_norm=True), "float32")
    hf.save(folder, model, model.init(jax.random.key(0)))
    return folder


def _edited(checkpoint: Path, tmp_path: Path, **fields) -> Path:
    """A copy of `checkpoint` whose config.json has `fields` changed."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for file in checkpoint.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "num_hidden_layers",
            10**9,
            "config.json's num_hidden_layers = 1000000000, but model.safetensors holds layers 0..1",
        ),
        (
            "vocab_size",
            10**12,
            "config.json's vocab_size = 1000000000000, but model.safetensors holds "
            r"model.embed_tokens.weight of shape \[64, 32\]",
        ),
        ("hidden_size", 4096, "config.json's hidden_size = 4096, but model.safetensors holds"),
        (
            "intermediate_size",
            10**9,
            "config.json's intermediate_size = 1000000000, but model.safetensors holds "
            r"model.layers.0.mlp.gate_proj.weight of shape \[48, 32\]",
        ),
        (
            "num_attention_heads",
            10**6,
            r"config.json's num_attention_heads = 1000000 \(1000000 x head_dim 8 = 8000000 "
            r"rows\), but model.safetensors holds model.layers.0.self_attn.q_proj.weight of "
            r"shape \[32, 32\]",
        ),
        ("num_key_value_heads", 4, "config.json's num_key_value_heads = 4 "),
    ],
)
def test_config_sizes_are_checked_against_the_tensors_before_anything_is_made(
    checkpoint, tmp_path, field, value, message
):
    """Item 5: `num_hidden_layers: 10**9` reached 5 GB in 90 s listing a billion layers'
    tensors. Every size is checked against the tensors' headers first, named by its field."""
    folder = _edited(checkpoint, tmp_path, **{field: value})
    for read in (hf.load, hf.model_of):
        with pytest.raises(hf.CheckpointError, match=message) as refused:
            read(folder)
        assert str(refused.value).startswith(f"cannot load the checkpoint in {folder}: ")
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"num_key_value_heads": 3},
            "field num_attention_heads 4 must divide by field num_key_value_heads 3",
        ),
        ({"head_dim": 7}, "field head_dim = 7: each head's width must be even"),
        ({"head_dim": None, "hidden_size": 2}, "hidden_size 2 // num_attention_heads 4 = 0"),
        ({"max_position_embeddings": 1}, "field max_position_embeddings must be an int >= 2"),
        ({"num_attention_heads": 0}, "field num_attention_heads must be an int >= 1, got 0"),
        ({"rms_norm_eps": 0}, "field rms_norm_eps must be a positive finite number, got 0"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 0,
                }
            },
            "rope_parameters's field original_max_position_embeddings must be an int >= 1",
        ),
    ],
)
def test_config_errors_name_the_files_own_fields(checkpoint, tmp_path, fields, message):
    """Item 18: config.json's errors named dew's fields (heads, head_dim, max_len, rms_eps),
    which the file does not have; they name the file's."""
    folder = _edited(checkpoint, tmp_path, **fields)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: {message}") as refused:
        hf.load(folder)
    internal = ("kv_heads", "max_len", "rms_eps", "original_max_len", " heads ")
    assert not any(name in str(refused.value) for name in internal), refused.value


def test_an_index_naming_the_wrong_file_for_a_tensor_is_refused_naming_both(checkpoint, tmp_path):
    """Item 10: a sharded index that names the wrong file for a tensor ended in safetensors'
    traceback when the tensor was read; it is refused from the headers, in one line naming the
    tensor, the file the index names and the file that holds it."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    with safe_open(checkpoint / "model.safetensors", "numpy") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    first = {name: t for name, t in tensors.items() if not name.startswith("model.layers.1.")}
    second = {name: t for name, t in tensors.items() if name.startswith("model.layers.1.")}
    save_file(first, folder / "model-00001-of-00002.safetensors")
    save_file(second, folder / "model-00002-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in second}
    moved = "model.layers.1.mlp.up_proj.weight"
    weight_map[moved] = "model-00001-of-00002.safetensors"
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(hf.CheckpointError) as refused:
        hf.load(folder)
    assert str(refused.value) == (
        f"cannot load the checkpoint in {folder}: tensor {moved}: {index} names "
        "model-00001-of-00002.safetensors, but model-00002-of-00002.safetensors holds it"
    )


# A ChatML template that divides by zero on one message's content, as a checkpoint's template
# can fail on what a client sends (arithmetic on lengths, a filter on an unexpected value).
DIVIDING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] == 'divide' %}{{ 1 // (message['content'] | length - 6) }}"
    "{% endif %}{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_a_chat_template_failing_on_a_clients_content_is_answered_400():
    """Item 17: a checkpoint's template that raised ZeroDivisionError on a message's content
    was answered 500 and the session booked as an infrastructure fault (only five exception
    types were taken as the template's). Any exception of the template on the client's content
    is the client's 400, naming the template's error; the session goes on."""
    family = FAMILIES["qwen2.5"]
    template = ChatTemplate.of(DIVIDING_TEMPLATE, **family.named)
    tokenizer = TemplateTokenizer(family_tokenizer(family), template)
    engine = ScriptedEngine(["fine"], tokenizer=tokenizer)
    async with gateway(engine, tokenizer=tokenizer) as gw:
        session = gw.open()
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0
        ) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "divide"}]
                )
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "add"}]
            )
    error = refused.value
    assert error.status_code == 400 and error.param == "messages"
    assert "ZeroDivisionError: integer division or modulo by zero" in error.body["message"]
    assert session.infra_error is None
    assert answer.choices[0].message.content == "fine" and len(session.calls) == 1


def test_a_config_file_without_end_is_refused_after_a_bounded_read(capsys, tmp_path):
    """Item 6: `--config /dev/zero` was read without limit (MemoryError at 5.4 GB); so was a
    checkpoint's config.json. Config files are read to a bound, as traces are, and refused
    past it naming the file."""
    line = refusal(capsys, ["train", "--config", "/dev/zero", "--run", str(tmp_path / "run")])
    assert f"cannot read the config file '/dev/zero': it holds more than {MAX_BYTES} bytes" in line
    assert not (tmp_path / "run").exists()
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    with open(folder / "config.json", "wb") as sparse:  # a file of zeros that takes no disk
        sparse.truncate(MAX_BYTES + 1)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'} cannot be read as JSON: it"):
        hf.load(folder)


def test_a_config_nested_past_the_recursion_limit_is_refused_in_one_line(capsys, tmp_path):
    """Item 14: a TOML config nested 100,000 deep ended in a RecursionError's traceback; it is
    refused in one line naming the file (and so is a JSON one, and a checkpoint's config.json)."""
    deep = "[" * 100_000 + "]" * 100_000
    for name, text in (("deep.toml", f"admit = {deep}\n"), ("deep.json", f'{{"admit": {deep}}}')):
        config = tmp_path / name
        config.write_text(text)
        line = refusal(capsys, ["train", "--config", str(config), "--run", str(tmp_path / "r")])
        assert f"cannot read the config file '{config}': it is nested too deep" in line
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(deep)
    with pytest.raises(ValueError, match="config.json cannot be read as JSON: it is nested too"):
        hf.load(folder)


@pytest.mark.parametrize(
    ("option", "instead"), [("size=5", "--tasks and --eval-tasks"), ("seed=3", "--seed")]
)
def test_dews_own_size_and_seed_given_as_dataset_options_name_dews_option(
    capsys, tmp_path, option, instead
):
    """Item 22: `size` and `seed` among a reasoning-gym task's options were blamed on
    reasoning-gym ("reasoning-gym refuses leg_counting ... got multiple values for keyword
    argument 'size'"); they are dew's own settings, and the error names dew's option."""
    pytest.importorskip("reasoning_gym")
    task = f"reasoning-gym:leg_counting,{option}"
    line = refusal(capsys, ["train", "--task", task, "--run", str(tmp_path / "run")])
    key, value = option.split("=")
    assert f"--task {task}: option {key}={int(value)} is dew's" in line
    assert line.endswith(f"(dew train: {instead})") and "reasoning-gym refuses" not in line
    assert not (tmp_path / "run").exists()


def test_admit_none_is_taken_as_the_default_as_option_and_in_toml(capsys, tmp_path):
    """Item 20: `--admit none` was refused though the help calls none the default, and so was
    `admit = "none"` in a TOML config. Both mean the default, no cut: carry_over, which needs a
    cut, is refused after them, even over a file's `admit = 2`."""
    run = ["--run", str(tmp_path / "run")]
    needs = "carry_over needs admit"
    assert needs in refusal(capsys, ["train", "--admit", "none", "--carry-over", *run])
    config = tmp_path / "run.toml"
    config.write_text('admit = "none"\ncarry_over = true\n')
    assert needs in refusal(capsys, ["train", "--config", str(config), *run])
    config.write_text("admit = 2\ncarry_over = true\n")
    assert needs in refusal(capsys, ["train", "--config", str(config), "--admit", "none", *run])
    config.write_text('admit = "none"\n')
    assert TrainConfig.from_file(config) == TrainConfig()
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A small Qwen2 checkpoint with a tokenizer and Qwen2.5's chat template."""
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    return chat_checkpoint(tmp_path_factory.mktemp("chat") / "checkpoint", shape)


CHECKPOINT_MISFITS = {
    "empty template": (
        {"chat_template.jinja": ""},
        "TemplateTokenizer: the chat template {folder}/chat_template.jinja renders a question "
        "with the generation prompt as no text",
    ),
    "template raising": (
        {"chat_template.jinja": "{{ raise_exception('no conversation is welcome') }}"},
        "{folder}/chat_template.jinja: the chat template refused the conversation: no "
        "conversation is welcome",
    ),
    "template dividing by zero": (
        {"chat_template.jinja": "{{ (messages | length) // 0 }}"},
        "{folder}/chat_template.jinja: the chat template failed on the conversation: "
        "ZeroDivisionError",
    ),
    "template nested past the recursion limit": (
        {"chat_template.jinja": "{% if true %}" * 5000 + "{% endif %}" * 5000},
        "{folder}/chat_template.jinja: ChatTemplate: template 'default' does not parse: it "
        "nests deeper than Python's recursion limit",
    ),
    "max_position_embeddings too short": (
        {"config.json": {"max_position_embeddings": 8}},
        "its max_position_embeddings is 8, but the task's sequences (prompt and --max-tokens) "
        "need 84 positions",
    ),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_MISFITS))
def test_a_checkpoint_that_cannot_take_the_task_is_refused_before_the_run(
    capsys, chat_folder, tmp_path, case
):
    """Item 12: a chat template that raises or is empty, and a `max_position_embeddings` below
    the task's length, ended the run in a traceback once it had started (an empty template in
    the engine's 'prompt must hold 1 to max_len - 1 tokens, got 0'). Each is one line before
    anything starts, naming the template's file and its error, or the field, its value and the
    length the task needs."""
    edits, message = CHECKPOINT_MISFITS[case]
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for file in chat_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    for name, edit in edits.items():
        if isinstance(edit, str):
            (folder / name).write_text(edit)
        else:
            config = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**config, **edit}))
    run = tmp_path / "run"
    line = refusal(capsys, ["train", "--model", str(folder), "--run", str(run), "--steps", "1"])
    assert line.startswith(f"dew train: error: --model {folder}: {message.format(folder=folder)}")
    assert not run.exists()
