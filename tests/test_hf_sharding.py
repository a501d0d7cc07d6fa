"""A checkpoint's params, optimizer state and batch sharded over a four-device mesh (CPU devices
forced by XLA_FLAGS, which must be set before jax is imported: hence a process of its own,
tests/_hf_sharding_worker.py, whose assertions these are)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent / "_hf_sharding_worker.py"


def test_sharded_params_train_serve_and_restore_onto_another_mesh(tmp_path):
    """Params and Adam's moments are split over fsdp x tensor as the params table declares; a
    sharded step with the batch over the data axes equals the one-device step to 1e-5 and hands
    its params back sharded alike; the engine serves sharded params as it serves whole ones;
    `load` places each tensor on its shard as it reads it; orbax restores sharded state onto a
    mesh of another shape."""
    environment = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    finished = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "sharding checks passed" in finished.stdout
