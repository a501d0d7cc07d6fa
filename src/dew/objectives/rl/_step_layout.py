"""`GRPOObjective.update_fn`'s step: one guarded optimizer update, its outputs on the devices its
inputs were on.

A jitted step whose outputs GSPMD lays out otherwise than its inputs compiles again the next
call, and so does every jitted function the weights go to next (the rescoring, the engine's
steps). The step reads its inputs' shardings here, takes them as a static argument and
constrains its outputs to them. Kept apart from the objective: it is about applying an update
and placing arrays on devices, not about the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import optax


def layout(tree: Any) -> tuple[jax.sharding.Sharding | None, ...]:
    """The sharding of each of `tree`'s leaves that is placed on devices (a committed array),
    for the step to hand it back with; None for the leaves jit places as it likes (numpy,
    uncommitted arrays) and for the tracers of an enclosing jit (`dew.parallel`'s step over a
    pool), whose own shardings place them.

    Left to propagation, GSPMD may lay an output out otherwise than its input: on a mesh with a
    one-device axis and a batch it leaves whole, the replicated norms and their Adam moments come
    back split over fsdp, and the step and every jitted function the weights go to (the
    rescoring, the engine's steps) compile again for them. A tuple of shardings is hashable:
    the step takes it as a static argument, which compiles nothing more, since the inputs'
    shardings it is read from key jit's cache already."""
    return tuple(
        leaf.sharding
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.committed
        else None
        for leaf in jax.tree.leaves(tree)
    )


def laid_out(tree: Any, layout: tuple[jax.sharding.Sharding | None, ...]) -> Any:
    """`tree` with each leaf constrained to its sharding in `layout` (`layout` of the inputs
    it mirrors), inside a jitted function; a leaf whose sharding is None left to propagation."""
    leaves, structure = jax.tree.flatten(tree)
    return structure.unflatten(
        leaf if placed is None else jax.lax.with_sharding_constraint(leaf, placed)
        for leaf, placed in zip(leaves, layout, strict=True)
    )


@attrs.frozen(eq=False)
class LaidOutStep:
    """`GRPOObjective.update_fn`'s step: the jitted `update(variables, opt_state, batch,
    layout, key)`, handed the variables' and state's shardings (`layout`) to lay its own out
    as, and a stochastic model's training key (None for any other)."""

    update: Callable

    def __call__(self, variables, opt_state, batch, key=None):
        placed = layout((variables, opt_state))
        if key is None:
            return self.update(variables, opt_state, batch, layout=placed)
        return self.update(variables, opt_state, batch, layout=placed, key=key)

    def compile(self, variables, opt_state, batch, key=None) -> None:
        """Compile the step for these arguments' shapes without running it: jit keeps the
        program for the call that follows, so a caller can hand what the compilation freed
        back to the system before the step's own peak (`dew._gc.return_freed_memory`)."""
        placed = layout((variables, opt_state))
        keys = {} if key is None else {"key": key}
        self.update.lower(variables, opt_state, batch, layout=placed, **keys).compile()

    def _cache_size(self) -> int:
        """The programs compiled, one per input signature, as a jitted function counts them."""
        return self.update._cache_size()


def update_step(
    loss: Callable, optimizer: optax.GradientTransformation, *, donate: bool
) -> LaidOutStep:
    """The jitted step `GRPOObjective.update_fn` returns, on `loss(variables, batch, key=)`
    (the objective's, with its metrics) and `optimizer`; `donate` as `update_fn` takes it."""
    value_and_grad = jax.value_and_grad(loss, has_aux=True)

    donated = ("variables", "opt_state") if donate else ()

    @functools.partial(jax.jit, static_argnames="layout", donate_argnames=donated)
    def update(variables, opt_state, batch, layout, key=None):
        (_, metrics), grads = value_and_grad(variables, batch, key=key)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        # A batch with no trained token carries nothing to learn: an optimizer's momentum
        # alone would move the weights (uniform-group filtering can empty a step).
        finite = finite & (metrics["tokens"] > 0)

        def step(variables, opt_state, grads):
            updates, new_state = optimizer.update(grads, opt_state, variables)
            return optax.apply_updates(variables, updates), new_state

        def keep(variables, opt_state, grads):
            return variables, opt_state

        # A branch, not a choice between the new and the old values: choosing needs both
        # whole, side by side (a donating step's scratch doubled, to 2.1 GiB for SmolLM2's
        # weights and moments), where the update writes into the old values' buffers.
        new_variables, new_state = jax.lax.cond(finite, step, keep, variables, opt_state, grads)
        new_variables, new_state = laid_out((new_variables, new_state), layout)
        return new_variables, new_state, {**metrics, "grad_norm": grad_norm}

    return LaidOutStep(update)
