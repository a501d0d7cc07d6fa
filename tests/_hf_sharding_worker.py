"""Run by tests/test_hf_sharding.py in a process of its own with four CPU devices (XLA_FLAGS
must be set before jax is imported): a checkpoint's params and Adam state sharded over a
fsdp x tensor mesh, a sharded training step against the one-device step, the engine serving
sharded params with each step compiled once, and sharded state saved with orbax and restored
onto another mesh. Each check is an assertion; the process exits non-zero on the first that
fails."""

from __future__ import annotations

import os
import sys

_DEVICES = "--xla_force_host_platform_device_count=4"  # beside the flags the tests give
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import trio  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from _hf_params import drawn  # noqa: E402
from dew.models import hf  # noqa: E402
from dew.models.hf import sharding  # noqa: E402
from dew.objectives.rl.grpo import GRPOObjective  # noqa: E402
from dew.serve import RolloutServer, _engine  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

CONFIG = hf.HFConfig(
    architecture="Qwen3ForCausalLM",
    vocab=260,
    hidden=32,
    intermediate=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    max_len=128,
    qk_norm=True,
)


def rows(seed: int, count: int = 4, width: int = 24) -> dict[str, np.ndarray]:
    """Packed rows of two segments each, with advantages and log-probs to train on."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((count, width), np.int32)
    positions = np.zeros((count, width), np.int32)
    segments = np.zeros((count, width), np.int32)
    for row in range(count):
        start = 0
        for segment, length in enumerate(rng.integers(2, width // 2, size=2), start=1):
            tokens[row, start : start + length] = rng.integers(1, 260, size=length)
            positions[row, start : start + length] = np.arange(length)
            segments[row, start : start + length] = segment
            start += length
    follows = (segments > 0) & (positions > 0)
    logprobs = np.where(follows, rng.uniform(-6.0, -5.0, tokens.shape), 0.0).astype(np.float32)
    return {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segments,
        "loss_mask": follows.astype(np.float32),
        "advantages": np.where(follows, rng.normal(0.0, 1.0, tokens.shape), 0.0).astype(np.float32),
        "behavior_logprobs": logprobs,
        "proximal_logprobs": logprobs,
    }


def check_sharded_params(model, params, mesh) -> None:
    q = params["layers"][0]["q"]
    assert q.sharding.spec == P("fsdp", "tensor"), q.sharding
    assert {shard.data.shape for shard in q.addressable_shards} == {(16, 2, 16)}
    down = params["layers"][1]["down"]
    assert down.sharding.spec == P("tensor", "fsdp"), down.sharding
    assert params["embed"].sharding.spec == P("tensor", "fsdp")
    # Two key/value heads divide by the tensor axis's 2; norms are replicated.
    assert params["layers"][0]["k"].sharding.spec == P("fsdp", "tensor")
    assert params["norm"].sharding.is_fully_replicated
    wide = sharding.param_specs(model, sharding.make_mesh(fsdp=1, tensor=4))
    assert wide["layers"][0]["k"] == P()  # 2 kv heads do not split 4 ways
    assert wide["layers"][0]["q"] == P(None, "tensor")
    # Written as jit writes them: a mesh axis of one device splits nothing.
    whole = sharding.param_specs(model, sharding.make_mesh(fsdp=4))
    assert (whole["layers"][0]["q"], whole["layers"][0]["o"]) == (P("fsdp"), P(None, None, "fsdp"))


@jax.numpy_dtype_promotion("standard")  # optax's Adam
def check_step(model, params, mesh) -> None:
    objective = GRPOObjective(model)
    one = jax.devices()[0]
    alone = jax.device_put(params, one)
    shardings = sharding.param_shardings(model, mesh)
    split = sharding.shard(params, shardings)
    # Adam's moments are sharded as their params.
    adam = optax.adam(1e-2).init(split)
    assert adam[0].mu["layers"][0]["gate"].sharding.spec == P("fsdp", "tensor")
    placed = sharding.state_shardings(optax.adam(1e-2).init(alone), split, mesh)
    assert placed[0].nu["layers"][0]["gate"].spec == P("fsdp", "tensor")
    assert placed[0].count.is_fully_replicated
    # The steps compared by SGD's: Adam's first steps divide gradients by their own size, which
    # turns the sums' rounding in another order into steps that differ past 1e-5.
    optimizer = optax.sgd(0.5)
    update = objective.update_fn(optimizer)
    alone_state, split_state = optimizer.init(alone), optimizer.init(split)
    for step in range(2):
        batch = rows(step)
        alone, alone_state, alone_metrics = update(alone, alone_state, batch)
        sharded_batch = sharding.shard_batch(batch, mesh)
        assert sharded_batch["tokens"].sharding.spec == P(("data", "fsdp"), None)
        split, split_state, split_metrics = update(split, split_state, sharded_batch)
        np.testing.assert_allclose(
            float(split_metrics["loss"]), float(alone_metrics["loss"]), atol=1e-5
        )
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(alone), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert float(jnp.abs(split["layers"][0]["q"] - params["layers"][0]["q"]).max()) > 0
    # The step hands its params back sharded as declared.
    for leaf, declared in zip(jax.tree.leaves(split), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(declared, leaf.ndim), (leaf.sharding, declared)


@jax.numpy_dtype_promotion("standard")  # optax's Adam
def check_step_keeps_shardings(model, params) -> None:
    """On a mesh whose tensor axis has one device, Adam's step hands its params and its state
    back with the shardings they were given, as written (the norms `P()`, not the `P("fsdp")`
    GSPMD picks for them when the batch is whole), so it compiles once and an engine they are
    pushed to keeps its compilations."""
    mesh = sharding.make_mesh(fsdp=4)
    shardings = sharding.param_shardings(model, mesh)
    split = sharding.shard(params, shardings)
    optimizer = optax.adam(1e-2)
    update = GRPOObjective(model).update_fn(optimizer)
    placed = sharding.state_shardings(optimizer.init(split), split, mesh)
    state = sharding.shard(optimizer.init(split), placed)
    for step in range(2):
        # Two rows, which the mesh's four fsdp devices do not split: the batch is whole, as
        # dew train's small batches are, and GSPMD free to shard the norms' updates.
        split, state, _ = update(split, state, sharding.shard_batch(rows(step, count=2), mesh))
    for given, back in ((shardings, split), (placed, state)):
        for (path, leaf), declared in zip(
            jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(given), strict=True
        ):
            assert leaf.sharding == declared, (jax.tree_util.keystr(path), leaf.sharding, declared)
    assert update._cache_size() == 1


def compilations() -> list[int]:
    """The programs the engine's decode and prefill steps have compiled: one per input
    signature (shapes, dtypes and shardings)."""
    return [_engine._decode_step._cache_size(), _engine._prefill_step._cache_size()]


def check_engine(model, params, mesh) -> None:
    prompt = np.array([5, 17, 42, 9], np.int32)

    async def greedy(server, pushed=None):
        if pushed is not None:
            server.load(pushed, 1)
        async with server:
            # A prefill into the new cache, decodes, then a prefill after decodes.
            return [await server.generate(prompt, max_tokens=8, temperature=0.0) for _ in "ab"]

    def engine(served):
        return RolloutServer(model, served, slots=2, max_len=64)

    # Each step compiled once: on one device, with the cache's heads split over the tensor
    # axis, and whole where that axis has one device.
    before = compilations()
    alone = trio.run(greedy, engine(jax.device_put(params, jax.devices()[0])))
    assert np.subtract(compilations(), before).tolist() == [1, 1], before
    for placed in (mesh, sharding.make_mesh(fsdp=4)):
        split = sharding.shard(params, sharding.param_shardings(model, placed))
        before = compilations()
        served = trio.run(greedy, engine(split))
        assert np.subtract(compilations(), before).tolist() == [1, 1], (placed, before)
        for one, sharded in zip(alone, served, strict=True):
            np.testing.assert_array_equal(sharded.completion, one.completion)
            np.testing.assert_allclose(sharded.logprobs, one.logprobs, atol=1e-5)
    # An engine built on one device's params (as dew train's evaluation engine is) lays its
    # cache out anew for the sharded params it is pushed: its steps are the ones compiled above.
    before = compilations()
    trio.run(greedy, engine(jax.device_put(params, jax.devices()[0])), split)
    assert compilations() == before, before


def check_orbax(model, params, mesh, folder: str) -> None:
    split = sharding.shard(params, sharding.param_shardings(model, mesh))
    sharding.save_sharded(folder, split)
    other = sharding.make_mesh(fsdp=4, tensor=1)
    like = jax.eval_shape(lambda tree: tree, split)
    target = jax.tree.map(
        lambda leaf, placed: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed),
        like,
        sharding.param_shardings(model, other),
    )
    restored = sharding.restore_sharded(folder, target)
    q = restored["layers"][0]["q"]
    assert q.sharding.mesh.shape["fsdp"] == 4, q.sharding
    assert {shard.data.shape for shard in q.addressable_shards} == {(8, 4, 16)}, q.sharding
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_load_onto_mesh(model, params, mesh, folder: str) -> None:
    hf.save(folder, model, params)
    shardings = sharding.param_shardings(model, mesh)
    loaded_model, loaded = hf.load(folder, shardings=shardings)
    assert loaded_model == model
    assert loaded["layers"][1]["up"].sharding.spec == P("fsdp", "tensor")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def main(scratch: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    model = hf.HFModel(CONFIG)
    params = drawn(model)
    mesh = sharding.make_mesh(fsdp=2, tensor=2)
    check_sharded_params(model, sharding.shard(params, sharding.param_shardings(model, mesh)), mesh)
    check_load_onto_mesh(model, params, mesh, os.path.join(scratch, "folder"))
    check_step(model, params, mesh)
    check_step_keeps_shardings(model, params)
    check_engine(model, params, mesh)
    check_orbax(model, params, mesh, os.path.join(scratch, "orbax"))
    print("sharding checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
