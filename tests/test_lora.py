"""LoRA adapters (dew.models.hf.lora) against transformers + PEFT: a fresh adapter gives the
base's logits exactly, the same adapter weights give PEFT's logits (a training forward with
dropout, PEFT's train-mode layers fed the same masks), dew's saved adapter folder is PEFT's own
and loads in `PeftModel.from_pretrained`, targets that match no module are refused naming those
that exist; adapters of dew's own transformer; runs that train, resume and export them."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors import safe_open

from _hf_folders import answer_with_digits, chat_checkpoint, randomize_params
from dew._torch_media import hide_broken_media_packages
from dew.data import Task
from dew.envs import Score
from dew.models import hf
from dew.models.hf import lora
from dew.train import TrainConfig, fit
from dew.train._checkpoint import load_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hide_broken_media_packages()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 260  # the byte tokenizer's, so `fit` serves bytes and every id decodes
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
# Llama with attention biases (o_proj's too), Qwen2 with q/k/v biases and tied embeddings,
# Qwen3 with q/k norms and a head wider than hidden / heads.
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=16),
}
EACH_FAMILY = pytest.mark.parametrize("family", list(FAMILIES))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    made = {}
    for family, config in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager")
        randomize_params(model)
        made[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(made[family])
    return made


def _peft_model(folder: Path, config: lora.LoRAConfig, seed: int):
    """transformers' float32 model of `folder` under a PEFT adapter of `config` whose B is
    drawn at random too (PEFT starts it at zero), so the adapter changes the logits."""
    wrapped = peft.get_peft_model(
        _transformers_model(folder),
        peft.LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            target_modules=list(config.targets),
            lora_dropout=config.dropout,
            task_type="CAUSAL_LM",
        ),
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return wrapped.eval()


def _transformers_model(folder: Path):
    """transformers' float32 model of the checkpoint in `folder`, as it loads it."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, variables, tokens):
    length = tokens.shape[0]
    return model(
        variables,
        tokens[None],
        jnp.arange(length, dtype=jnp.int32)[None],
        jnp.ones((1, length), jnp.int32),
    )[0]


def _assert_same(tree, other) -> None:
    """Two trees of arrays equal leaf by leaf, bit for bit."""
    assert jax.tree.structure(tree) == jax.tree.structure(other)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sequence(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, 20).astype(np.int32)


def test_a_fresh_adapter_gives_the_base_logits_exactly(folders):
    base, params = hf.load(folders["qwen3"])
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8))
    variables = model.variables(params, jax.random.key(0))
    assert np.abs(np.asarray(variables["adapter"]["layers"][0]["q_proj"]["lora_A"])).max() > 0
    tokens = jnp.asarray(_sequence(1))
    np.testing.assert_array_equal(
        np.asarray(_forward(model, variables, tokens)), np.asarray(_forward(base, params, tokens))
    )


@EACH_FAMILY
def test_the_same_adapter_gives_transformers_and_peft_logits(folders, family, tmp_path):
    config = lora.LoRAConfig(rank=4, alpha=8)  # every projection, the default targets
    reference = _peft_model(folders[family], config, seed=2)
    reference.save_pretrained(tmp_path / "adapter")
    base, params = hf.load(folders[family])
    loaded, adapter = lora.load_adapter(tmp_path / "adapter", base)
    assert loaded == _sorted_targets(config)
    model = lora.LoRAModel(base, loaded)
    sequence = _sequence(3)
    want = _torch_logits(reference, sequence)
    got = np.asarray(_forward(model, {"adapter": adapter, "base": params}, jnp.asarray(sequence)))
    # The adapter moves the logits well past the bound, so matching them is PEFT's delta.
    base_logits = np.asarray(_forward(base, params, jnp.asarray(sequence)))
    assert np.abs(want - base_logits).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _sorted_targets(config: lora.LoRAConfig) -> lora.LoRAConfig:
    """`config` with its targets in the sorted order a loaded adapter's come in."""
    return lora.LoRAConfig(config.rank, config.alpha, tuple(sorted(config.targets)))


