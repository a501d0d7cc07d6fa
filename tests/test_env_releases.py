"""The releases of verifiers and TextArena dew runs: an older one is refused in one line naming
it, a newer one named in one warning and used. Only the release a package reports is stood in
for (the real packages load); other releases cannot be installed beside these in a test."""

from __future__ import annotations

import logging

import pytest

from dew.cli import main
from dew.envs import _releases
from dew.envs.textarena import TextArena


@pytest.fixture
def release(monkeypatch):
    """Have `package` report `version` (the others report their own)."""

    def set_release(package: str, version: str) -> None:
        real = _releases.installed
        monkeypatch.setattr(
            _releases, "installed", lambda name: version if name == package else real(name)
        )
        monkeypatch.setattr(_releases, "_warned", set())

    return set_release


def test_the_installed_releases_are_the_ones_dew_runs(caplog):
    with caplog.at_level(logging.WARNING, logger="dew.envs"):
        for package in _releases.TESTED:
            _releases.check_release(package)
    assert caplog.records == []


@pytest.mark.parametrize(
    ("package", "spec"), [("verifiers", "verifiers:anything"), ("textarena", "textarena:Wordle-v0")]
)
def test_an_older_release_is_refused_in_one_line_before_the_run_folder(
    release, package, spec, tmp_path, capsys
):
    release(package, "0.3.2")
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--env", spec, "--run", str(run)])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    low, high = _releases.TESTED[package]
    wanted = f"{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    assert f"{package} 0.3.2 is installed; dew runs {package} {low[0]}.{low[1]}.x" in lines[0]
    assert f"pip install '{wanted}'" in lines[0], lines
    assert not run.exists()


def test_a_newer_release_is_named_once_and_used(release, caplog):
    release("textarena", "9.1.0")
    with caplog.at_level(logging.WARNING, logger="dew.envs"):
        for _ in range(3):
            assert TextArena.parse("TicTacToe-v0").name == "TicTacToe-v0"
    (record,) = caplog.records
    assert record.getMessage().startswith("textarena 9.1.0 is installed; dew is tested with")
