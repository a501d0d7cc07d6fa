"""Checkpoints of params sharded over a four-device mesh: orbax shards beside the trainer's
state, resumed exactly on the same mesh, another mesh or one device, never from a checkpoint
left uncommitted or cut short; and sharded params exported as a folder transformers loads.

The devices are CPU devices forced by XLA_FLAGS, which must be set before jax is imported: the
checks run in a process of their own, tests/_sharded_checkpoint_worker.py, whose assertions
they are; the worker runs once for the module, and the export is compared here with
transformers, which the worker does not import."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dew._torch_media import hide_broken_media_packages

WORKER = Path(__file__).parent / "_sharded_checkpoint_worker.py"


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    scratch = tmp_path_factory.mktemp("sharded")
    environment = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
    }
    finished = subprocess.run(
        [sys.executable, str(WORKER), str(scratch)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return scratch, finished


@pytest.mark.slow
def test_a_sharded_run_resumes_exactly_on_another_mesh_never_from_a_broken_checkpoint(worker):
    """A Trainer on a 1x2x2 mesh checkpoints into an orbax folder (variables/ and opt_state/,
    each process's OCDBT files; no npz); interrupted and resumed it equals the uninterrupted
    run bitwise on the same mesh, and to 1e-5 on 1x4x1 and on one device, its state placed on
    the new mesh; a checkpoint whose commit record was never written, and orbax's temporary
    folder of a killed write, are passed over (the next commit removes them); a committed folder
    with a file cut short or gone is refused, naming the file."""
    _, finished = worker
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "sharded checkpoint checks passed" in finished.stdout


@pytest.mark.slow
def test_sharded_params_export_a_folder_transformers_loads_with_equal_logits(worker):
    """The folder written from sharded params, gathered one tensor at a time, loads in
    transformers with the logits dew computes from the sharded params."""
    scratch, finished = worker
    assert finished.returncode == 0, finished.stdout + finished.stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hide_broken_media_packages()
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        scratch / "exported", dtype=torch.float32, attn_implementation="eager"
    )
    tokens = np.load(scratch / "tokens.npy")
    with torch.no_grad():
        logits = model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(logits, np.load(scratch / "logits.npy"), atol=1e-4, rtol=0)


POOL_WORKER = Path(__file__).parent / "_pool_checkpoint_worker.py"


@pytest.mark.slow
def test_a_pool_whose_mesh_spans_its_processes_writes_each_process_its_shards(tmp_path):
    """Two `jax.distributed` processes of two CPU devices: a trainer on a 1x4x1 mesh across
    both (each process half of every param) checkpoints orbax shards, each process its own
    OCDBT files; interrupted, it resumes on a 2x2x1 mesh (data across the processes) equal to
    the uninterrupted run to 1e-5, and there each process's engine gets whole params from its
    own shards without a copy; process 0 alone writes the exported folder, gathered tensor by
    tensor. Here, in one process of one device, the pool's checkpoint restores too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    logs = [tmp_path / f"process-{index}.log" for index in range(2)]
    with contextlib.ExitStack() as stack:
        workers = [
            subprocess.Popen(
                [sys.executable, str(POOL_WORKER), str(port), str(index), str(tmp_path)],
                stdout=stack.enter_context(log.open("w")),
                stderr=subprocess.STDOUT,
                env=environment,
            )
            for index, log in enumerate(logs)
        ]
        try:
            codes = [worker.wait(timeout=500) for worker in workers]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
    said = "\n".join(log.read_text() for log in logs)
    assert codes == [0, 0], said
    assert said.count("pool checkpoint checks passed") == 2, said

    checkpoints = tmp_path / "resumed" / "checkpoints"
    record = json.loads((checkpoints / "checkpoint.json").read_text())
    assert (record["storage"], record["updates"]) == ("orbax", 5)
    for tree in ("variables", "opt_state"):
        for process in (0, 1):
            files = checkpoints / record["arrays"] / tree / f"ocdbt.process_{process}"
            assert any(path.is_file() for path in files.rglob("*")), files
    # No npz of the params: the workers' reference arrays are the only ones.
    assert sorted(p.name for p in tmp_path.rglob("*.npz")) == ["straight-0.npz", "straight-1.npz"]

    import jax
    import optax

    from dew.models import hf
    from dew.train import load_checkpoint

    model, exported = hf.load(tmp_path / "exported")
    with np.load(tmp_path / "straight-0.npz") as stored:
        straight = [stored[f"arr_{index}"] for index in range(len(stored.files))]
    for leaf, want in zip(jax.tree.leaves(exported), straight, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), want)
    # A template of zeros, laid out as the exported params (the model's init runs op by op).
    params = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), exported)
    optimizer = optax.sgd(0.05, momentum=0.9)
    with jax.numpy_dtype_promotion("standard"):
        loaded = load_checkpoint(checkpoints, params, optimizer.init(params))
    for leaf, want in zip(jax.tree.leaves(loaded.variables), straight, strict=True):
        np.testing.assert_allclose(np.asarray(leaf), want, atol=1e-5, rtol=0)