@pytest.mark.medium
def test_a_saved_adapter_is_peft_s_own_folder_and_loads_in_peft(folders, tmp_path):
    folder = folders["qwen2"]
    config = lora.LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    base, params = hf.load(folder)
    adapter = lora.init(jax.random.key(1), base, config)
    # B drawn too, so the saved adapter moves the logits.
    adapter = jax.tree.map(
        lambda leaf: leaf + 0.3 * jax.random.normal(jax.random.key(2), leaf.shape), adapter
    )
    lora.save_adapter(tmp_path / "dew", adapter, config, base_model=str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dew"]  # nothing left beside it
    _peft_model(folder, config, seed=0).save_pretrained(tmp_path / "peft")
    with (
        safe_open(tmp_path / "dew" / lora.ADAPTER_WEIGHTS, "numpy") as ours,
        safe_open(tmp_path / "peft" / lora.ADAPTER_WEIGHTS, "numpy") as theirs,
    ):
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert ours.metadata() == theirs.metadata()
        for name in theirs.keys():
            assert ours.get_slice(name).get_shape() == theirs.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == theirs.get_slice(name).get_dtype()
    written = json.loads((tmp_path / "dew" / lora.ADAPTER_CONFIG).read_text())
    assert written["base_model_name_or_path"] == str(folder)
    loaded = peft.PeftModel.from_pretrained(_transformers_model(folder), tmp_path / "dew").eval()
    sequence = _sequence(4)
    want = _torch_logits(loaded, sequence)
    got = np.asarray(
        _forward(lora.LoRAModel(base, config), {"adapter": adapter, "base": params}, sequence)
    )
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Merged into the weights (`dew export --merge`), it is a folder transformers alone loads.
    hf.save(tmp_path / "merged", base, lora.merged(params, adapter, config), tokenizer_from=folder)
    np.testing.assert_allclose(
        _torch_logits(_transformers_model(tmp_path / "merged"), sequence), want, atol=1e-4, rtol=0
    )
    # The engine's prefill and decode serve base + adapter too.
    model = lora.LoRAModel(base, config)
    variables = {"adapter": adapter, "base": params}
    cache = model.init_cache(slots=2, max_len=32)
    cache, logits = jax.jit(model.prefill)(variables, cache, jnp.asarray(sequence[:12]), 1)
    np.testing.assert_allclose(np.asarray(logits), want[:12], atol=1e-4, rtol=0)
    at = jnp.asarray([0, 12], jnp.int32)
    _, logits = jax.jit(model.decode)(variables, cache, jnp.asarray([0, sequence[12]]), at)
    np.testing.assert_allclose(np.asarray(logits[1]), want[12], atol=1e-4, rtol=0)
    # And back: dew reads its own folder to the same arrays.
    again_config, again = lora.load_adapter(tmp_path / "dew", base)
    assert again_config == _sorted_targets(config)
    _assert_same(adapter, again)


def test_targets_that_match_no_module_are_refused_naming_those_that_exist():
    with pytest.raises(ValueError) as refused:
        lora.LoRAConfig(targets=("q_proj", "query_key_value"))
    message = str(refused.value)
    assert "\n" not in message
    assert "'query_key_value'" in message and "targets" in message
    for name in lora.TARGETS:
        assert name in message


def test_an_adapter_of_another_rank_or_targets_is_not_saved_under_a_config(folders, tmp_path):
    base, _ = hf.load(folders["qwen2"])
    config = lora.LoRAConfig(rank=4, targets=("q_proj",))
    adapter = lora.init(jax.random.key(0), base, config)
    with pytest.raises(ValueError, match="rank 4, its config's rank is 2"):
        lora.save_adapter(tmp_path / "a", adapter, lora.LoRAConfig(rank=2, targets=("q_proj",)))
    with pytest.raises(ValueError, match=r"adapts \['q_proj'\], its config's targets"):
        lora.save_adapter(tmp_path / "a", adapter, lora.LoRAConfig(rank=4, targets=("v_proj",)))
    assert not (tmp_path / "a").exists()


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint with its own tokenizer and Qwen2.5's chat template that
    answers with digits (`answer_with_digits`), so a run's groups differ in reward."""
    shape = {**SHAPE, "num_hidden_layers": 1, "max_position_embeddings": 256}
    del shape["vocab_size"]  # the tokenizer's, made with it
    return answer_with_digits(chat_checkpoint(tmp_path_factory.mktemp("qwen2-chat"), shape))


def _train(chat_folder: Path, run: Path, *options: str) -> int:
    from dew.cli import main

    argv = ["train", "--model", str(chat_folder), "--run", str(run), "--lora"]
    argv += ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,down_proj"]
    argv += ["--batch-size", "2", "--groups", "8", "--tasks", "8", "--checkpoint-every", "1"]
    argv += [
        "--learning-rate",
        "0.01",
        "--ahead",
        "0",
    ]  # each batch sampled after the update before
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        return main([*argv, *options])


def _times(line: dict) -> dict:
    """A metrics line's wall-clock fields, which no two runs share."""
    return {key: value for key, value in line.items() if key.startswith(("seconds/", "push/"))}


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.medium
def test_dew_train_lora_trains_the_adapter_alone_resumes_and_exports_it(
    chat_folder, tmp_path, capsys
):
    run = tmp_path / "run"
    # With dropout on the adapter's input: a training step's forward runs unmerged.
    assert _train(chat_folder, run, "--steps", "1", "--lora-dropout", "0.1") == 0
    summary = capsys.readouterr().out
    assert "LoRA: " in summary and "of optimizer state over the frozen" in summary
    # The checkpoint holds the adapter as PEFT saves it.
    adapter_folder = run / "checkpoints" / "adapter"
    assert sorted(p.name for p in adapter_folder.iterdir()) == sorted(
        [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    )
    assert not (run / "checkpoints" / "model").exists()
    base, params = hf.load(chat_folder)
    config, after_one = lora.load_adapter(adapter_folder, base)
    assert config == lora.LoRAConfig(4, 16.0, ("down_proj", "q_proj", "v_proj"), dropout=0.1)
    # Resumed, the run goes on from the adapter and Adam's state it saved. (Its second batch is
    # sampled anew: a resumed `dew train` draws other samples than an uninterrupted one, LoRA
    # or not; the trainer's own resume is exact, as
    # `test_a_resumed_lora_trainer_equals_the_uninterrupted_one` checks.)
    assert _train(chat_folder, run, "--steps", "2", "--lora-dropout", "0.1", "--resume") == 0
    assert [line["updates"] for line in _lines(run)] == [1, 2]
    assert all(line["grad_norm"] > 0 for line in _lines(run))  # rewards differed
    _, adapter = lora.load_adapter(adapter_folder, base)
    trained = jnp.abs(adapter["layers"][0]["q_proj"]["lora_B"]).max()
    assert float(trained) > 1e-3  # B starts at zero
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(after_one), jax.tree.leaves(adapter), strict=True)
    )
    # PEFT loads the checkpoint's adapter as it is and scores as dew scores base + adapter.
    model = lora.LoRAModel(base, config)
    variables = {"adapter": adapter, "base": params}
    peft_model = peft.PeftModel.from_pretrained(_transformers_model(chat_folder), adapter_folder)
    peft_model.eval()
    sequence = np.random.default_rng(6).integers(0, base.vocab, 12).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(_forward(model, variables, jnp.asarray(sequence))),
        _torch_logits(peft_model, sequence),
        atol=1e-4,
        rtol=0,
    )
    # dew's own checkpoint keeps the adapter and its optimizer state alone: the frozen base is
    # the folder's, which a resumed run loads again.
    template = model.variables(params, jax.random.key(0))
    optimizer = lora.frozen(optax.adam(3e-4))
    state = load_checkpoint(
        run / "checkpoints", {"adapter": template["adapter"]}, optimizer.init(template)
    )
    _assert_same(state.variables["adapter"], adapter)
    held = lora.footprint({**state.variables, "base": params}, state.opt_state)
    assert held["optimizer"] <= 2 * held["adapter"] + 64  # Adam's moments and its count
    stored = sum(path.stat().st_size for path in (run / "checkpoints").glob("state-*"))
    assert stored < held["base"] / 4  # the base (0.11 MiB here) is not in it
    # `dew export` writes the adapter again, or with --merge the checkpoint with it merged in.
    from dew.cli import main

    assert main(["export", "--run", str(run), "--to", str(tmp_path / "adapter")]) == 0
    for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
        assert (tmp_path / "adapter" / name).read_bytes() == (adapter_folder / name).read_bytes()
    merged = tmp_path / "merged"
    assert main(["export", "--run", str(run), "--merge", "--to", str(merged)]) == 0
    np.testing.assert_allclose(
        _torch_logits(_transformers_model(merged), sequence),
        _torch_logits(peft_model, sequence),
        atol=1e-4,
        rtol=0,
    )
    assert (merged / "tokenizer.json").is_file()


