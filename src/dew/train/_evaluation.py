"""Held-out evaluation in a run: greedy and sampled (mean@k, pass@k) reward over the tasks the
training never draws, per-class accuracy where the tasks' answers are a few classes, and the
replies a person reads, the base model's beside the trained model's (`eval_samples.md`).

Why both greedy and mean@k: greedy shows what the policy's most likely reply earns, mean@k what
the policy the trainer samples from earns; pass@k, how many tasks it solves at all within k
tries (a task it never solves gives GRPO no reward to learn from). Why per class and distinct
correct answers: a policy that learned one constant answer scores the share of that class,
which a mean alone hides (a syllogism run answered "No" to everything and scored the share of
"No" items).
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

from dew import _gc
from dew.envs.environment import Sampling
from dew.models.hf import sharding
from dew.objectives.rl.sessions import Label, Status
from dew.serve import RolloutServer
from dew.serve._lora import serving
from dew.train._samples import sample_record

EVALUATIONS = "eval.jsonl"
EVAL_SAMPLES = "eval_samples.jsonl"
EVAL_SAMPLES_MD = "eval_samples.md"
CLASSES = 10
"""The most distinct answers of the held-out tasks that still count as classes (a yes/no task, a
digit): each gets its accuracy, `class/<answer>`."""
SHOWN = 8
"""Held-out tasks whose replies `eval_samples.jsonl` keeps at each evaluation."""
CORRECT = 1.0
"""The reward of a correct reply: reasoning-gym's and the copy task's score of an exact answer."""


def held_out_scores(
    greedy: Sequence[float],
    sampled: Sequence[Sequence[float]],
    answers: Sequence[str] | None,
) -> dict[str, Any]:
    """What an evaluation's rewards say, as the keys of its `eval.jsonl` line.

    Args:
        greedy: each held-out task's greedy reward, `[tasks]`.
        sampled: each task's sampled rewards, `[tasks, k]`; `k` may be 0.
        answers: each task's right answer, or None where the task has no single one.

    Returns:
        `greedy` (the mean greedy reward), and where k >= 1 `mean@k` (the mean sampled reward)
        and `pass@k` (the share of tasks with a sampled reply at reward `CORRECT`); with
        answers, `distinct_correct` (how many distinct answers the greedy replies got right, at
        reward `CORRECT`) and, where the tasks' answers are at most `CLASSES` classes,
        `majority` (the most common answer's share: what one constant answer scores) and
        `class/<answer>` (the greedy reward over that answer's tasks).
    """
    scores: dict[str, Any] = {"greedy": math.fsum(greedy) / len(greedy)}
    k = len(sampled[0]) if len(sampled) else 0
    if k:
        rewards = np.asarray(sampled, dtype=np.float64)
        scores[f"mean@{k}"] = float(rewards.mean())
        scores[f"pass@{k}"] = float((rewards >= CORRECT).any(axis=1).mean())
    if answers is None:
        return scores
    correct = {answer for answer, r in zip(answers, greedy, strict=True) if r >= CORRECT}
    scores["distinct_correct"] = len(correct)
    counts = collections.Counter(answers)
    if len(counts) <= CLASSES:
        scores["majority"] = max(counts.values()) / len(answers)
        for answer in sorted(counts):
            rewards = [r for a, r in zip(answers, greedy, strict=True) if a == answer]
            scores[f"class/{answer}"] = math.fsum(rewards) / len(rewards)
    return scores


class Evaluation:
    """Greedy and sampled rollouts of the held-out tasks (`ids`), on an engine of their own, in a
    trio run of their own on the trainer's thread.

    The engine has the training engine's model and slots, so its steps reuse the compiled
    functions. It is built for each evaluation on the weights evaluated, which it serves as
    they are (no copy: nothing updates them while it runs), and dropped after it, so that the
    run never holds another copy of the weights for it, and through the updates between
    evaluations no second cache (SmolLM2-135M's float32 params are 0.5 GiB). The sampled
    rollouts draw at the run's temperature with keys seeded by `seed` and the evaluation's
    updates: the same in a replayed run, fresh at each evaluation.

    Args:
        task: the run's task (`dew.train._tasks._RunTask`).
        ids: the held-out task ids.
        server: the training engine, whose model, length and tokenizer the evaluation's takes.
        slots: the engine's slots.
        samples: sampled replies per task for mean@k and pass@k; 0 for greedy only.
        temperature: their sampling temperature.
        seed: seeds their keys.
    """

    def __init__(
        self,
        task,
        ids: np.ndarray,
        server: RolloutServer,
        slots: int,
        *,
        samples: int,
        temperature: float,
        seed: int,
    ):
        self.tasks = list(task.tasks({"task_id": np.asarray(ids, dtype=np.int64)}))
        self.task = task
        self.samples = samples
        self.temperature = temperature
        self.seed = seed
        self.model = server.model
        self.slots = slots
        self.max_len = server.max_len
        self.tokenizer = server.tokenizer

    def __call__(self, variables, updates: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Roll out every held-out task greedily, and `samples` times sampled, under
        `variables`.

        Returns:
            The `eval.jsonl` line: `updates`, `held_out_scores`' keys, `status/completed` (the
            share of greedy replies that ended with a stop token) and each task's greedy reward
            in `rewards` (a rollout without a reward counts 0); and the first `SHOWN` tasks'
            greedy replies (`sample_record`'s, with `updates` and the task's `answer`).
        """
        # The engine's weights and cache go before the trainer's next update. Its trio runs leave
        # it in reference cycles (the tracebacks of its cancelled loop hold its frames), which
        # only the cyclic collector frees: as the block ends (`_gc.collected`), not whenever the
        # collector next runs (a SmolLM2 run held the engine's 0.58 GiB through the next update).
        with _gc.collected():
            server = serving(self.model)(
                self.model,
                sharding.local_view(variables),
                slots=self.slots,
                max_len=self.max_len,
                version=updates,
                tokenizer=self.tokenizer,
                # The trainer's own arrays, not a copy of them: it runs this between its updates,
                # on its thread, and nothing changes them until the server is gone (below).
                copy=False,
            )
            greedy = trio.run(self._rollouts, server, Sampling(temperature=0.0), 1)
            greedy = [row[0] for row in greedy]
            sampled: list[list] = [[] for _ in self.tasks]
            if self.samples:
                seed = int(np.random.SeedSequence([self.seed, updates]).generate_state(1)[0])
                sampling = Sampling(self.temperature, seed=seed)
                sampled = trio.run(self._rollouts, server, sampling, self.samples)
            del server
        rewards = [_reward(session) for session in greedy]
        answers = None
        if self.task.answer is not None:
            answers = [self.task.answer(task) for task in self.tasks]
        scores = held_out_scores(rewards, [[_reward(s) for s in row] for row in sampled], answers)
        completed = [s.status is Status.COMPLETED for s in greedy]
        line = {
            "updates": updates,
            **scores,
            "status/completed": sum(completed) / len(completed),
            "rewards": rewards,
        }
        shown = []
        for index, (task, session) in enumerate(zip(self.tasks[:SHOWN], greedy, strict=False)):
            record = sample_record(self.tokenizer, task, Label(index, 0, 0), session)
            answer = None if answers is None else answers[index]
            shown.append({"updates": updates, "answer": answer, **record})
        return line, shown

    async def _rollouts(
        self, server: RolloutServer, sampling: Sampling, samples: int
    ) -> list[list]:
        """`samples` rollouts of each task on `server` under `sampling`, `[tasks, samples]`."""
        sessions: list[list] = [[None] * samples for _ in self.tasks]
        # Served afresh in each trio run (a served source serves one run, its server once).
        source = self.task.serve(self.task.source(server, sampling), server)

        async def one(index: int, sample: int) -> None:
            label = Label(group=index, sample=sample, attempt=0)
            sessions[index][sample] = await source.run(self.tasks[index], label)

        async with trio.open_nursery() as nursery:
            for index in range(len(self.tasks)):
                for sample in range(samples):
                    nursery.start_soon(one, index, sample)
        return sessions


def _reward(session) -> float:
    return 0.0 if session.reward is None else float(session.reward)


def write_eval_samples(jsonl: Path, markdown: Path) -> None:
    """Render `eval_samples.jsonl` as Markdown a person reads: for each evaluation, each shown
    held-out task's prompt and answer, the base model's reply (the evaluation before the first
    update) beside the reply at that evaluation, each with its reward."""
    records = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines()]
    by_updates: dict[int, list[dict]] = {}
    for record in records:
        by_updates.setdefault(record["updates"], []).append(record)
    base = {record["task"]: record for record in by_updates.get(0, [])}
    text = ["# Held-out replies: the base model's beside the trained model's", ""]
    for updates, shown in sorted(by_updates.items()):
        text += [f"## After {updates} updates", ""]
        text += ["| task | prompt | answer | base reply | reply now |", "|---|---|---|---|---|"]
        for record in shown:
            before = base.get(record["task"])
            cells = [
                record["task"],
                _last_turn(record["prompt"]),
                "" if record["answer"] is None else str(record["answer"]),
                "(none)" if before is None else _reply(before),
                _reply(record),
            ]
            text.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        text.append("")
    markdown.write_text("\n".join(text), encoding="utf-8")


def _reply(record: Mapping[str, Any]) -> str:
    return f"{record['completion']} ({_reward_text(record['reward'])})"


def _reward_text(reward: float | None) -> str:
    return "no reward" if reward is None else f"{reward:.2f}"


def _last_turn(prompt: str) -> str:
    """The prompt's last user message, the part that differs between tasks (the chat
    template's markup around it is the same each time)."""
    start = prompt.rfind("user\n")
    text = prompt[start + len("user\n") :] if start >= 0 else prompt
    return text.split("<|im_end|>")[0]


def _cell(text: str) -> str:
    """`text` in one Markdown table cell: its pipes escaped, its lines joined."""
    return text.replace("|", "\\|").replace("\n", "<br>")
