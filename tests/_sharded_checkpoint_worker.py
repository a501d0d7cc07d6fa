"""Run by tests/test_sharded_checkpoints.py in a process of its own with four CPU devices
(XLA_FLAGS must be set before jax is imported): a Trainer of a checkpoint's model sharded over
a mesh writes orbax checkpoints, a run interrupted on one mesh and resumed on another (or on one
device) equals the uninterrupted run, an uncommitted or truncated orbax checkpoint is never
resumed from, and sharded params are exported as a folder tensor by tensor. Each check is an
assertion; the process exits non-zero on the first that fails. It leaves in its scratch folder
the exported folder and dew's logits of its params, for the test to compare with transformers'.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

_DEVICES = "--xla_force_host_platform_device_count=4"  # beside the flags the tests give
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from _hf_params import drawn  # noqa: E402
from dew.models import hf  # noqa: E402
from dew.models.hf import _write, sharding  # noqa: E402
from dew.objectives.rl.grpo import GRPOObjective  # noqa: E402
from dew.train import _checkpoint  # noqa: E402
from dew.train._checkpoint import COMMIT, load_checkpoint, read_commit  # noqa: E402
from dew.train._trainer import Trainer  # noqa: E402

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
MODEL = hf.HFModel(CONFIG)
OBJECTIVE = GRPOObjective(MODEL)
# A stateful optimizer, so a resume must restore its state too.
OPTIMIZER = optax.sgd(0.05, momentum=0.9)
ROWS, WIDTH = 4, 16
STEPS, EVERY, CRASH = 5, 2, 3


class Crash(Exception):
    """The trainer's process dies mid-run."""


class Rollout:
    """Packed rows drawn from each batch's task ids alone (so every run trains the same rows),
    scored under the variables handed over, split over the mesh's data axes when there is one."""

    def __init__(self, mesh, crash_at: int | None = None):
        self.mesh = mesh
        self.crash_at = crash_at

    def __call__(self, batch, variables, updates):
        if updates == self.crash_at:
            raise Crash(updates)
        rng = np.random.default_rng([int(i) for i in batch["task_id"]])
        rows = {
            "tokens": rng.integers(1, CONFIG.vocab, (ROWS, WIDTH)).astype(np.int32),
            "positions": np.tile(np.arange(WIDTH, dtype=np.int32), (ROWS, 1)),
            "segment_ids": np.ones((ROWS, WIDTH), np.int32),
            "loss_mask": np.tile((np.arange(WIDTH) >= 3).astype(np.float32), (ROWS, 1)),
            "advantages": np.repeat(rng.choice([-1.0, 1.0], (ROWS, 1)), WIDTH, 1).astype(
                np.float32
            ),
        }
        rows["proximal_logprobs"] = np.asarray(
            OBJECTIVE.packed_log_probs(variables, rows), np.float32
        )
        rows["behavior_logprobs"] = rows["proximal_logprobs"] - np.float32(0.1)
        return rows if self.mesh is None else sharding.shard_batch(rows, self.mesh)


class Dataset:
    """Batches of two task ids."""

    def stream(self, start: int = 0):
        for index in range(start, 64):
            yield {"task_id": np.array([2 * index, 2 * index + 1])}


def initial_params():
    return drawn(MODEL)


def run(directory: Path, mesh, *, resume=False, crash_at=None) -> Trainer:
    """A trainer on `mesh` (None: one device) trained to STEPS, checkpointing every EVERY."""
    params = initial_params()
    if mesh is not None:
        params = sharding.shard(params, sharding.param_shardings(MODEL, mesh))
    trainer = Trainer(OBJECTIVE, OPTIMIZER, params, directory=directory, checkpoint_every=EVERY)
    if resume:
        assert trainer.resume().updates == 2
    trainer.run(Rollout(mesh, crash_at), Dataset(), steps=STEPS)
    return trainer


