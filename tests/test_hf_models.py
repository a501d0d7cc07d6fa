"""dew.models.hf against `transformers`: tiny random checkpoints of each family, made here with
`save_pretrained`, give the same logits in dew (packed rows, prefill + decode) as in
transformers; dew's saved folders load back in transformers; the loaded model trains through
the scheduler; and every malformed folder is refused with one error naming what is wrong."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from pathlib import Path

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from _hf_folders import chat_checkpoint, randomize_params
from dew._torch_media import hide_broken_media_packages
from dew.envs.environment import Score
from dew.envs.prompts import PromptSource
from dew.envs.tasks import task_dataset
from dew.models import Model, hf
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.serve import RolloutServer, ServedSource
from dew.train import Trainer
from dew.train._checkpoint import load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 260  # the byte tokenizer's, so the engine serves bytes and every id decodes
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# Each family with what sets it apart: Llama 3's RoPE scaling and attention biases, Qwen2's
# q/k/v biases with tied embeddings and one key/value head, Qwen3's q/k norms with a head
# wider than hidden / heads, Mistral plain.
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        **SHAPE,
        attention_bias=True,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **{**SHAPE, "num_key_value_heads": 1}, tie_word_embeddings=True
    ),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
}
EACH_FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


def _random_checkpoint(family: str, folder: Path, seed: int = 0, **save) -> None:
    """A `family` model with every param drawn at random (biases and norms included, so each
    takes part), saved by transformers."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        FAMILIES[family](), attn_implementation="eager"
    )
    randomize_params(model)
    model.save_pretrained(folder, **save)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    made = {}
    for family in FAMILIES:
        made[family] = tmp_path_factory.mktemp(family)
        _random_checkpoint(family, made[family])
    return made


@functools.lru_cache(maxsize=8)
def _transformers_model(folder: Path):
    """transformers' float32 model of the checkpoint in `folder`, loaded once a folder (every
    folder a test reads is one it made, never rewritten)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


def _reference(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' float32 logits of one sequence, from the checkpoint in `folder`."""
    with torch.no_grad():
        logits = _transformers_model(folder)(torch.tensor(tokens[None], dtype=torch.long)).logits
    return logits[0].numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens, positions, segment_ids):
    """`model`'s logits of packed rows as one compiled program: run op by op, each operation of
    each new shape compiles a program of its own, hundreds a test."""
    return model(params, tokens, positions, segment_ids)


def _logits(model, params, tokens: np.ndarray) -> np.ndarray:
    length = len(tokens)
    return np.asarray(
        _forward(
            model,
            params,
            jnp.asarray(tokens[None], jnp.int32),
            jnp.arange(length, dtype=jnp.int32)[None],
            jnp.ones((1, length), jnp.int32),
        )[0]
    )


@EACH_FAMILY
def test_packed_rows_give_transformers_logits(folders, family):
    model, params = hf.load(folders[family])
    assert isinstance(model, Model) and model.dtype == "float32"
    rng = np.random.default_rng(1)
    lengths = [[7, 11, 5], [9, 3, 10]]  # three segments a row, then padding
    width = 28
    tokens = np.zeros((2, width), np.int32)
    positions = np.zeros((2, width), np.int32)
    segments = np.zeros((2, width), np.int32)
    pieces = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for segment, length in enumerate(row_lengths, start=1):
            sequence = rng.integers(0, VOCAB, length)
            tokens[row, start : start + length] = sequence
            positions[row, start : start + length] = np.arange(length)
            segments[row, start : start + length] = segment
            pieces.append((row, start, sequence))
            start += length
    logits = _forward(
        model, params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)
    )
    assert logits.dtype == jnp.float32 and logits.shape == (2, width, VOCAB)
    for row, start, sequence in pieces:
        want = _reference(folders[family], sequence)
        got = np.asarray(logits[row, start : start + len(sequence)])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert np.abs(want).max() > 1  # logits large enough that 1e-4 is a real bound


@EACH_FAMILY
def test_prefill_then_decode_give_transformers_logits(folders, family):
    model, params = hf.load(folders[family])
    sequence = np.random.default_rng(2).integers(0, VOCAB, 40).astype(np.int32)
    want = _reference(folders[family], sequence)
    cache = model.init_cache(slots=3, max_len=64)
    # The first 20 tokens, padded to 32, into slot 2; then decode steps across the cache's
    # first block boundary (32).
    padded = np.zeros(32, np.int32)
    padded[:20] = sequence[:20]
    cache, logits = jax.jit(model.prefill)(params, cache, jnp.asarray(padded), jnp.int32(2))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits[:20]), want[:20], atol=1e-4, rtol=0)
    decode = jax.jit(model.decode)
    for position in range(20, 40):
        tokens = np.zeros(3, np.int32)
        tokens[2] = sequence[position]
        at = np.zeros(3, np.int32)
        at[2] = position
        cache, logits = decode(params, cache, jnp.asarray(tokens), jnp.asarray(at))
        np.testing.assert_allclose(np.asarray(logits[2]), want[position], atol=1e-4, rtol=0)


