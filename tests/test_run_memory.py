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
