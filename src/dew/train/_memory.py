"""What a `dew train` run will hold in memory, estimated before it starts, and the refusal of a
run that cannot fit the machine.

A run's memory is its weights (params, their gradient, Adam's two moments, the engine's copies),
the engine's key/value cache (a slot per rollout in flight, each the task's longest sequence),
the training step's activations and the packed batches, over what the process holds anyway
(the interpreter and JAX, and the programs compiled for the model and the allocator's share,
which grow with it: measured). The step runs the model over `row_chunk`
rows at a time (`GRPOObjective`), so its activations are one chunk's, whatever the batch's rows:
a chunk's attention scores grow with the row's width squared, the rest of its activations with
the width. The figures are shapes times bytes, read off the model's own `init` and
`init_cache` under `jax.eval_shape` (nothing is allocated), so the estimate costs no memory.
"""

from __future__ import annotations

import math
import os

import attrs
import jax
import numpy as np

from dew.objectives.rl.grpo import ATTENTION_CELLS, LOGIT_CELLS

GIB = 2**30
RUNTIME = GIB // 2
"""What a run's process holds whatever its shapes: the interpreter, JAX, the tokenizer, the
compiled programs (the default copy run peaks at 0.66 GiB, 0.5 of them this)."""

# Per layer and row, the step keeps about this many [heads, width, width] float32 arrays for
# the backward pass (the scores, the masked scores, the softmax weights) and makes a fourth
# in it (their gradient).
_ATTENTION_ARRAYS = 4
# Per layer and token, the float32 values of width d_model it keeps (normed input, q, k, v,
# attention output, residuals) and of width d_ff (the MLP's input to gelu and its output).
_MODEL_WIDE, _FF_WIDE = 8, 2
# The packed arrays of a batch (tokens, positions, segment ids, mask, advantages, three
# log-probs, versions, and their copies on the device), int32 or float32 a cell.
_BATCH_ARRAYS = 12


@attrs.frozen
class Estimate:
    """A run's memory by part, in bytes.

    Args:
        weights: params, their gradient and Adam's two moments (4 copies), the engine's copy
            (a push replaces it between the engine's steps, so the old copy is gone before the
            update that follows: `RolloutServer.load`) and, with a KL term, the reference's.
            The step donates the old weights and moments to the new
            (`GRPOObjective.update_fn(donate=True)`), and the held-out evaluation's engine,
            which holds a copy while it runs, runs between steps, when the gradient is gone.
        cache: the engine's key/value cache.
        activations: one row chunk's forward and backward pass through the model, the whole
            batch's final hidden states and their gradient, and a chunk of logits.
        batches: the packed batches the trainer and the scheduler hold.
        runtime: `RUNTIME`, and the params' bytes once more for the programs XLA compiles
            for the model and what the allocator keeps (a bound over what was measured).
        chunk: rows the step runs the model over at a time.
        width: the packed rows' width.
    """

    weights: int
    cache: int
    activations: int
    batches: int
    runtime: int
    chunk: int
    width: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations + self.batches + self.runtime

    def line(self, available: int) -> str:
        """One line: the total, its parts and the machine's memory, in GiB."""

        def gib(size: int) -> str:
            return f"{size / GIB:.1f}"

        return (
            f"memory: about {gib(self.total)} GiB of this machine's {gib(available)} (weights and "
            f"Adam {gib(self.weights)}, engine cache {gib(self.cache)}, step activations "
            f"{gib(self.activations)} over {self.chunk} row(s) of {self.width} at a time, "
            f"batches {gib(self.batches)}, runtime {gib(self.runtime)})"
        )


def _bytes(tree) -> int:
    return sum(
        math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )


def _dimensions(model) -> tuple[int, int, int, int]:
    """(layers, heads, residual width, MLP width) of dew's transformer or a checkpoint's."""
    config = getattr(model, "base", model).config  # a LoRA model's base holds the shape
    if hasattr(config, "d_model"):
        return config.layers, config.heads, config.d_model, config.d_ff
    return config.layers, config.heads, config.hidden, config.intermediate


def estimate(
    model,
    *,
    rows: int,
    width: int,
    slots: int,
    max_len: int,
    ahead: int,
    remat: bool,
    reference: bool,
) -> Estimate:
    """The memory of a run training `model` on `[rows, width]` batches with an engine of `slots`
    slots of `max_len` positions (see `Estimate` for the parts).

    Args:
        model: a `dew.models.Model` (dew's transformer, a checkpoint's, a LoRA model).
        rows, width: the packed batches' shape.
        slots, max_len: the engine's slots and their positions.
        ahead: batches submitted before the trainer needs them.
        remat: whether the model recomputes each layer in the backward pass.
        reference: whether a KL term keeps the initial weights.
    """
    variables = jax.eval_shape(model.init, jax.random.key(0))
    params = _bytes(variables)
    if isinstance(variables, dict) and variables.keys() == {"adapter", "base"}:  # a LoRA model
        # Adam holds the adapter alone, the engine the base merged with it; the gradient
        # (zeros for the frozen base) and the reference are of every variable.
        adapter = _bytes(variables["adapter"])
        weights = params * (3 if reference else 2) + adapter * 2 + (params - adapter)
    else:
        weights = params * (6 if reference else 5)
    cache = _bytes(jax.eval_shape(lambda: model.init_cache(slots=slots, max_len=max_len)))
    layers, heads, d_model, d_ff = _dimensions(model)
    chunk = min(rows, max(1, ATTENTION_CELLS // width**2))
    attention = _ATTENTION_ARRAYS * heads * width**2 * 4
    tokens = (_MODEL_WIDE * d_model + _FF_WIDE * d_ff) * width * 4
    # With remat only one layer's activations live at a time, beside each layer's input.
    kept = (attention + tokens) * (1 if remat else layers) + (layers * d_model * width * 4)
    logits = 3 * LOGIT_CELLS * 4  # a chunk's logits, their softmax and gradient
    hidden = 2 * rows * width * d_model * 4
    return Estimate(
        weights=weights,
        cache=cache,
        activations=chunk * kept + hidden + min(logits, 3 * rows * width * model.vocab * 4),
        batches=(ahead + 2) * rows * width * _BATCH_ARRAYS * 4,
        # What a run holds beyond its arrays grows with its model: the programs XLA compiles
        # for it and what the allocator keeps. At the peaks of the README's SmolLM2-135M
        # command at 64 new tokens and of the products recipe at 3, 0.08 and 0.06 times the
        # params' bytes beyond RUNTIME and the other parts (3.5 times before the heap and the
        # copies were cut: docs/checkpoints.md, "At 64 new tokens"); counted here as P, a
        # bound with room, not a fit.
        runtime=RUNTIME + params,
        chunk=chunk,
        width=width,
    )


def machine_memory() -> int:
    """The memory this process may use, in bytes: the machine's, or its cgroup's limit if
    lower (a container's)."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as file:
            limit = file.read().strip()
    except OSError:
        return physical
    return min(physical, int(limit)) if limit.isdigit() else physical