TASKS = [Task(str(digit)) for digit in range(4)]


def _closeness(task: Task, reply: str) -> Score:
    """How near the reply's first byte is to the task's digit: a dense reward, so even a
    random model's groups differ and train."""
    return Score(max(0.0, 1.0 - abs(ord(reply[:1] or "\0") - ord(task.name)) / 256))


def _fit(base, variables_or_params, *, steps: int = 2, **options):
    return fit(
        TASKS,
        _closeness,
        prompt=lambda task: f"say {task.name}",
        max_tokens=2,
        model=base,
        params=variables_or_params,
        steps=steps,
        batch_size=2,
        groups=4,
        **options,
    )


@pytest.mark.medium
def test_fit_with_lora_trains_the_adapter_alone_and_serves_it(folders, caplog):
    base, params = hf.load(folders["qwen2"])
    config = lora.LoRAConfig(rank=2, targets=("q_proj", "up_proj"))
    lines = []
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        trainer = _fit(base, params, lora=config, on_step=lines.append)
    assert isinstance(trainer.objective.model, lora.LoRAModel)
    assert all(line["grad_norm"] > 0 for line in lines)
    _assert_same(trainer.variables["base"], params)
    b = trainer.variables["adapter"]["layers"][0]["q_proj"]["lora_B"]
    assert float(jnp.abs(b).max()) > 0  # trained: B starts at zero
    held = lora.footprint(trainer.variables, trainer.opt_state)
    assert held["optimizer"] <= 2 * held["adapter"] + 64  # Adam's moments and its count
    assert "received no gradient" not in caplog.text