@EACH_FAMILY
def test_a_saved_folder_loads_in_transformers_with_the_same_logits(folders, family, tmp_path):
    model, params = hf.load(folders[family])
    moved = jax.tree.map(lambda leaf: leaf * 1.5, params)  # not the checkpoint's own values
    hf.save(tmp_path / "saved", model, moved, tokenizer_from=folders[family])
    assert (tmp_path / "saved" / "generation_config.json").is_file()  # copied beside
    assert sorted(path.name for path in tmp_path.iterdir()) == ["saved"]  # nothing left over
    with (
        safe_open(folders[family] / "model.safetensors", "numpy") as original,
        safe_open(tmp_path / "saved" / "model.safetensors", "numpy") as saved,
    ):
        assert sorted(saved.keys()) == sorted(original.keys())
        for name in original.keys():
            assert saved.get_slice(name).get_shape() == original.get_slice(name).get_shape()
    sequence = np.random.default_rng(3).integers(0, VOCAB, 16)
    np.testing.assert_allclose(
        _reference(tmp_path / "saved", sequence),
        _logits(model, moved, sequence),
        atol=1e-4,
        rtol=0,
    )
    again, reloaded = hf.load(tmp_path / "saved")
    assert again == model
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.medium
def test_bfloat16_params_keep_their_dtype_and_give_float32_logits(folders, tmp_path):
    model, params = hf.load(folders["qwen3"], dtype="bfloat16")
    assert model.dtype == "bfloat16"
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    sequence = np.random.default_rng(4).integers(0, VOCAB, 12)
    logits = _logits(model, params, sequence)
    assert logits.dtype == np.float32
    # bfloat16 rounds each param and activation to 8 bits of mantissa: close, not equal.
    error = np.abs(logits - _reference(folders["qwen3"], sequence))
    assert error.max() < 0.3 and error.mean() < 0.05
    cache = model.init_cache(slots=1, max_len=32)
    assert {leaf.dtype for leaf in jax.tree.leaves(cache)} == {jnp.dtype(jnp.bfloat16)}
    # Prefill and decode over the bfloat16 cache give the packed rows' logits (to bfloat16's
    # rounding of the keys and values the cache keeps).
    prompt = jnp.zeros(16, jnp.int32).at[:8].set(jnp.asarray(sequence[:8], jnp.int32))
    cache, prefilled = jax.jit(model.prefill)(params, cache, prompt, jnp.int32(0))
    assert prefilled.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(prefilled[:8]), logits[:8], atol=0.1)
    for position in range(8, 12):
        token = jnp.asarray(sequence[position : position + 1], jnp.int32)
        cache, decoded = jax.jit(model.decode)(params, cache, token, jnp.int32([position]))
        np.testing.assert_allclose(np.asarray(decoded[0]), logits[position], atol=0.1)
    hf.save(tmp_path / "half", model, params)
    with safe_open(tmp_path / "half" / "model.safetensors", "numpy") as saved:
        assert {saved.get_slice(name).get_dtype() for name in saved.keys()} == {"BF16"}
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == "bfloat16"
    # The checkpoint's dtype is the default: a bfloat16 folder loads as bfloat16.
    assert hf.load(tmp_path / "half")[0].dtype == "bfloat16"
    assert hf.load(tmp_path / "half", dtype="float32")[0].dtype == "float32"


def test_rows_past_the_tokenizers_ids_get_no_probability(folders):
    """A checkpoint pads its embedding rows past its tokenizer's ids: with `vocab_limit` they
    are never sampled nor scored, and the other ids' logits are as they were."""
    model, params = hf.load(folders["llama"])
    limited = attrs.evolve(model, vocab_limit=200)
    sequence = np.random.default_rng(6).integers(0, 200, 10)
    full, cut = _logits(model, params, sequence), _logits(limited, params, sequence)
    np.testing.assert_array_equal(cut[:, :200], full[:, :200])
    probabilities = np.asarray(jax.nn.softmax(jnp.asarray(cut), axis=-1))
    assert np.all(probabilities[:, 200:] == 0) and np.all(np.isfinite(cut))
    cache = limited.init_cache(slots=1, max_len=32)
    prefill = jax.jit(limited.prefill)
    _, prefilled = prefill(params, cache, jnp.asarray(sequence, jnp.int32), jnp.int32(0))
    np.testing.assert_allclose(np.asarray(prefilled), cut, atol=1e-5)


