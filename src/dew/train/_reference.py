"""A KL reference that follows the policy: re-synced to the trained weights every N updates.

The KL penalty holds the policy near a reference; against the initial weights for the whole run
it holds it ever harder as training moves on. Re-syncing the reference to the policy every N
updates (TRL's `sync_ref_model`) bounds the penalty to the last N updates' drift instead.

The reference is kept in the optimizer's state, as the last link of its chain: every checkpoint
then holds it with the moments (the weights of the last sync, which the checkpoint's own weights
are not unless the checkpoint falls on one), so a resumed run rescores against the very
reference the stopped one had, and a mesh lays it out as the params it mirrors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dew._checks import check_int


class ReferenceState(NamedTuple):
    """`reference_sync`'s state: the updates taken (int32 scalar) and the weights of the last
    sync before the latest update (the initial ones at first)."""

    count: jax.Array
    reference: Any


def reference_sync(every: int) -> optax.GradientTransformation:
    """An optax link that passes updates through and keeps the reference the KL penalty is
    taken against: the params as they were after the last update that was a multiple of
    `every` (the initial params before the first), `synced_reference` reads it.

    The link copies the params it is handed (those the update starts from) when the updates
    taken so far are a multiple of `every`: an exact copy of the weights the trainer held, not
    a recomputation of them. Between that update and the copy, the reference is the trainer's
    weights themselves, which `synced_reference` returns then.

    Args:
        every: updates between syncs, at least 1.

    Returns:
        The transformation; its state is a `ReferenceState`.

    Raises:
        ValueError: an `every` below 1, naming it.
    """
    every = check_int("every", every, low=1)

    def init(params):
        return ReferenceState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.asarray, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("reference_sync needs the params: pass them to optimizer.update")
        synced = state.count % every == 0
        reference = jax.tree.map(
            lambda new, old: jnp.where(synced, new, old), params, state.reference
        )
        return updates, ReferenceState(state.count + 1, reference)

    return optax.GradientTransformation(init, update)


def synced_reference(opt_state: Any, variables: Any, *, every: int) -> Any:
    """The reference the KL penalty is taken against at the state `opt_state` of a
    `reference_sync(every)` link and the weights `variables` it goes with: `variables` when the
    updates taken are a multiple of `every` (a sync is due at this very point), else the
    weights of the last sync, which the state holds.

    Raises:
        ValueError: when `opt_state` holds no such link.
    """
    found = [
        node
        for node in jax.tree.leaves(
            opt_state, is_leaf=lambda node: isinstance(node, ReferenceState)
        )
        if isinstance(node, ReferenceState)
    ]
    if len(found) != 1:
        raise ValueError(f"the optimizer state holds {len(found)} reference_sync states, not 1")
    (state,) = found
    return variables if int(state.count) % every == 0 else state.reference