def test_an_adapter_that_gets_no_gradient_is_said_with_its_step(folders, caplog):
    base, params = hf.load(folders["qwen2"])
    config = lora.LoRAConfig(rank=2, targets=("v_proj",))
    model = lora.LoRAModel(base, config)
    # A and B both zero: neither factor's gradient reaches it, the run would learn nothing.
    zeros = jax.tree.map(jnp.zeros_like, lora.init(jax.random.key(0), base, config))
    variables = {"adapter": zeros, "base": params}
    with jax.numpy_dtype_promotion("standard"), caplog.at_level("WARNING", "dew.train"):
        _fit(model, variables, steps=1, optimizer=lora.frozen(optax.adam(1e-3)))
    said = [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 0: the LoRA adapter received no gradient")
    assert all("\n" not in line for line in said)


def test_export_merge_of_a_run_of_every_param_is_refused_in_one_line(chat_folder, tmp_path):
    from dew.train import export

    run = tmp_path / "run"
    run.mkdir()
    config = attrs.asdict(TrainConfig(model=str(chat_folder)))
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        export(run, merge=True)
    assert str(refused.value).startswith("--merge merges a --lora run's adapter")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        (
            ["--lora", "--lora-targets", "q_proj,query_key_value"],
            "argument --lora-targets: lora_targets 'query_key_value' matches no module of the "
            "model; the modules an adapter can target are q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj",
        ),
        (["--lora-rank", "4"], "lora_rank shapes a LoRA adapter: give lora too"),
        (["--lora", "--lora-rank", "0"], "argument --lora-rank: lora_rank must be an int"),
        (["--lora", "--mesh", "1x1x1"], "lora keeps the adapter and its checkpoint on one device"),
        (["--lora", "--lora-dropout", "1"], "argument --lora-dropout: lora_dropout must be"),
        (["--lora", "--lora-dropout", "-0.5"], "argument --lora-dropout: lora_dropout must be"),
        (["--lora-dropout", "0.1"], "lora_dropout shapes a LoRA adapter: give lora too"),
    ],
)
def test_dew_train_refuses_a_bad_lora_option_in_one_line(
    chat_folder, tmp_path, capsys, options, culprit
):
    from dew.cli import main

    argv = ["train", "--model", str(chat_folder), "--run", str(tmp_path / "run"), *options]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert culprit in said and said.count(culprit) == 1
    assert not (tmp_path / "run").exists()