def test_model_of_reads_the_model_without_its_tensors(folders):
    assert hf.model_of(folders["qwen2"]) == hf.load(folders["qwen2"])[0]
    assert hf.model_of(folders["qwen2"], dtype="bfloat16").dtype == "bfloat16"


def test_a_sharded_checkpoint_loads_as_the_single_file(folders, tmp_path):
    _random_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model, params = hf.load(tmp_path)
    single_model, single = hf.load(folders["llama"])  # the same seed: the same tensors
    assert model == single_model
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def ascii_first(task, reply: str) -> Score:
    """1 for a reply that starts with an ASCII character: about half a random policy's replies
    earn it, so most groups have a signal."""
    return Score(float(reply[:1].isascii()))


@pytest.mark.medium
def test_a_loaded_checkpoint_trains_through_the_scheduler(folders):
    model, params = hf.load(folders["qwen3"])
    server = RolloutServer(model, params, slots=16, max_len=64)
    prompts = PromptSource(server, lambda task: "count " + task.name, ascii_first, max_tokens=2)
    source = ServedSource(prompts, server)
    objective = GRPOObjective(model)
    lines = []
    trainer = Trainer(objective, optax.sgd(1e-2), params, on_step=lines.append)
    scheduler = RolloutScheduler(
        objective, source, server, width=32, rows=8, groups=4, truncation="score"
    )
    try:
        trainer.run(scheduler, scheduler.tasks(task_dataset(8, 2)), steps=3)
    finally:
        scheduler.close()
    assert [line["updates"] for line in lines] == [1, 2, 3]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert server.version >= 2
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), trainer.variables, params)
    assert max(jax.tree.leaves(moved)) > 0


def test_save_copies_the_named_chat_templates_beside_the_tokenizer(folders, tmp_path):
    source = _copy(folders["qwen2"], tmp_path)
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    model, params = hf.load(source)
    hf.save(tmp_path / "saved", model, params, tokenizer_from=source)
    copied = tmp_path / "saved" / "additional_chat_templates" / "tool_use.jinja"
    assert copied.read_text() == "{{ messages }}"


def _copy(folder: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "checkpoint"
    shutil.copytree(folder, copied)
    return copied


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} has no config.json"):
        hf.load(tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        hf.load(tmp_path / "absent")


def test_an_unsupported_architecture_is_named_with_the_supported_ones(folders, tmp_path):
    folder = _copy(folders["llama"], tmp_path)
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    with pytest.raises(
        ValueError, match=f"'GPT2LMHeadModel' is not supported; dew computes {supported}"
    ):
        hf.load(folder)


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("mistral", {"sliding_window": 16}, "field sliding_window: a window of 16"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ("qwen3", {"num_experts": 8}, "field num_experts: mixture-of-experts"),
        ("llama", {"hidden_act": "gelu"}, "field hidden_act must be 'silu'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn"}}, "RoPE type 'yarn' is not"),
        ("qwen2", {"num_key_value_heads": 3}, "field num_key_value_heads 3"),
        ("qwen3", {"hidden_size": "wide"}, "field hidden_size must be int"),
    ],
)
def test_configs_dew_does_not_compute_are_refused(folders, tmp_path, family, changes, message):
    folder = _copy(folders[family], tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: .*{message}"):
        hf.load(folder)


def test_every_bad_tensor_is_reported_at_once_with_its_file(folders, tmp_path):
    folder = _copy(folders["llama"], tmp_path)
    weights = folder / "model.safetensors"
    with safe_open(weights, "numpy") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys()}
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.layers.1.self_attn.q_proj.weight"] = np.zeros((32, 32), np.int32)
    save_file(tensors, weights)
    with pytest.raises(hf.CheckpointError) as refused:
        hf.load(folder)
    message = str(refused.value)
    assert "4 problems" in message
    assert f"tensor model.norm.weight is missing from {weights}" in message
    assert f"model.layers.0.mlp.up_proj.weight in {weights} is [64, 31]" in message
    assert "LlamaForCausalLM of this config.json has [64, 32]" in message
    assert f"model.layers.0.mlp.extra.weight in {weights} is not one" in message
    assert f"model.layers.1.self_attn.q_proj.weight in {weights} is I32" in message


