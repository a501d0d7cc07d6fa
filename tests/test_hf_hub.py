"""A checkpoint named by its Hugging Face Hub repository id (`dew.models.hf.resolve`).

Nothing is downloaded: the tests write a Hub cache of their own, laid out as `huggingface_hub`
lays out what it downloads (`models--OWNER--NAME/refs/main` naming a commit,
`snapshots/COMMIT/` holding links to the files in `blobs/`), and the real `huggingface_hub`
reads it, offline, as it reads a repository cached before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import jax
import numpy as np
import pytest

from _checkpoint import tiny_qwen2
from dew.models import hf
from dew.models.hf import _hub

REPO = "dew-tests/tiny-qwen2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture
def hub(checkpoint, tmp_path, monkeypatch):
    """A Hub cache holding REPO, offline, for this process and the processes it starts; returns
    the snapshot folder and the folder it was copied from."""
    folder = checkpoint
    cache = tmp_path / "hub"
    repository = cache / f"models--{REPO.replace('/', '--')}"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(COMMIT)
    # As the Hub library stores a download: each file a blob, named by its hash, and the
    # snapshot's entries links to the blobs.
    snapshot = repository / "snapshots" / COMMIT
    (repository / "blobs").mkdir()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            blob = repository / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, blob)
            entry = snapshot / path.relative_to(folder)
            entry.parent.mkdir(parents=True, exist_ok=True)
            entry.symlink_to(os.path.relpath(blob, entry.parent))
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _hub._snapshot.cache_clear()
    yield snapshot, folder
    _hub._snapshot.cache_clear()


def test_a_repository_id_loads_the_snapshot_the_hub_cached(hub):
    snapshot, folder = hub
    assert hf.resolve(REPO) == snapshot
    model, params = hf.load(REPO)
    same, expected = hf.load(folder)
    assert model == same
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert hf.model_of(REPO) == same


def test_a_revision_after_the_id_picks_its_snapshot(hub):
    """OWNER/NAME@REVISION: a commit is its snapshot; a branch or tag, the commit its ref
    names; one the cache does not hold, offline, is refused naming it."""
    snapshot, _ = hub
    refs = snapshot.parent.parent / "refs"
    other = "fedcba9876543210fedcba9876543210fedcba98"
    (refs / "v1").write_text(other)
    shutil.copytree(snapshot, snapshot.parent / other, symlinks=True)
    assert hf.resolve(f"{REPO}@{COMMIT}") == snapshot
    assert hf.resolve(f"{REPO}@v1") == snapshot.parent / other
    hf.model_of(f"{REPO}@v1")
    with pytest.raises(ValueError, match=f"{REPO}@v2 is neither a folder nor a checkpoint"):
        hf.resolve(f"{REPO}@v2")


def test_a_folder_is_a_folder_and_what_is_no_repository_id_is_left_to_the_folder_checks(
    hub, tmp_path, monkeypatch
):
    _, folder = hub
    assert hf.resolve(folder) == folder
    # A folder of the id's name, here, is that folder rather than the Hub's repository.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dew-tests").mkdir()
    shutil.copytree(folder, tmp_path / REPO)
    assert hf.resolve(REPO) == Path(REPO) and (Path(REPO) / "config.json").is_file()
    with pytest.raises(ValueError, match="nowhere/at/all is not a folder"):
        hf.load("nowhere/at/all")


def test_a_repository_the_hub_cannot_give_is_refused_naming_it_and_the_hubs_error(hub, capsys):
    with pytest.raises(ValueError, match="dew-tests/absent is neither a folder nor a checkpoint"):
        hf.load("dew-tests/absent")
    from dew.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["train", "--model", "dew-tests/absent", "--steps", "1"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert (
        "--model dew-tests/absent: dew-tests/absent is neither a folder nor a checkpoint" in error
    )
    assert "LocalEntryNotFoundError" in error  # the Hub's own word: not cached, and offline


@pytest.mark.slow
def test_dew_train_trains_a_repository_id_and_its_run_exports(hub, tmp_path, capsys):
    from dew.cli import main

    run = tmp_path / "run"
    argv = ["train", "--model", REPO, "--run", str(run), "--steps", "1", "--batch-size", "2"]
    argv += ["--groups", "2", "--tasks", "4"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    # The run names the repository, and resumes and exports from it.
    assert json.loads((run / "config.json").read_text())["model"] == REPO
    assert main(["export", "--run", str(run), "--to", str(tmp_path / "exported")]) == 0
    written = tmp_path / "exported"
    assert (written / "tokenizer.json").read_bytes() == (hub[0] / "tokenizer.json").read_bytes()
    hf.load(written)


@pytest.mark.slow
def test_a_vllm_server_started_with_the_repository_id_serves_its_snapshot():
    """`dew train --model OWNER/NAME --engine-url URL` attaches to a server started as `vllm
    serve OWNER/NAME`: the snapshot folder's repository is the served model's name or root."""
    from dew.serve._vllm_checks import _served_name

    snapshot = Path("/cache/models--dew-tests--tiny-qwen2/snapshots") / COMMIT
    assert _served_name({REPO: {"root": REPO}}, snapshot) == REPO
    assert _served_name({"policy": {"root": REPO}}, snapshot) == "policy"
    assert _served_name({"other/model": {"root": "other/model"}}, snapshot) is None
    assert _served_name({REPO: {"root": REPO}}, Path("/models") / COMMIT) is None