class _Rows:
    """Packed rows drawn from each batch's task ids alone (so every run trains the same rows),
    their proximal log-probs scored under the variables handed over."""

    def __init__(self, objective):
        self.objective = objective

    def __call__(self, batch, variables, updates):
        rng = np.random.default_rng([int(i) for i in batch["task_id"]])
        rows, width = 4, 12
        packed = {
            "tokens": rng.integers(1, VOCAB, (rows, width)).astype(np.int32),
            "positions": np.tile(np.arange(width, dtype=np.int32), (rows, 1)),
            "segment_ids": np.ones((rows, width), np.int32),
            "loss_mask": np.tile((np.arange(width) >= 3).astype(np.float32), (rows, 1)),
            "advantages": np.repeat(rng.choice([-1.0, 1.0], (rows, 1)), width, 1).astype(
                np.float32
            ),
        }
        packed["proximal_logprobs"] = np.asarray(
            self.objective.packed_log_probs(variables, packed), np.float32
        )
        packed["behavior_logprobs"] = packed["proximal_logprobs"] - np.float32(0.1)
        return packed


class _TaskPairs:
    """Batches of two task ids."""

    def stream(self, start: int = 0):
        for index in range(start, 16):
            yield {"task_id": np.array([2 * index, 2 * index + 1])}


@pytest.mark.medium
def test_a_resumed_lora_trainer_equals_the_uninterrupted_one(folders, tmp_path):
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.train import Trainer

    base, params = hf.load(folders["llama"])
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=2, targets=("k_proj", "o_proj")))
    objective = GRPOObjective(model)
    optimizer = lora.frozen(optax.adam(1e-2))

    def trainer(directory: Path) -> Trainer:
        variables = model.variables(params, jax.random.key(0))
        return Trainer(objective, optimizer, variables, directory=directory, checkpoint_every=1)

    lines = []
    straight = trainer(tmp_path / "straight")
    straight.on_step = lines.append
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        straight.run(_Rows(objective), _TaskPairs(), steps=3)
        stopped = trainer(tmp_path / "resumed")
        stopped.run(_Rows(objective), _TaskPairs(), steps=1)
        resumed = trainer(tmp_path / "resumed")
        assert resumed.resume().updates == 1
        resumed_lines = []
        resumed.on_step = resumed_lines.append
        resumed.run(_Rows(objective), _TaskPairs(), steps=3)
    assert all(line["grad_norm"] > 0 for line in lines)
    for want, got in zip(lines[1:], resumed_lines, strict=True):
        assert {**want, "elapsed": 0, **_times(want)} == {**got, "elapsed": 0, **_times(want)}
    _assert_same(resumed.variables, straight.variables)
    _assert_same(resumed.opt_state, straight.opt_state)


@pytest.mark.medium
def test_the_lora_engine_serves_base_and_adapter_merged_once_as_the_lora_model_does(folders):
    """`LoRAServer` (dew's engine in a LoRA run) merges each pushed adapter into the base once
    instead of at every step, and draws what a `RolloutServer` of the `LoRAModel` draws: the
    same tokens with the same log-probs, before and after a push of another adapter."""
    import trio

    from dew.serve import RolloutServer
    from dew.serve._lora import LoRAServer, serving

    base, params = hf.load(folders["qwen2"])
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8))

    def adapted(seed: int) -> dict:
        variables = model.variables(params, jax.random.key(seed))
        keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
        adapter = jax.tree.map(
            lambda leaf: jax.random.normal(next(keys), leaf.shape, leaf.dtype) * 0.05,
            variables["adapter"],
        )
        return {**variables, "adapter": adapter}

    async def draw(server, pushed) -> list:
        async with server:
            calls = [await server.generate(_sequence(7)[:6], max_tokens=12, key=3)]
            server.load(pushed, 1)
            calls.append(await server.generate(_sequence(8)[:6], max_tokens=12, key=4))
        return calls

    assert serving(model) is LoRAServer and serving(base) is RolloutServer
    first, second = adapted(0), adapted(1)
    merged = trio.run(draw, LoRAServer(model, first, slots=2, max_len=32), second)
    reference = trio.run(draw, RolloutServer(model, first, slots=2, max_len=32), second)
    for ours, theirs in zip(merged, reference, strict=True):
        np.testing.assert_array_equal(ours.completion, theirs.completion)
        np.testing.assert_allclose(ours.logprobs, theirs.logprobs, rtol=0, atol=1e-5)
    assert merged[1].version == 1
    with pytest.raises(ValueError, match="tree layout of the LoRA model"):
        LoRAServer(model, params, slots=2, max_len=32)


