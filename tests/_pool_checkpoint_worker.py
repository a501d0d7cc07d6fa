"""One process of a pool of two `jax.distributed` processes of two CPU devices each, for
tests/test_sharded_checkpoints.py: a Trainer of a checkpoint's model sharded over a mesh that
spans both processes writes orbax checkpoints, each process its own shards; a run interrupted
and resumed on another mesh equals the uninterrupted one; the checkpoint folder is written
tensor by tensor, by process 0 alone; engines get each process's whole params without a copy.

Run as `python tests/_pool_checkpoint_worker.py PORT PROCESS SCRATCH`. Each check is an
assertion; a process exits non-zero on the first that fails (and a hung one after its timeout,
with every thread's stack), which fails the pool.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
from pathlib import Path

_DEVICES = "--xla_force_host_platform_device_count=2"  # beside the flags the tests give
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from _hf_params import drawn  # noqa: E402
from dew.models import hf  # noqa: E402
from dew.models.hf import sharding  # noqa: E402
from dew.objectives.rl.grpo import GRPOObjective  # noqa: E402
from dew.parallel import local_copy  # noqa: E402
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
OPTIMIZER = optax.sgd(0.05, momentum=0.9)
ROWS, WIDTH = 3, 16  # padded to 4 rows a process: two data slices on each
STEPS, EVERY, CRASH = 5, 2, 3


class Crash(Exception):
    """The pool dies mid-run."""


class Rollout:
    """This process's packed rows of each batch, drawn from the batch's task ids and the
    process's index alone, as the pool's batch over the mesh."""

    def __init__(self, mesh, crash_at: int | None = None):
        self.mesh = mesh
        self.crash_at = crash_at

    def __call__(self, batch, variables, updates):
        if updates == self.crash_at:
            raise Crash(updates)
        rng = np.random.default_rng([jax.process_index(), *map(int, batch["task_id"])])
        logprobs = rng.uniform(-6.0, -5.0, (ROWS, WIDTH)).astype(np.float32)
        rows = {
            "tokens": rng.integers(1, CONFIG.vocab, (ROWS, WIDTH)).astype(np.int32),
            "positions": np.tile(np.arange(WIDTH, dtype=np.int32), (ROWS, 1)),
            "segment_ids": np.ones((ROWS, WIDTH), np.int32),
            "loss_mask": np.tile((np.arange(WIDTH) >= 3).astype(np.float32), (ROWS, 1)),
            "advantages": np.repeat(rng.choice([-1.0, 1.0], (ROWS, 1)), WIDTH, 1).astype(
                np.float32
            ),
            "proximal_logprobs": logprobs,
            "behavior_logprobs": logprobs,
        }
        return sharding.shard_batch(rows, self.mesh)


class Dataset:
    def stream(self, start: int = 0):
        for index in range(start, 64):
            yield {"task_id": np.array([2 * index, 2 * index + 1])}


def run(directory: Path, mesh, *, resume=False, crash_at=None) -> Trainer:
    params = sharding.shard(drawn(MODEL), sharding.param_shardings(MODEL, mesh))
    trainer = Trainer(OBJECTIVE, OPTIMIZER, params, directory=directory, checkpoint_every=EVERY)
    trainer.opt_state = sharding.shard(
        trainer.opt_state, sharding.state_shardings(trainer.opt_state, params, mesh)
    )
    if resume:
        assert trainer.resume().updates == 2
    try:
        trainer.run(Rollout(mesh, crash_at), Dataset(), steps=STEPS)
    except Crash:
        pass
    return trainer


def gathered(tree) -> list[np.ndarray]:
    from dew.models.hf._write import _gathered

    return [_gathered(leaf) for leaf in jax.tree.leaves(tree)]


def main(port: str, process: str, scratch: str) -> None:
    faulthandler.dump_traceback_later(400, exit=True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(process))
    scratch = Path(scratch)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    # Data across the processes, fsdp within each: every process holds whole params.
    split = sharding.make_mesh(data=2, fsdp=2, tensor=1)
    # fsdp across the processes: each holds half of every large param.
    wide = sharding.make_mesh(data=1, fsdp=4, tensor=1)
    with jax.numpy_dtype_promotion("standard"):
        straight = run(scratch / "straight", wide)
        q = straight.variables["layers"][0]["q"]
        assert not q.is_fully_addressable
        assert {shard.data.shape for shard in q.addressable_shards} == {(8, 4, 16)}
        run(scratch / "interrupted", wide, crash_at=CRASH)
        if jax.process_index() == 0:
            shutil.copytree(scratch / "interrupted", scratch / "resumed")
        # Every process waits for the copy before reading it.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("copied")
        resumed = run(scratch / "resumed", split, resume=True)
        assert resumed.updates == STEPS
        for a, b in zip(gathered(resumed.variables), gathered(straight.variables), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        for a, b in zip(gathered(resumed.opt_state), gathered(straight.opt_state), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        # On the data x fsdp mesh each process's devices hold whole params: its engine's view.
        view = sharding.local_view(resumed.variables)
        assert view["layers"][0]["q"].is_fully_addressable
        assert view["layers"][0]["q"].sharding.mesh.devices.size == 2
        for a, b in zip(jax.tree.leaves(view), gathered(resumed.variables), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        try:
            sharding.local_view(straight.variables)
        except ValueError as error:
            assert "only the data axis may span processes" in str(error), error
        else:
            raise AssertionError("a view of params split across processes was made")
        hf.save(scratch / "exported", MODEL, straight.variables)
        np.savez(scratch / f"straight-{process}.npz", *local_copy(gathered(straight.variables)))
    multihost_utils.sync_global_devices("done")
    print("pool checkpoint checks passed", flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(*sys.argv[1:])
