"""What the policy says: a few finished rollouts per step, decoded, for `samples.jsonl`."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dew._checks import check_int
from dew.data import Task
from dew.objectives.rl.sessions import Label, Session, SessionSource
from dew.serve.tokenizer import Tokenizer


def sample_record(tokenizer: Tokenizer, task: Task, label: Label, session: Session) -> dict:
    """One finished rollout as a JSON-ready record.

    Args:
        tokenizer: decodes the token ids.
        task, label, session: the rollout.

    Returns:
        `task`, `group`, `sample`, `attempt`, `prompt` (the first call's prompt),
        `completion` (everything the rollout added after it: replies and, for an episode, the
        environment's turns; special tokens by name), `reward`, `status`, `truncation` and
        `error`.
    """
    prompt, completion = "", ""
    if session.calls:
        first, last = session.calls[0], session.calls[-1]
        chain = np.concatenate([np.asarray(last.prompt), np.asarray(last.completion)])
        prompt = tokenizer.decode(np.asarray(first.prompt))
        completion = tokenizer.decode(chain[len(first.prompt) :])
    return {
        "task": task.name,
        "group": label.group,
        "sample": label.sample,
        "attempt": label.attempt,
        "prompt": prompt,
        "completion": completion,
        "reward": session.reward,
        "status": session.status.value,
        "truncation": session.truncation,
        "error": session.error,
    }


class SampleLog:
    """A session source that passes every rollout through and keeps a few per task batch,
    decoded (`sample_record`), for a per-step log of what the policy says.

    The scheduler numbers groups in the order it registers task batches, `batch_size` to a
    batch, so a rollout's batch (counted from the stream this scheduler opened) is its group
    id // `batch_size`. One rollout of each group is kept, up to `keep` groups a batch: drawn
    uniformly among the group's finished rollouts, each given a key seeded by `seed`, its group
    and its sample, the smallest key kept (the first to finish over-showed short episodes: a
    log of mostly quick wins while the step's mean reward was low). The draw does not depend on
    the order rollouts finish in, so a replayed run keeps the same ones. Rollouts run in the
    scheduler's trio thread and `take` is called from the trainer's, so the kept records sit
    behind a lock.

    Args:
        source: the session source that runs the rollouts.
        tokenizer: decodes their token ids.
        batch_size: tasks (groups) per task batch.
        keep: rollouts kept per batch.
        seed: seeds each rollout's key (the run's seed).

    Raises:
        ValueError: naming `batch_size` or `keep` when it is not an int >= 1.
    """

    def __init__(
        self,
        source: SessionSource,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        keep: int = 4,
        seed: int = 0,
    ):
        self.source = source
        self.tokenizer = tokenizer
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.keep = check_int("keep", keep, low=1)
        self.seed = check_int("seed", seed, low=0)
        # batch -> group -> (the kept rollout's key, its record)
        self._kept: dict[int, dict[int, tuple[float, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    async def run(self, task: Task, label: Label) -> Session:
        """Run the rollout with `source`, keeping its record where its key is its group's
        smallest so far (a later attempt of the same sample replacing the earlier), among the
        first `keep` groups of its batch to finish a rollout."""
        session = await self.source.run(task, label)
        key = float(np.random.default_rng([self.seed, label.group, label.sample]).random())
        with self._lock:
            kept = self._kept.setdefault(label.group // self.batch_size, {})
            held = kept.get(label.group)
            if held is None and len(kept) >= self.keep:
                return session
            if held is None or key <= held[0]:
                kept[label.group] = (key, sample_record(self.tokenizer, task, label, session))
        return session

    def take(self, batch: int) -> list[dict[str, Any]]:
        """The records kept of task batch `batch` (counted from 0), by group; what is kept of
        it and of earlier batches is dropped."""
        with self._lock:
            kept = self._kept.pop(batch, {})
            for earlier in [index for index in self._kept if index < batch]:
                del self._kept[earlier]
        return [kept[group][1] for group in sorted(kept)]