def _with_masks(reference, model: lora.LoRAModel, key, tokens: np.ndarray):
    """`reference` (a PEFT model) with each adapter branch's dropout replaced by the mask dew
    draws for it in a training forward handed `key` over `tokens` (one row), so PEFT's train-
    mode computation meets dew's on the same mask."""
    rate = model.lora.dropout

    class Masked(torch.nn.Module):
        def __init__(self, mask: np.ndarray):
            super().__init__()
            self.mask = torch.tensor(mask)

        def forward(self, x):
            return x * self.mask / (1 - rate)

    drawn = 0
    for name, module in reference.named_modules():
        if not hasattr(module, "lora_dropout") or "default" not in module.lora_dropout:
            continue
        parts = name.split(".")
        block, target = int(parts[parts.index("layers") + 1]), parts[-1]
        width = module.in_features
        mask = lora.dropout_mask(
            model.dropout_key(key, block, target), (1, len(tokens), width), rate
        )
        module.lora_dropout["default"] = Masked(np.asarray(mask))
        drawn += 1
    assert drawn == model.base.config.layers * len(model.lora.targets)
    return reference


@pytest.mark.medium
@EACH_FAMILY
def test_a_training_forward_with_dropout_is_peft_s_on_the_same_mask(folders, family, tmp_path):
    config = lora.LoRAConfig(rank=4, alpha=8, dropout=0.3)
    reference = _peft_model(folders[family], config, seed=2)
    reference.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / lora.ADAPTER_CONFIG).read_text())
    assert saved["lora_dropout"] == 0.3
    base, params = hf.load(folders[family])
    loaded, adapter = lora.load_adapter(tmp_path / "adapter", base)
    assert loaded.dropout == 0.3
    model = lora.LoRAModel(base, loaded)
    variables = {"adapter": adapter, "base": params}
    # dew saves it as PEFT does, and reads its own back.
    lora.save_adapter(tmp_path / "ours", adapter, loaded)
    saved = json.loads((tmp_path / "ours" / lora.ADAPTER_CONFIG).read_text())
    assert saved["lora_dropout"] == 0.3
    assert lora.load_adapter(tmp_path / "ours", base)[0] == loaded
    sequence = _sequence(3)
    key = jax.random.key(7)
    want = _torch_logits(_with_masks(reference, model, key, sequence), sequence)
    length = len(sequence)
    got = np.asarray(
        jax.jit(model)(
            variables,
            jnp.asarray(sequence)[None],
            jnp.arange(length, dtype=jnp.int32)[None],
            jnp.ones((1, length), jnp.int32),
            key=key,
        )[0]
    )
    # The masks move the logits well past the bound: matching them is the dropped branch.
    merged = np.asarray(_forward(model, variables, jnp.asarray(sequence)))
    assert np.abs(got - merged).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.medium
def test_without_a_key_or_without_dropout_the_forward_is_the_merged_one_bit_for_bit(folders):
    base, params = hf.load(folders["qwen2"])
    dropped = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8, dropout=0.5))
    plain = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8))
    assert dropped.stochastic and not plain.stochastic
    variables = plain.variables(params, jax.random.key(0))
    variables["adapter"] = jax.tree.map(lambda leaf: leaf + 0.05, variables["adapter"])
    tokens = jnp.asarray(_sequence(4))[None]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    ones = jnp.ones_like(tokens)
    want = np.asarray(plain(variables, tokens, positions, ones))
    # Rescoring, sampling and evaluation give no key: no dropout, the merged weights.
    np.testing.assert_array_equal(np.asarray(dropped(variables, tokens, positions, ones)), want)
    # A run without dropout computes the merged forward even when handed a key.
    keyed = plain(variables, tokens, positions, ones, key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(keyed), want)
    # With dropout and a key, each key its own mask.
    first, second = (
        np.asarray(dropped(variables, tokens, positions, ones, key=jax.random.key(k)))
        for k in (1, 2)
    )
    assert np.abs(first - want).max() > 1e-3 and np.abs(first - second).max() > 1e-3


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_a_dropout_outside_zero_to_one_is_refused_naming_it(rate):
    with pytest.raises(ValueError) as refused:
        lora.LoRAConfig(dropout=rate)
    assert str(refused.value).startswith("dropout must be")
    assert repr(rate) in str(refused.value) or str(rate) in str(refused.value)


def _transformer():
    from dew import models

    config = models.TransformerConfig(vocab=VOCAB, d_model=32, heads=4, layers=2, d_ff=48)
    model = models.Transformer(config)
    return model, model.init(jax.random.key(5))


