"""Failed sessions' errors counted by kind: shared by a source that warns of its own failures
(`dew.envs.verifiers`) and the scheduler that reports a run's (`dew.objectives.rl._shell`).

A foundation beside `_checks`, not a part of the scheduler's reports where it began: a source
must never import the scheduler's modules (sources do not know they are scheduled), and both
read only the `error` text a session carries.
"""

from __future__ import annotations

import collections
import re

# An exception's type as `describe` writes it (`Type: message`), at the start of an error text or
# of a cause it quotes (verifiers' "TaskError: task T scoring: ValueError: ...").
_TYPE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): ")
_TYPED = re.compile(r"([A-Za-z_][\w.]*): ")


def error_kind(error: str) -> str:
    """What repeats of one failure share: the exception types its text names, outermost first
    (`TaskError / ValueError`), or where it names none the type it starts with, else the whole
    text. A message that quotes a reply or an id differs on every rollout, and counted by its
    full text made a warning line per rollout."""
    types = _TYPE.findall(error)
    if types:
        return " / ".join(dict.fromkeys(types))
    typed = _TYPED.match(error)
    return typed.group(1) if typed else error


class ErrorCounts:
    """Failed sessions' errors of one source, grouped by kind (`error_kind`), and how often each
    came, each kind shown by the first full text that came with it; bounded: past `kept` kinds,
    the rarer half is forgotten."""

    def __init__(self, kept: int):
        self.kept = kept
        self._counts: collections.Counter[str] = collections.Counter()
        self._first: dict[str, str] = {}

    def add(self, error: str) -> int:
        """Count one more failure with this text; return how often its kind has come."""
        kind = error_kind(error)
        self._first.setdefault(kind, error)
        self._counts[kind] += 1
        count = self._counts[kind]
        if len(self._counts) > self.kept:
            self._counts = collections.Counter(dict(self._counts.most_common(self.kept // 2)))
            self._first = {kind: self._first[kind] for kind in self._counts}
        return count

    def most_common(self, shown: int) -> tuple[tuple[str, int], ...]:
        """The `shown` most frequent kinds, each as its first text, with their counts; safe
        from another thread."""
        # Copies first: another thread's status() must not iterate the live books.
        counts, first = collections.Counter(dict(self._counts)), dict(self._first)
        return tuple((first[kind], count) for kind, count in counts.most_common(shown))
