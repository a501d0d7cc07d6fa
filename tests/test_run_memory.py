"""What a training run holds beside its params (issue 42, behind issue 41's 4 GiB for
SmolLM2-135M): each waste found in a real model's run, checked as a structural property on a
tiny model (which buffers a step reuses, what an evaluation keeps), never as an RSS threshold."""

from __future__ import annotations

import jax
import optax
import pytest

from dew.train import Trainer
from dew.train._reference import reference_sync
from test_train import OBJECTIVE, CountingDataset, FakeRollout, params


@pytest.mark.parametrize(
    "optimizer",
    [optax.adam(1e-3), optax.chain(optax.adam(1e-3), reference_sync(2))],
    ids=["adam", "adam-and-a-reference-of-the-params"],
)
def test_a_step_reuses_the_buffers_of_the_weights_and_state_it_replaces(optimizer):
    """The trainer's step donates its variables and optimizer state: the old weights and Adam's
    moments are not held beside the new ones (for SmolLM2-135M in float32, 1.5 GiB of the
    step's peak). The arrays the caller handed in stay good (the trainer steps a copy), and so
    does a state that starts as the params' own arrays (`reference_sync`'s reference): a step
    cannot take one buffer twice."""
    variables = params()
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        trainer = Trainer(OBJECTIVE, optimizer, variables)
        replaced = jax.tree.leaves((trainer.variables, trainer.opt_state))
        trainer.run(FakeRollout(OBJECTIVE, []), CountingDataset([]), steps=2)
    assert trainer.updates == 2
    assert all(leaf.is_deleted() for leaf in replaced)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(variables))


def _compiled_step(layers: int, remat: bool):
    """A tiny Qwen2-shaped checkpoint's donating GRPO step with Adam, compiled (never run) for
    2 rows of 16 positions, where the params and moments outweigh the activations as a small
    model's short replies do; its memory analysis, the model and its params' bytes."""
    import jax.numpy as jnp

    from dew.models import hf
    from dew.objectives.rl.grpo import GRPOObjective

    config = hf.HFConfig(
        architecture="Qwen2ForCausalLM", vocab=512, hidden=64, intermediate=128, layers=layers,
        heads=4, kv_heads=2, head_dim=16, max_len=256, rope_theta=10000.0, qkv_bias=True,
        tied=False,
    )  # fmt: skip
    model = hf.HFModel(config, dtype="float32", remat=remat)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    optimizer = optax.adam(1e-3)
    state = jax.eval_shape(optimizer.init, variables)
    ints = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    floats = jax.ShapeDtypeStruct((2, 16), jnp.float32)
    batch = dict.fromkeys(("tokens", "positions", "segment_ids"), ints)
    batch |= dict.fromkeys(
        ("loss_mask", "advantages", "behavior_logprobs", "proximal_logprobs"), floats
    )
    step = GRPOObjective(model).update_fn(optimizer, donate=True).update
    layout = (None,) * len(jax.tree.leaves((variables, state)))
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        lowered = step.lower(variables, state, batch, layout=layout)
    memory = lowered.compile().memory_analysis()
    params = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(variables))
    return memory, model, params


@pytest.mark.medium
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_the_donating_step_holds_no_second_copy_of_the_weights_and_moments(remat):
    """The step skips a non-finite (or empty) update by a branch, not by choosing between the
    new and the old values: choosing needs both whole, so a donating step's scratch held a
    second copy of the weights and Adam's moments (SmolLM2-135M's compiled step: 2.1 GiB of
    scratch, 1.2 GiB with the branch). Its scratch is below the weights' and moments' bytes."""
    memory, _, params = _compiled_step(8, remat)
    assert memory.alias_size_in_bytes >= 3 * params  # the weights and moments are donated
    assert memory.temp_size_in_bytes < 3 * params, (memory.temp_size_in_bytes, params)