@pytest.mark.medium
def test_an_adapter_of_dew_s_transformer_adds_its_delta_to_each_block_weight():
    base, params = _transformer()
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8, targets=lora.TRANSFORMER_TARGETS))
    variables = model.variables(params, jax.random.key(0))
    tokens = jnp.asarray(_sequence(5))
    # B = 0: exactly the base's logits.
    np.testing.assert_array_equal(
        np.asarray(_forward(model, variables, tokens)), np.asarray(_forward(base, params, tokens))
    )
    keys = iter(jax.random.split(jax.random.key(9), 64))
    adapter = jax.tree.map(
        lambda leaf: jax.random.normal(next(keys), leaf.shape) * 0.2, variables["adapter"]
    )
    # The base with each weight W [in, out] plus 2 (B A)^T, made in numpy, apart from dew.
    want = jax.tree.map(np.asarray, params)
    for block, factors in zip(want["blocks"], adapter["layers"], strict=True):
        for name in lora.TRANSFORMER_TARGETS:
            a, b = (np.asarray(factors[name][f]) for f in ("lora_A", "lora_B"))
            block[name] = block[name] + 2.0 * (b @ a).T
    got = np.asarray(_forward(model, {"adapter": adapter, "base": params}, tokens))
    reference = np.asarray(_forward(base, want, tokens))
    assert np.abs(reference - np.asarray(_forward(base, params, tokens))).max() > 1e-2
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    # With dropout, a training forward drops each branch's input (the masks differ per key).
    dropped = lora.LoRAModel(base, attrs.evolve(model.lora, dropout=0.5))
    length = len(tokens)
    trained = np.asarray(
        jax.jit(dropped)(
            {"adapter": adapter, "base": params},
            tokens[None],
            jnp.arange(length, dtype=jnp.int32)[None],
            jnp.ones((1, length), jnp.int32),
            key=jax.random.key(3),
        )[0]
    )
    assert np.abs(trained - got).max() > 1e-3


@pytest.mark.parametrize(
    ("targets", "said"),
    [
        (
            ("q_proj",),
            "lora targets 'q_proj' matches no module of dew's transformer; the modules an "
            "adapter can target are qkv, out, up, down",
        ),
    ],
)
def test_a_target_dew_s_transformer_lacks_is_refused_listing_its_modules(targets, said):
    base, _ = _transformer()
    with pytest.raises(ValueError) as refused:
        lora.LoRAModel(base, lora.LoRAConfig(targets=targets))
    assert str(refused.value) == said


@pytest.mark.parametrize(
    ("targets", "said"),
    [
        (
            ("qkv", "query"),
            "targets 'query' matches no module of the model; the modules an adapter can target "
            "are qkv, out, up, down",
        ),
        (
            ("qkv", "q_proj"),
            "targets ['qkv', 'q_proj'] mixes a checkpoint's modules with dew's transformer's "
            "(qkv, out, up, down): name one model's",
        ),
    ],
)
def test_targets_of_no_model_or_of_two_are_refused_in_one_line(targets, said):
    with pytest.raises(ValueError) as refused:
        lora.LoRAConfig(targets=targets)
    assert str(refused.value) == said


def test_a_checkpoint_s_adapter_is_refused_on_dew_s_transformer_and_back(folders):
    base, _ = hf.load(folders["qwen2"])
    with pytest.raises(ValueError, match="lora targets 'qkv', 'up' match no module of the chec"):
        lora.LoRAModel(base, lora.LoRAConfig(targets=("qkv", "up")))


