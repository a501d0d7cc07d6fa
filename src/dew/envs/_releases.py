"""The releases of the environment packages dew runs, and one line when another is installed.

dew drives verifiers through its `verifiers.v1` API (tasksets, `Env.run_episode`, the agent
configs), which verifiers 0.4 introduced, and TextArena through its game registry and
observation types as 0.7 has them. A release older than those lacks what dew calls, so it is
refused naming the release and the install command; a newer one has not been tried, so it is
named in one warning and used.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re

TESTED = {"verifiers": ((0, 4), (0, 5)), "textarena": ((0, 7), (0, 8))}
"""Per package, the first release dew runs and the first it has not been tried with."""

_log = logging.getLogger("dew.envs")
_warned: set[str] = set()


def installed(package: str) -> str:
    """The installed release of `package`, as its metadata says."""
    return importlib.metadata.version(package)


def check_release(package: str) -> None:
    """Refuse a release of `package` older than dew runs; warn once of one newer than tried.

    Raises:
        ImportError: naming the installed release, the ones dew runs, and the pip command.
    """
    version = installed(package)
    (low, high) = TESTED[package]
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    wanted = f"{package}>={_dotted(low)},<{_dotted(high)}"
    if release < low:
        raise ImportError(
            f"{package} {version} is installed; dew runs {package} {_dotted(low)}.x "
            f"(pip install '{wanted}')"
        )
    if release >= high and package not in _warned:
        _warned.add(package)
        _log.warning(
            "%s %s is installed; dew is tested with %s %s.x (pip install '%s' if it fails)",
            package,
            version,
            package,
            _dotted(low),
            wanted,
        )


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))
