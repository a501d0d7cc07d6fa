"""A checkpoint's params, optimizer state and batch sharded over a four-device mesh (CPU devices
forced by XLA_FLAGS, which must be set before jax is imported: hence a process of its own,
tests/_hf_sharding_worker.py, whose assertions these are)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from _hf_folders import chat_checkpoint
from dew.cli import main
from dew.train import TrainConfig

WORKER = Path(__file__).parent / "_hf_sharding_worker.py"
SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.mark.slow
def test_sharded_params_train_serve_and_restore_onto_another_mesh(tmp_path):
    """Params and Adam's moments are split over fsdp x tensor as the params table declares; a
    sharded step with the batch over the data axes equals the one-device step to 1e-5 and hands
    its params back sharded alike, and Adam's step its params and state as they came in; the
    engine serves sharded params as it serves whole ones, its cache laid out as its steps hand
    it back, so each step compiles once on a mesh; `load` places each tensor on its shard as it
    reads it; orbax restores sharded state onto a mesh of another shape."""
    environment = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4",
    }
    finished = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "sharding checks passed" in finished.stdout


@pytest.mark.slow
def test_dew_train_splits_a_checkpoint_over_a_pools_mesh_and_resumes_on_another(tmp_path):
    """`dew train --model --processes 2 --mesh 2x2x1`, two processes of two CPU devices, trains
    on a mesh across both (data across the processes, fsdp within each) and checkpoints orbax
    shards, each process its own (no npz of the params), with the checkpoint folder written at
    the run's end; resumed by one process of four devices with `--mesh 1x4x1`, it restores the
    shards onto that mesh and goes on, each jitted step compiled once; `dew export` then writes
    the run's folder again."""
    folder = chat_checkpoint(tmp_path / "checkpoint", SHAPE)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dew", "train", "--model", str(folder)]
    command += ["--run", str(run), "--batch-size", "2", "--groups", "2", "--tasks", "8"]
    checkpoints = run / "checkpoints"
    runs = (
        (2, ["--steps", "2", "--mesh", "2x2x1", "--processes", "2"]),
        (4, ["--steps", "4", "--mesh", "1x4x1", "--resume"]),
    )
    for devices, options in runs:
        environment = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(sys.path),
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
            f"--xla_force_host_platform_device_count={devices}",
            "JAX_LOG_COMPILES": "1",
        }
        finished = subprocess.run(
            [*command, *options],
            env=environment,
            capture_output=True,
            text=True,
            timeout=600,
        )
        said = finished.stdout + finished.stderr
        if (run / "logs").is_dir():
            said += "".join(log.read_text() for log in (run / "logs").iterdir())
        assert finished.returncode == 0, said
        record = json.loads((checkpoints / "checkpoint.json").read_text())
        assert record["storage"] == "orbax", record
        shards = checkpoints / record["arrays"]
        assert sorted(p.name for p in checkpoints.iterdir()) == sorted(
            ["checkpoint.json", "model", shards.name]
        )
        assert (shards / "variables" / "ocdbt.process_0").is_dir()
        assert not list(run.rglob("*.npz"))
        assert (checkpoints / "model" / "model.safetensors").is_file()
        if devices == 2:  # the pool's processes wrote shards each
            assert (shards / "variables" / "ocdbt.process_1").is_dir()
            assert record["metadata"]["processes"] == 2
    assert "resuming at step 2, data position 2" in finished.stdout
    # Each update hands the weights and Adam's state back sharded as they went in (the norms
    # whole, though 1x4x1's fsdp devices do not split the batch), so across the resumed run's
    # two steps the update, the rescoring and the engine's steps each compile once.
    compiled = re.findall(r"Compiling jit\((\w+)\)", finished.stdout + finished.stderr)
    steps = ("update", "_log_probs", "_prefill_step", "_decode_step")
    assert [compiled.count(name) for name in steps] == [1, 1, 1, 1], compiled
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2, 3, 4]
    assert all(math.isfinite(line["loss"]) for line in lines)
    assert json.loads((run / "config.json").read_text())["mesh"] == "1x4x1"
    # `dew export` restores the last checkpoint's params onto this process's one device and
    # writes the folder the run wrote at its end, byte for byte.
    assert main(["export", "--run", str(run), "--to", str(tmp_path / "exported")]) == 0
    for written in (checkpoints / "model").iterdir():
        assert (tmp_path / "exported" / written.name).read_bytes() == written.read_bytes()


def test_dew_export_names_what_it_cannot_export(tmp_path, capsys):
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.json").write_text(json.dumps(attrs.asdict(TrainConfig())))
    for run, culprit in (
        (tmp_path / "none", "holds no dew train run (no config.json)"),
        (tmp_path / "own", "trained dew's own transformer, not a --model checkpoint folder"),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(["export", "--run", str(run)])
        assert stopped.value.code == 2
        assert culprit in capsys.readouterr().err
