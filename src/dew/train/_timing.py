"""A `dew train` run's trainer step, timed on this machine at other row counts.

`dew tune` predicts how a run would go at another setting from the trace of one run. A setting
that admits fewer groups a step trains fewer rows (`dew train` sizes its rows to what a step
admits), so its trainer steps faster, but not in proportion to its rows: on this project's CPU,
the default model's rescoring and update over [24, 155] rows took 0.62 of their seconds over
[32, 155] (the rescoring alone 0.43), where a cost linear in rows predicts 0.75. A prediction
that scaled the recorded steps by rows alone put an admit run's trainer idle share five to six
points too low. `step_seconds` measures instead: it builds the run's model, objective and
optimizer from its folder's `config.json`, as `dew train` does, and times the step's jitted
work (the proximal rescoring where the run's `proximal` is `rescore`, the reference's where the
run has a KL term, and the optimizer update) over rows of the run's shape, alone on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dew._checks import check_int
from dew.train._config import TrainConfig
from dew.train._config_preflight import _load_tokenizer
from dew.train._run import _levers, _model, _optimizer
from dew.train._tasks import _objective, _task

# Timed steps at each row count after the one that compiles: the median of these is the figure.
REPEATS = 9


def step_seconds(
    run: str | Path, admitted: Sequence[int], *, repeats: int = REPEATS
) -> dict[int, float]:
    """The solo seconds of a step of the run in folder `run`, for each count of groups a step
    admits.

    Each count `a` trains `ceil(a * groups * chains per rollout / chains per row)` rows of the
    run's width, as `dew train` packs them. A step's figure is the median over `repeats` of the
    rescoring (the reference's alone under `proximal="current"`) and the update over such rows,
    after one step that compiles them; rows are random tokens filling each row, since the cost
    of a step of fixed shape does not depend on its tokens.

    Args:
        run: a `dew train` run folder (its `config.json` is read; nothing is written).
        admitted: counts of groups a step admits, each within 1..the run's batch size.
        repeats: timed steps per count.

    Raises:
        ValueError: naming the folder when it holds no readable config or its run trained on a
            mesh (this times one device's step), or the count out of bounds.
    """
    run = Path(run)
    config = TrainConfig.from_file(run / "config.json")
    if config.mesh is not None:
        raise ValueError(
            f"{run}: its run trained on --mesh {config.mesh}; step_seconds times one device's step"
        )
    repeats = check_int("repeats", repeats, low=1)
    counts = [check_int("admitted", a, low=1, high=config.batch_size) for a in admitted]
    tokenizer = _load_tokenizer(config)
    shape = _task(config, tokenizer).shape
    model, variables = _model(config, shape.max_len, tokenizer)
    objective = _objective(model, config.temperature, **_levers(config))
    optimizer, _ = _optimizer(config)
    update = objective.update_fn(optimizer)
    state = optimizer.init(variables)
    reference = variables if config.kl_coef > 0 else None
    steps = {}
    for count in dict.fromkeys(counts):
        rows = shape.rows(count * config.groups)
        batch = _rows(rows, shape.width, shape.chains_per_row, model.vocab, seed=count)

        def step(batch=batch) -> None:
            if objective.proximal == "rescore":
                batch = dict(batch, proximal_logprobs=_rescored(objective, variables, batch))
            if reference is not None:
                batch["reference_logprobs"] = _rescored(objective, reference, batch)
            jax.block_until_ready(update(variables, state, batch))

        step()  # compiles
        steps[count] = step
    # Round by round over the counts, so that what else the machine does meanwhile slows
    # every count alike rather than the one that happens to run then.
    timed: dict[int, list[float]] = {count: [] for count in steps}
    for _ in range(repeats):
        for count, step in steps.items():
            start = time.perf_counter()
            step()
            timed[count].append(time.perf_counter() - start)
    return {count: float(np.median(seconds)) for count, seconds in timed.items()}


def _rescored(objective, variables, batch: Mapping[str, Any]) -> np.ndarray:
    """The rescoring as the scheduler's (`dew.parallel.LocalPool.rescore`): back on the host."""
    return np.asarray(objective.packed_log_probs(variables, batch), np.float32)


def _rows(count: int, width: int, chains: int, vocab: int, *, seed: int) -> dict[str, np.ndarray]:
    """`count` packed rows of `width` tokens, each holding `chains` chains that fill it, with
    log-probs and advantages to train on."""
    rng = np.random.default_rng(seed)
    length = width // chains
    positions = np.tile(np.arange(width) % length, (count, 1)).astype(np.int32)
    segments = np.tile(np.minimum(np.arange(width) // length, chains - 1) + 1, (count, 1))
    follows = positions > 0
    logprobs = np.where(follows, rng.uniform(-6.0, -5.0, (count, width)), 0.0)
    return {
        "tokens": rng.integers(0, vocab, (count, width), dtype=np.int32),
        "positions": positions,
        "segment_ids": segments.astype(np.int32),
        "loss_mask": follows.astype(np.float32),
        "advantages": np.where(follows, rng.normal(0.0, 1.0, (count, width)), 0.0).astype(
            np.float32
        ),
        "behavior_logprobs": logprobs.astype(np.float32),
    }
