"""The memory estimate at a run's start, and the refusal of a run that cannot fit (issue 42
item 2, issue 43 item 1): `dew train` prints what the run will hold, by part, against the
machine's memory, and refuses in one line, before its folder is made, a run whose estimate
exceeds it, naming the largest part and the options that lower it (such runs were killed by
the kernel minutes in, at 18.5 GiB)."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from dew import models
from dew.objectives.rl.grpo import GRPOObjective
from dew.serve.tokenizer import BYTES
from dew.train import TrainConfig
from dew.train._memory import GIB, estimate, machine_memory
from dew.train._run_checks import memory_estimate
from test_envs_verifiers import use_nltk_data
from test_hostile_folders import refusal
from test_row_chunks import packed


def test_a_model_too_large_for_the_machine_is_refused_before_its_folder(capsys, tmp_path):
    run = tmp_path / "run"
    # 1.6 G params: 6 GiB of float32, 32 GiB with their gradient, Adam and the engine's copy.
    argv = ["--d-model", "4096", "--layers", "8", "--d-ff", "16384", "--run", str(run)]
    line = refusal(capsys, "train", argv)
    assert line.startswith("the run would need about "), line
    assert (
        "of them weights and Adam" in line
        and "lower --d-model or --layers, or take a smaller --model" in line
    )
    assert f"this machine has {machine_memory() / GIB:.1f} GiB" in line
    assert not run.exists()


@pytest.mark.medium
def test_a_game_too_wide_for_memory_names_max_context_and_remat(capsys, tmp_path, monkeypatch):
    use_nltk_data(tmp_path, monkeypatch)
    run = tmp_path / "run"
    argv = ["--env", "textarena:Wordle-v0", "--max-context", "131072", "--run", str(run)]
    line = refusal(capsys, "train", argv)
    assert "of them the step's activations" in line, line
    assert "--max-context" in line and "or pass --remat" in line
    assert not run.exists()


def test_the_default_run_fits_and_its_estimate_is_one_line():
    needed = memory_estimate(TrainConfig(), BYTES)
    assert 0 < needed.weights < needed.runtime and needed.cache > 0 and needed.batches > 0
    assert needed.total < machine_memory()
    line = needed.line(machine_memory())
    assert line.startswith("memory: about ") and "\n" not in line
    # The built-in task's rows are narrow: the step runs every row at once.
    config = TrainConfig()
    assert needed.chunk == config.batch_size * config.groups // 2


def test_the_activation_estimate_bounds_the_compiled_step():
    """The estimate of a wide step's activations is at least what XLA's compiled gradient
    needs beyond its arguments, and within 3 times it: the estimate is what the refusal
    weighs."""
    rows, width = 16, 1024
    model = models.model(
        models.TransformerConfig(vocab=64, d_model=32, heads=4, layers=2, d_ff=64, max_len=width)
    )
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = jax.tree.map(np.asarray, packed(4, rows, width, support=False))
    batch["tokens"] = batch["tokens"] % 64
    objective = GRPOObjective(model)
    step = jax.jit(jax.grad(lambda p, b: objective.loss(p, b)[0]))
    compiled = step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    needed = estimate(
        model,
        rows=rows,
        width=width,
        slots=1,
        max_len=width,
        ahead=0,
        remat=False,
        reference=False,
    )
    assert compiled <= needed.activations <= 3 * compiled, (compiled, needed.activations)


def test_a_lora_runs_weights_count_adam_for_the_adapter_alone(tmp_path):
    """Under --lora the trainer holds base and adapter and their gradient (zeros for the base),
    Adam the adapter's two moments, the engine the base with the adapter merged: 3 bases and 4
    adapters, where full fine-tuning holds 5 copies of every param (a push frees the engine's
    old copy between its steps, `RolloutServer.load`)."""
    from _checkpoint import tiny_qwen2
    from dew.models import hf
    from dew.models.hf import lora

    folder = tiny_qwen2(tmp_path / "model")
    config = TrainConfig(model=str(folder), lora=True, lora_rank=4)
    model, params = hf.load(folder)
    base = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    adapter = lora.init(jax.random.key(0), model, config.lora_config())
    adapter = sum(leaf.nbytes for leaf in jax.tree.leaves(adapter))
    assert memory_estimate(config, BYTES).weights == 3 * base + 4 * adapter
    full = memory_estimate(TrainConfig(model=str(folder)), BYTES).weights
    assert full == 5 * base


DOCS = Path(__file__).parent.parent / "docs" / "checkpoints.md"


def docs_formula() -> list[tuple[str, str]]:
    """The estimate's formula as docs/checkpoints.md writes it: (name, Python expression) for
    each line of its block, in order (`c` before the parts that use it)."""
    block = re.search(r"```text\n(weights .*?)```", DOCS.read_text(), re.S).group(1)
    symbols = {"·": "*", "²": "**2", "^": "**", "⌊": "(", "⌋": ")", "/": "//"}
    lines = []
    for line in block.strip().splitlines():
        name, expression = (part.strip() for part in line.split("=", 1))
        for symbol, python in symbols.items():
            expression = expression.replace(symbol, python)
        lines.append((name, expression))
    return lines


def evaluate_docs_formula(**symbols) -> dict[str, int]:
    """Each part of the docs' formula at `symbols` (P, L, S, T, Hkv, e, b, R, W, H, d, f, V, k,
    r, κ), in bytes."""
    values = dict(symbols)
    for name, expression in docs_formula():
        values[name] = eval(expression, {"min": min, "max": max}, values)
    return values


def docs_games() -> dict[str, list[str]]:
    """The cells of the docs' table of the games' estimates, by game."""
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| Wordle-v0 ")]
    rows += [line for line in DOCS.read_text().splitlines() if line.startswith("| ConnectFour")]
    return {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    }


@pytest.mark.parametrize(
    ("game", "env"),
    [
        ("Wordle-v0", "textarena:Wordle-v0"),
        ("ConnectFour-v0, self-play", "textarena:ConnectFour-v0,self_play=true"),
    ],
)
def test_the_docs_formula_is_the_estimate_of_the_games_rows(game, env, tmp_path, monkeypatch):
    """Issue 43 item 1: docs/checkpoints.md states the estimate's formula and its parts for the
    two games at their defaults, beside their measured peaks: the formula at the table's shapes
    gives the code's estimate part for part, and the table's GiB are those parts."""
    use_nltk_data(tmp_path, monkeypatch)
    config = TrainConfig(task=env)
    needed = memory_estimate(config, BYTES)
    cells = docs_games()[game]
    params = int(cells[0].replace(",", ""))
    rows, width = (int(n) for n in cells[1].split(" × "))
    slots, positions = (int(n) for n in cells[2].split(" × "))
    parts = evaluate_docs_formula(
        P=params, κ=0, L=config.layers, S=slots, T=positions, Hkv=config.heads,
        e=config.d_model // config.heads, b=4, R=rows, W=width, H=config.heads,
        d=config.d_model, f=config.d_ff, V=BYTES.vocab_size, k=config.ahead, r=config.layers,
    )  # fmt: skip
    names = ["weights", "cache", "activations", "batches", "runtime"]
    assert [parts[n] for n in names] == [getattr(needed, n) for n in names]
    assert parts["c"] == needed.chunk and width == needed.width
    gib = [float(cell) for cell in cells[3:9]]
    assert gib == [round(getattr(needed, n) / GIB, 2) for n in names] + [
        round(needed.total / GIB, 2)
    ]


def test_the_docs_formula_is_the_estimate_of_a_checkpoint_with_remat_and_kl():
    """The docs' formula with its other terms in play: a checkpoint's model with fewer key/value
    heads than query heads, --remat (r = 1), a KL term (κ = 1), rows narrow enough to run
    all at once and a batch's logits under a chunk's."""
    from dew.models import hf

    config = hf.HFConfig(
        architecture="Qwen2ForCausalLM", vocab=512, hidden=64, intermediate=128, layers=3,
        heads=4, kv_heads=2, head_dim=16, max_len=256, rope_theta=10000.0, qkv_bias=True,
        tied=False,
    )  # fmt: skip
    model = hf.HFModel(config, dtype="float32", remat=True)
    shape = {"rows": 3, "width": 96, "slots": 5, "max_len": 128, "ahead": 2}
    needed = estimate(model, **shape, remat=True, reference=True)
    params = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0)))
    )
    parts = evaluate_docs_formula(
        P=params, κ=1, L=3, S=5, T=128, Hkv=2, e=16, b=4, R=3, W=96, H=4,
        d=64, f=128, V=512, k=2, r=1,
    )  # fmt: skip
    names = ["weights", "cache", "activations", "batches", "runtime"]
    assert [parts[n] for n in names] == [getattr(needed, n) for n in names]
    assert parts["c"] == needed.chunk == 3