@pytest.mark.medium
def test_a_resumed_trainer_with_dropout_draws_as_the_uninterrupted_one(folders, tmp_path):
    """Each update's dropout key comes from the seed and the update count: a resumed run
    draws the masks the uninterrupted one drew, another seed draws others, and an adapter
    without dropout takes no key at all (the seed changes nothing)."""
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.train import Trainer

    base, params = hf.load(folders["llama"])

    def trainer(directory: Path, *, dropout: float, seed: int = 0) -> Trainer:
        config = lora.LoRAConfig(rank=2, targets=("k_proj", "o_proj", "up_proj"), dropout=dropout)
        model = lora.LoRAModel(base, config)
        objective = GRPOObjective(model)
        variables = model.variables(params, jax.random.key(0))
        made = Trainer(
            objective,
            lora.frozen(optax.adam(1e-2)),
            variables,
            directory=directory,
            checkpoint_every=1,
            dropout_seed=seed,
        )
        made.rows = _Rows(objective)
        return made

    def run(made: Trainer, steps: int) -> Trainer:
        made.run(made.rows, _TaskPairs(), steps=steps)
        return made

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        straight = run(trainer(tmp_path / "straight", dropout=0.5), 3)
        run(trainer(tmp_path / "resumed", dropout=0.5), 1)
        resumed = trainer(tmp_path / "resumed", dropout=0.5)
        assert resumed.resume().updates == 1
        run(resumed, 3)
        other = run(trainer(tmp_path / "other", dropout=0.5, seed=1), 3)
        plain = [
            run(trainer(tmp_path / f"plain{seed}", dropout=0.0, seed=seed), 2) for seed in (0, 1)
        ]
    _assert_same(resumed.variables, straight.variables)
    _assert_same(resumed.opt_state, straight.opt_state)
    moved = jax.tree.leaves(straight.variables["adapter"])
    drawn = jax.tree.leaves(other.variables["adapter"])
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(moved, drawn, strict=True)
    )
    _assert_same(plain[0].variables, plain[1].variables)


TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]


@pytest.mark.medium
def test_dew_train_lora_trains_an_adapter_of_dew_s_transformer_and_resumes_it(tmp_path, capsys):
    from dew.cli import main

    run = tmp_path / "run"
    argv = ["train", "--run", str(run), "--lora", "--lora-dropout", "0.1", *TINY]
    argv += ["--batch-size", "2", "--groups", "4", "--tasks", "8", "--checkpoint-every", "1"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main([*argv, "--steps", "1"]) == 0
        assert "LoRA: " in capsys.readouterr().out
        assert main([*argv, "--steps", "2", "--resume"]) == 0
    assert [line["updates"] for line in _lines(run)] == [1, 2]
    # dew's checkpoint holds the adapter alone, of every block weight, and no PEFT folder.
    from dew import models

    config = models.TransformerConfig(vocab=260, d_model=16, heads=2, layers=1, d_ff=32)
    model = lora.LoRAModel(
        models.Transformer(config), lora.LoRAConfig(targets=lora.TRANSFORMER_TARGETS, dropout=0.1)
    )
    template = model.variables(model.base.init(jax.random.key(0)), jax.random.key(0))
    state = load_checkpoint(
        run / "checkpoints",
        {"adapter": template["adapter"]},
        lora.frozen(optax.adam(3e-4)).init(template),
    )
    assert state.updates == 2 and sorted(state.variables) == ["adapter"]
    assert sorted(state.variables["adapter"]["layers"][0]) == sorted(lora.TRANSFORMER_TARGETS)
    assert not (run / "checkpoints" / "adapter").exists()


def test_dew_train_without_a_model_refuses_a_checkpoint_s_target_naming_its_own(tmp_path, capsys):
    from dew.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "--run", str(tmp_path / "run"), "--lora", "--lora-targets", "q_proj"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert (
        "lora_targets 'q_proj' matches no module of dew's transformer; the modules an adapter "
        "can target are qkv, out, up, down\n"
    ) in said
    assert not (tmp_path / "run").exists()


@pytest.mark.medium
def test_each_row_chunk_of_a_training_forward_draws_its_own_masks(folders):
    """Under `row_chunk`, each chunk's forward is handed the key folded with its index: two
    equal rows scored in two chunks are dropped out apart (one key for both would give them
    the same mask), and equal again without a key."""
    from dew.objectives.rl.grpo import GRPOObjective

    base, params = hf.load(folders["qwen2"])
    model = lora.LoRAModel(base, lora.LoRAConfig(rank=4, alpha=8, dropout=0.5))
    variables = model.variables(params, jax.random.key(0))
    variables["adapter"] = jax.tree.map(lambda leaf: leaf + 0.1, variables["adapter"])
    row = _sequence(6)[:12]
    batch = {
        "tokens": np.stack([row, row]),
        "positions": np.tile(np.arange(12, dtype=np.int32), (2, 1)),
        "segment_ids": np.ones((2, 12), np.int32),
    }
    objective = GRPOObjective(model, row_chunk=1)
    keyed = np.asarray(jax.jit(objective._scores)(variables, batch, key=jax.random.key(4))[0])
    plain = np.asarray(jax.jit(objective._scores)(variables, batch)[0])
    assert np.abs(keyed[0] - keyed[1]).max() > 1e-4
    np.testing.assert_array_equal(plain[0], plain[1])