@pytest.mark.medium
def test_the_remat_step_holds_no_copy_of_the_layers_params():
    """Under remat the step keeps only each layer's input for the backward pass, and nothing
    more of the params than the plain step: at rows this narrow, where there are few
    activations to save, its scratch is no larger than the plain step's. Remat ran the layers
    as a scan over their params stacked, a copy of them (and of their gradients) in the step:
    1.0 MB more scratch than the plain step's 2.0 MB here, 0.40 GiB for SmolLM2-135M."""
    plain, _, _ = _compiled_step(8, remat=False)
    remat, _, _ = _compiled_step(8, remat=True)
    assert remat.temp_size_in_bytes <= plain.temp_size_in_bytes, (
        remat.temp_size_in_bytes,
        plain.temp_size_in_bytes,
    )


@pytest.mark.medium
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_the_estimate_bounds_the_compiled_steps_scratch(remat):
    """What the estimate counts for the step beyond its arguments (the gradient, one params'
    worth of `weights`; the activations) is at least the compiled donating step's scratch, for
    a model of many layers and narrow rows."""
    from dew.train._memory import estimate

    memory, model, params = _compiled_step(8, remat)
    needed = estimate(
        model, rows=2, width=16, slots=1, max_len=16, ahead=0, remat=remat, reference=False
    )
    # Of the weights, the params, Adam's two moments and the engine's copy are held anyway.
    step = needed.weights - 4 * params + needed.activations
    assert memory.temp_size_in_bytes <= step <= 3 * memory.temp_size_in_bytes, (
        memory.temp_size_in_bytes,
        step,
    )


def test_each_step_hands_the_heaps_freed_memory_back_before_its_update(monkeypatch):
    """Before each step's update the trainer returns the C heap's free pages to the system
    (glibc's `malloc_trim`, found here): what compilations left free there stood under every
    update's peak (SmolLM2-135M: 0.40 GiB after its update compiled)."""
    import platform

    from dew import _gc
    from dew.train import _trainer

    if platform.libc_ver()[0] == "glibc":
        assert _gc._malloc_trim() is not None
    before = []

    def spy():
        before.append(trainer.optimizer_updates)
        _gc.return_freed_memory()

    monkeypatch.setattr(_trainer, "return_freed_memory", spy)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        trainer = Trainer(OBJECTIVE, optax.adam(1e-3), params())
        trainer.run(FakeRollout(OBJECTIVE, []), CountingDataset([]), steps=3)
    assert trainer.optimizer_updates == 3
    assert before == [0, 1, 2]


def test_the_first_update_compiles_before_the_trim_that_precedes_it(monkeypatch):
    """The update is compiled for a batch's shape before the heap is trimmed, not inside the
    call that runs it: what its compilation freed goes back to the system before the update's
    peak (SmolLM2-135M at 16 x 122: about 0.4 GiB under the first update's). No update call
    compiles anything, and the trim comes after each step's compilation."""
    from dew import _gc
    from dew.objectives.rl._step_layout import LaidOutStep
    from dew.train import _trainer

    compiles = []

    def counted(event: str, seconds: float, **kwargs) -> None:
        # Lowered for each compilation, whether XLA compiles it or JAX's cache holds it.
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            compiles.append(event)

    trims, during_updates = [], []
    run_update = LaidOutStep.__call__

    def spy_update(self, *args, **kwargs):
        before = len(compiles)
        try:
            return run_update(self, *args, **kwargs)
        finally:
            during_updates.append(len(compiles) - before)

    def spy_trim():
        trims.append(len(compiles))
        _gc.return_freed_memory()

    monkeypatch.setattr(LaidOutStep, "__call__", spy_update)
    monkeypatch.setattr(_trainer, "return_freed_memory", spy_trim)
    jax.monitoring.register_event_duration_secs_listener(counted)
    try:
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam
            # A learning rate no other test's trainer uses: this step compiles here.
            trainer = Trainer(OBJECTIVE, optax.adam(1.25e-3), params())
            trainer.run(FakeRollout(OBJECTIVE, []), CountingDataset([]), steps=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(counted)
    assert trainer.optimizer_updates == 2
    assert during_updates == [0, 0]
    assert trims[0] >= 1  # the update's program was compiled before the first trim
