"""A sharded run's checkpoint: orbax shards against the single npz, and the checkpoint folder.

On four CPU devices (forced by XLA_FLAGS before jax is imported), a random model of a
checkpoint family's shape is sharded over a 1x2x2 mesh with its Adam state, then:

- `save_checkpoint` writes its orbax shards (each process its own) beside the commit record;
- `load_checkpoint` restores them onto a 1x4x1 mesh, and onto one device;
- the same state gathered to one device is written as the unsharded path's npz, for reference;
- `hf.save` writes the checkpoint folder from the sharded params, one tensor at a time.

Each is timed once after a warm-up write; the bytes are those on disk. On CPU devices the
devices' memory is the host's, so no memory figure here says what an accelerator would hold.

    python benchmarks/sharded_checkpoints.py [--smoke] [--layers N --hidden H --vocab V]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

# Beside the environment's own flags (the tests' compile settings, say), not in their place.
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
)

import jax  # noqa: E402
import optax  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def timed(action) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    jax.block_until_ready(jax.tree.leaves(result) if result is not None else [])
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, for CI")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from dew.models import hf
    from dew.models.hf import sharding
    from dew.train import Checkpoint, load_checkpoint, save_checkpoint

    layers, hidden, vocab = (1, 64, 512) if args.smoke else (args.layers, args.hidden, args.vocab)
    config = hf.HFConfig(
        architecture="Qwen3ForCausalLM",
        vocab=vocab,
        hidden=hidden,
        intermediate=hidden * 8 // 3 // 64 * 64,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        head_dim=64,
        max_len=4096,
        qk_norm=True,
    )
    model = hf.HFModel(config)
    split = sharding.make_mesh(data=1, fsdp=2, tensor=2)
    wide = sharding.make_mesh(data=1, fsdp=4, tensor=1)
    params = sharding.shard(model.init(jax.random.key(0)), sharding.param_shardings(model, split))
    optimizer = optax.adam(1e-4)
    with jax.numpy_dtype_promotion("standard"):
        state = optimizer.init(params)
    # Moments of random values, as a trained run's are: zeros would compress to nothing.
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
    state = jax.tree.map(
        lambda leaf: (
            jax.random.normal(next(keys), leaf.shape, leaf.dtype)
            if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
            else leaf
        ),
        state,
    )
    state = sharding.shard(state, sharding.state_shardings(state, params, split))
    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves((params, state)))
    print(f"model: {count / 1e6:.1f} M params, params and Adam state {state_bytes / 2**20:.1f} MiB")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        orbax = scratch / "orbax"
        save_checkpoint(orbax, Checkpoint(params, state, 0, 0))  # warm-up: imports, compiles
        seconds, _ = timed(lambda: save_checkpoint(orbax, Checkpoint(params, state, 1, 1)))
        written = folder_bytes(orbax)
        files = sum(1 for path in orbax.rglob("*") if path.is_file())
        rows.append(
            ("save: orbax shards (1x2x2)", seconds, f"{written / 2**20:.1f} MiB, {files} files")
        )
        for name, mesh in (("1x4x1", wide), ("one device", None)):
            if mesh is None:
                like_params, like_state = jax.device_put((params, state), jax.devices()[0])
            else:
                like_params = sharding.shard(params, sharding.param_shardings(model, mesh))
                placed = sharding.state_shardings(state, like_params, mesh)
                like_state = sharding.shard(state, placed)
            seconds, _ = timed(
                lambda p=like_params, s=like_state: load_checkpoint(orbax, p, s).variables
            )
            rows.append((f"restore: orbax onto {name}", seconds, ""))
        whole = jax.device_put((params, state), jax.devices()[0])
        npz = scratch / "npz"
        save_checkpoint(npz, Checkpoint(*whole, 0, 0))
        seconds, _ = timed(lambda: save_checkpoint(npz, Checkpoint(*whole, 1, 1)))
        rows.append(
            ("save: npz of the gathered state", seconds, f"{folder_bytes(npz) / 2**20:.1f} MiB")
        )
        seconds, _ = timed(lambda: hf.save(scratch / "folder", model, params))
        size = folder_bytes(scratch / "folder")
        rows.append(("checkpoint folder, tensor by tensor", seconds, f"{size / 2**20:.1f} MiB"))
        shutil.rmtree(scratch / "folder")
    print(f"{'what':<38} {'seconds':>8}  on disk")
    for what, seconds, note in rows:
        print(f"{what:<38} {seconds:>8.3f}  {note}")


if __name__ == "__main__":
    main()