def host(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def assert_same(a, b, atol=0.0) -> None:
    for x, y in zip(host(a), host(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def assert_placed(tree, mesh) -> None:
    """Every large leaf of `tree` sharded on `mesh` as its params table declares (or whole on
    one device when `mesh` is None)."""
    declared = sharding.param_shardings(MODEL, mesh) if mesh is not None else None
    for index, leaf in enumerate(jax.tree.leaves(tree)):
        if mesh is None:
            assert len(leaf.sharding.device_set) == 1, leaf.sharding
        else:
            want = jax.tree.leaves(declared)[index]
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)


def check_layout(checkpoints: Path) -> Path:
    """The checkpoint is an orbax folder of shards named by the commit record; no npz of the
    whole arrays exists; nothing an earlier checkpoint wrote is left."""
    record = json.loads((checkpoints / COMMIT).read_text())
    assert record["storage"] == "orbax" and record["updates"] == 2, record
    folder = checkpoints / record["arrays"]
    assert sorted(p.name for p in checkpoints.iterdir()) == sorted([COMMIT, folder.name])
    assert {"variables", "opt_state"} <= {p.name for p in folder.iterdir()}
    # orbax's OCDBT layout: each process writes its own data files (here one process).
    assert (folder / "variables" / "ocdbt.process_0").is_dir(), sorted(folder.rglob("*"))
    assert not list(checkpoints.parent.rglob("*.npz"))
    assert set(record["files"]) == {
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
    }
    return folder


def check_resumes(scratch: Path) -> None:
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    straight = run(scratch / "straight", mesh)
    assert_placed(straight.variables, mesh)
    interrupted = scratch / "interrupted"
    with pytest.raises(Crash):
        run(interrupted, mesh, crash_at=CRASH)
    check_layout(interrupted / "checkpoints")
    # The same mesh: the very run.
    shutil.copytree(interrupted, scratch / "same")
    same = run(scratch / "same", mesh, resume=True)
    assert_same(same.variables, straight.variables)
    assert_same(same.opt_state, straight.opt_state)
    # Another mesh, and one device: the same run up to the sums' order on the devices.
    for name, other in (("wide", sharding.make_mesh(data=1, fsdp=4, tensor=1)), ("one", None)):
        shutil.copytree(interrupted, scratch / name)
        resumed = run(scratch / name, other, resume=True)
        assert_placed(resumed.variables, other)
        assert_same(resumed.variables, straight.variables, atol=1e-5)
        assert_same(resumed.opt_state, straight.opt_state, atol=1e-5)
        assert (resumed.updates, resumed.position) == (STEPS, STEPS)


def templates(mesh):
    params = sharding.shard(initial_params(), sharding.param_shardings(MODEL, mesh))
    return params, OPTIMIZER.init(params)


def check_never_resumed_from(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint whose commit record was never renamed into place, orbax's temporary folder
    of one killed mid-write, and a committed folder cut short: none is resumed from."""
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    directory = scratch / "commits"
    params, state = templates(mesh)
    moved = jax.tree.map(lambda leaf: leaf + 1, (params, state))
    _checkpoint.save_checkpoint(directory, _checkpoint.Checkpoint(*moved, 1, 1, {"n": 1}))

    real = _checkpoint._write_atomically

    def dies_at_the_commit(path, write):
        if path.name == COMMIT:
            raise KeyboardInterrupt("killed before the commit record's rename")
        real(path, write)

    with monkeypatch.context() as patch:
        patch.setattr(_checkpoint, "_write_atomically", dies_at_the_commit)
        with pytest.raises(KeyboardInterrupt):
            later = jax.tree.map(lambda leaf: leaf + 3, (params, state))
            _checkpoint.save_checkpoint(directory, _checkpoint.Checkpoint(*later, 3, 3, {}))
    orphans = [p for p in directory.iterdir() if p.name.startswith("state-00000003")]
    assert len(orphans) == 1 and orphans[0].is_dir()  # written whole, but never committed
    killed = directory / "state-00000005-0000abcd.orbax.orbax-checkpoint-tmp-1700000000"
    (killed / "variables").mkdir(parents=True)
    (killed / "variables" / "half-written").write_bytes(b"\0" * 10)
    loaded = load_checkpoint(directory, params, state)
    assert (loaded.updates, loaded.position, loaded.metadata) == (1, 1, {"n": 1})
    assert_same((loaded.variables, loaded.opt_state), moved)
    assert_placed(loaded.variables, mesh)
    # The next commit removes what neither record names.
    _checkpoint.save_checkpoint(directory, _checkpoint.Checkpoint(*moved, 4, 4, {}))
    record = read_commit(directory)
    assert sorted(p.name for p in directory.iterdir()) == sorted([COMMIT, record["arrays"]])

    # A committed folder with a file cut short, or gone: refused, naming the file.
    folder = directory / record["arrays"]
    largest = max(record["files"], key=record["files"].get)
    with open(folder / largest, "r+b") as file:
        file.truncate(record["files"][largest] // 2)
    with pytest.raises(ValueError, match=f"{largest} is damaged: .* bytes, the commit record"):
        read_commit(directory)
    with pytest.raises(ValueError, match=f"{largest} is damaged"):
        load_checkpoint(directory, params, state)
    (folder / largest).unlink()
    with pytest.raises(ValueError, match=f"{largest} is missing"):
        read_commit(directory)


def check_export(scratch: Path) -> None:
    """Sharded params written as a checkpoint folder one tensor at a time: it loads back equal,
    and dew's logits of the sharded params are kept for the test to compare with transformers'."""
    mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    params = sharding.shard(initial_params(), sharding.param_shardings(MODEL, mesh))
    # Gathered one at a time: no whole-params gather (a device_get of the tree) happens.
    gathered = []
    real = _write._gathered

    def counted(value):
        gathered.append(value.shape)
        return real(value)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_write, "_gathered", counted)
        hf.save(scratch / "exported", MODEL, params)
    assert len(gathered) == len(jax.tree.leaves(params))
    loaded_model, loaded = hf.load(scratch / "exported")
    assert loaded_model == MODEL
    assert_same(loaded, params)
    tokens = np.random.default_rng(3).integers(0, CONFIG.vocab, 16).astype(np.int32)
    logits = MODEL(
        params,
        jnp.asarray(tokens[None]),
        jnp.arange(16, dtype=jnp.int32)[None],
        jnp.ones((1, 16), jnp.int32),
    )[0]
    np.save(scratch / "tokens.npy", tokens)
    np.save(scratch / "logits.npy", np.asarray(logits))


def main(scratch: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    scratch = Path(scratch)
    with jax.numpy_dtype_promotion("standard"):
        check_resumes(scratch)
        with pytest.MonkeyPatch.context() as patch:
            check_never_resumed_from(scratch, patch)
        check_export(scratch)
    print("sharded checkpoint checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