def test_a_truncated_or_missing_tensor_file_is_refused(folders, tmp_path):
    folder = _copy(folders["qwen2"], tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(hf.CheckpointError, match=f"{weights} is truncated or not a safetensors"):
        hf.load(folder)
    weights.unlink()
    with pytest.raises(hf.CheckpointError, match="has neither model.safetensors nor"):
        hf.load(folder)


def test_an_index_naming_a_missing_file_is_refused(tmp_path):
    _random_checkpoint("mistral", tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(hf.CheckpointError, match=f"{shard} is missing \\(the index names it\\)"):
        hf.load(tmp_path)


def test_save_refuses_params_of_another_model(folders, tmp_path):
    model, params = hf.load(folders["qwen3"])
    other, other_params = hf.load(folders["llama"])
    with pytest.raises(ValueError, match="tree layout"):
        hf.save(tmp_path / "out", model, other_params)
    params["norm"] = params["norm"][:8]
    with pytest.raises(
        ValueError, match=r"params\['norm'\] must be float32\[32\], got float32\[8\]"
    ):
        hf.save(tmp_path / "out", model, params)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint with its own tokenizer and Qwen2.5's chat template."""
    return chat_checkpoint(tmp_path_factory.mktemp("qwen2-chat"), SHAPE)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.medium
def test_dew_train_trains_a_checkpoint_folder_into_folders_transformers_loads(
    chat_folder, tmp_path
):
    from dew.cli import main

    run = tmp_path / "run"
    argv = ["train", "--model", str(chat_folder), "--run", str(run), "--steps", "2"]
    argv += ["--batch-size", "2", "--groups", "2", "--tasks", "8", "--checkpoint-every", "1"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    lines = _metrics(run)
    assert [line["updates"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["loss"]) for line in lines)
    saved = run / "checkpoints" / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (saved / name).is_file(), name
    # The run's checkpoint is a folder holding the params of dew's checkpoint beside it, which
    # transformers loads and scores as dew does.
    model, params = hf.load(saved)
    state = load_checkpoint(run / "checkpoints", params, optax.adam(1e-3).init(params))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sequence = np.random.default_rng(5).integers(0, model.vocab, 10)
    np.testing.assert_allclose(
        _reference(saved, sequence), _logits(model, params, sequence), atol=1e-4, rtol=0
    )
    # dew's own checkpoint beside it resumes the run where it stopped.
    with jax.numpy_dtype_promotion("standard"):
        assert main([*argv[:5], "--steps", "3", "--resume"]) == 0
    assert [line["updates"] for line in _metrics(run)] == [1, 2, 3]
    # `dew export` of an unsharded run's checkpoint (an npz) writes the run's own folder again.
    assert main(["export", "--run", str(run), "--to", str(tmp_path / "exported")]) == 0
    for written in saved.iterdir():
        assert (tmp_path / "exported" / written.name).read_bytes() == written.read_bytes()


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        (["--dtype", "bfloat16"], "dtype is the dtype of a --model checkpoint"),
        (["--model", "{folder}", "--tokenizer", "t.json"], "leave out tokenizer"),
        (["--model", "{empty}"], "has no config.json"),
        (["--model", "{folder}", "--dtype", "float16"], "dtype must be float32, bfloat16"),
        (["--model", "{small}"], "more than the 24 embedding rows"),
        (["--model", "{broken}"], "model.safetensors is truncated"),
        (["--model", "{folder}", "--mesh", "1x2x2"], "--mesh 1x2x2 needs 4 devices"),
        (["--mesh", "1x2x2"], "mesh splits a --model checkpoint over devices"),
        (["--model", "{folder}", "--mesh", "2x2"], "mesh must be DATAxFSDPxTENSOR"),
        (
            ["--model", "{folder}", "--mesh", "1x2x1", "--processes", "2"],
            "in a pool of 2 processes: its data axis (1) must be a multiple of 2",
        ),
        (
            ["--model", "{folder}", "--mesh", "2x2x1", "--processes", "2"],
            "--mesh 2x2x1 needs 4 devices, the pool of 2 processes has 2 (1 each)",
        ),
    ],
)
@pytest.mark.medium
def test_dew_train_refuses_a_bad_model_option_naming_it(
    chat_folder, tmp_path, capsys, options, culprit
):
    from dew.cli import main

    small = tmp_path / "small"
    shutil.copytree(chat_folder, small)
    _edit_config(small, vocab_size=24)
    broken = tmp_path / "broken"
    shutil.copytree(chat_folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    (tmp_path / "empty").mkdir()
    paths = {"folder": chat_folder, "empty": tmp_path / "empty", "small": small, "broken": broken}
    argv = ["train", "--run", str(tmp_path / "run"), *[o.format(**paths) for o in options]]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
