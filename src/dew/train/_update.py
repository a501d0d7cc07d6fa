"""The trainer's jitted update, one per objective and optimizer, and the optimizer state it
takes: placed where the variables are, apart from them where the step donates both."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import optax

from dew._arrays import copy_tree
from dew.objectives.rl.grpo import GRPOObjective
from dew.parallel import DataParallelUpdate, local_copy
from dew.train._checkpoint import Variables

# Each objective's jitted step per optimizer, so trainers that share both (a trainer resumed in
# the same process, a notebook's second run) compile it once.
_UPDATE_FNS: weakref.WeakKeyDictionary[GRPOObjective, dict] = weakref.WeakKeyDictionary()


def _update_fn(
    objective: GRPOObjective, optimizer: optax.GradientTransformation, *, pooled: bool
) -> Callable:
    """The jitted step; in a pool of processes, one step over the pool's global batch that
    hands back this process's copy of the replicated variables and state."""
    steps = _UPDATE_FNS.setdefault(objective, {})
    if (optimizer, pooled) not in steps:
        # A pool's step hands back local copies of its variables: nothing there to donate.
        update = objective.update_fn(optimizer, donate=not pooled)
        if pooled:
            update = _pooled(DataParallelUpdate(update))
        steps[optimizer, pooled] = update
    return steps[optimizer, pooled]


def _state_beside(state: Any, variables: Variables) -> Any:
    """An optimizer's initial state with its leaves that no device holds yet (a step count, which
    optax makes on the default device) replicated where the variables are placed, as the step
    hands them back: left unplaced, the first step would be compiled for them and the second
    again for the placed ones. Leaves placed already (moments made like their variables) and the
    state of variables placed nowhere stay as they are."""
    placed = [
        leaf.sharding
        for leaf in jax.tree.leaves(variables)
        if isinstance(leaf, jax.Array) and leaf.committed
    ]
    if not placed:
        return state
    if isinstance(placed[0], jax.sharding.NamedSharding):
        replicated = jax.sharding.NamedSharding(placed[0].mesh, jax.sharding.PartitionSpec())
    elif placed[0].is_fully_replicated:  # one device's
        replicated = placed[0]
    else:
        return state

    def beside(leaf):
        if isinstance(leaf, jax.Array) and not leaf.committed:
            return jax.device_put(leaf, replicated)
        return leaf

    return jax.tree.map(beside, state)


def _apart(state: Any, variables: Variables) -> Any:
    """`state` with each leaf that is one of `variables`' own arrays copied (an optimizer state
    that keeps the params it starts from, as `reference_sync`'s does): a step that donates both
    cannot take one buffer twice."""
    own = {id(leaf) for leaf in jax.tree.leaves(variables)}
    return jax.tree.map(lambda leaf: copy_tree(leaf) if id(leaf) in own else leaf, state)


def _pooled(parallel: DataParallelUpdate) -> Callable:
    def update(variables, opt_state, rows):
        variables, opt_state, metrics = parallel(variables, opt_state, rows)
        return local_copy(variables), local_copy(opt_state), metrics

    return update
