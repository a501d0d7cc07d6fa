"""What the engine checks of a model and its params before serving them (`RolloutServer`):
the protocol's shapes, traced once at construction, and each push's tree and leaves, read off
the leaves; and where params are held, which decides where the engine lays out its cache."""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dew import models


def _signature(variables) -> tuple:
    """The tree layout and each leaf's shape and (canonical) dtype, without device work.

    Read off the leaves themselves rather than traced with `jax.eval_shape`: `load` checks every
    push, once per training step, and a trace costs far more than the check.
    """
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    return treedef, [_shape_and_dtype(leaf) for leaf in leaves]


def _shape_and_dtype(leaf) -> tuple[tuple[int, ...], np.dtype]:
    """A leaf's shape and its dtype as JAX would hold it (float64 as float32 without x64)."""
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    return np.shape(leaf), jax.dtypes.canonicalize_dtype(dtype)


def _placement(params) -> Mesh | jax.Device | None:
    """Where `params` are held: the device mesh they are sharded over, the one device they are
    committed to, or None where they are not committed (jit runs them with its other inputs)."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            if isinstance(leaf.sharding, NamedSharding):
                return leaf.sharding.mesh
            return next(iter(leaf.devices())) if leaf.committed else None
    return None


def _as_model(model) -> models.Model:
    """The model to serve: a `TransformerConfig` stands for its `dew.models.Transformer`."""
    if isinstance(model, models.TransformerConfig):
        return models.Transformer(model)
    if not isinstance(model, models.Model):
        raise TypeError(
            "model must be a dew.models.Model (vocab, max_len, init, __call__, init_cache, "
            f"prefill, decode) or a TransformerConfig, got {type(model).__name__}"
        )
    return model


def _check_logits(model: models.Model, method: str, logits, rows: int) -> None:
    want = (rows, model.vocab)
    if not (isinstance(logits, jax.ShapeDtypeStruct) and logits.shape == want):
        raise ValueError(
            f"model.{method} must return (cache, logits) with float logits{list(want)}, "
            f"got {logits!r}"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"model.{method}'s logits must be floating, got {logits.dtype}")


# What `_check_model` found keeping the protocol, by model: the layouts of params and cache, the
# slots and the bucket it traced. An engine made again for the same model and layouts (a run's
# each evaluation makes one) is not traced again: 2 CPU-s an engine for a 135M-param model.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_model(model: models.Model, params, cache, slots: int, bucket: int) -> None:
    """Trace (without computing) one prefill of a `bucket`-token prompt and one decode step, so
    that a model that breaks the protocol's shapes is refused at construction rather than inside
    the step loop; once for each model, layouts, slots and bucket."""
    try:
        checked = _CHECKED.setdefault(model, set())
    except TypeError:  # a model of the user's that is not hashable or weakly referable
        checked = set()
    (params_tree, params_leaves), (cache_tree, cache_leaves) = map(_signature, (params, cache))
    key = (params_tree, tuple(params_leaves), cache_tree, tuple(cache_leaves), slots, bucket)
    if key in checked:
        return
    _trace_model(model, params, cache, slots, bucket)
    checked.add(key)


def _trace_model(model: models.Model, params, cache, slots: int, bucket: int) -> None:
    cache_layout = jax.tree.structure(jax.eval_shape(lambda tree: tree, cache))
    prompt = jax.ShapeDtypeStruct((bucket,), jnp.int32)
    slot = jax.ShapeDtypeStruct((), jnp.int32)
    for method, args, rows in [
        ("prefill", (prompt, slot), bucket),
        ("decode", (jax.ShapeDtypeStruct((slots,), jnp.int32),) * 2, slots),
    ]:
        written, logits = jax.eval_shape(getattr(model, method), params, cache, *args)
        if jax.tree.structure(written) != cache_layout:
            raise ValueError(f"model.{method} must return a cache laid out as init_cache's")
        _check_logits(model, method, logits, rows)
