"""Checkpoints of params sharded over a four-device mesh: orbax shards beside the trainer's
state, resumed exactly on the same mesh, another mesh or one device, never from a checkpoint
left uncommitted or cut short; and sharded params exported as a folder transformers loads.

The devices are CPU devices forced by XLA_FLAGS, which must be set before jax is imported: the
checks run in a process of their own, tests/_sharded_checkpoint_worker.py, whose assertions
they are; the worker runs once for the module, and the export is compared here with
transformers, which the worker does not import."""

from __future__ import annotations

import os
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
    environment = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    finished = subprocess.run(
        [sys.executable, str(WORKER), str(scratch)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return scratch, finished


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
