"""Traces: record a scheduler run, replay it bit for bit, and find where two runs part.

A trace is JSON lines, no pickle. Its first line is a header, `{"format": "dew-trace",
"version": 4, "facade": ..., "config": {...}, "start": ...}`, holding every RolloutScheduler
argument but the objective, source, weights, tasks and log, and which facade the trainer called:
`async` (`await step` inside the caller's trio run) or `thread` (`scheduler(batch, ...)` from the
trainer's thread). Each later line has a `kind`:

- `stream`: the trainer opened the `tasks()` stream (`stream` id, `time`, and `running`: whether
  the scheduler's trio side ran then, so that the open logged a `reopened` event); for a run
  resumed under carry-over, the carried groups the scheduler took back from a checkpoint
  (`restore_state`) and submits again at the stream's first call: `restored` (how many) and
  `restored_state` (`carried` as [stream position, index in its batch] and `stale` cycles, as
  `checkpoint_state` writes them, and the `tasks` the scheduler read for them), which replay
  gives its scheduler as the stream opens (added within version 4: a trace with the count alone
  is refused by `replay`, which cannot make the groups again);
- `batch`: a task batch the scheduler took (`batch` index, the `stream` that yielded it or null
  for a batch handed over without one, its `tasks` as name and, where JSON holds it, payload);
- `session`: one rollout the source ran: its `task`, `label` [group, sample, attempt],
  `submitted` and `ended` on the scheduler's clock (for a returned session, the times the
  scheduler stamped on it), and its `outcome`: `returned` (with the `session`: status, calls
  with their arrays and, for a call of a seat, its `seat`, reward, components, truncation,
  error, and, for an episode of several agents, `seats`; absent, either is None), `cancelled`
  (its run got trio.Cancelled at `ended`), `raised` (the source raised `error`) or `invalid`
  (it returned what the scheduler refuses, or no trace holds: `error` is the refusal, as the
  failed trainer call says it, which replay raises alike); and, where its engine said when its
  first call started (`note_progress(version=...)`), `first_call` [time, version], which replay
  says alike at that time, since the scheduler counts a running rollout's lag from it (added
  within version 4: a trace without it replays as recorded, its rollouts counted from their
  submission as they were); and, under `align_starts`, `started`: when the scheduler let the
  rollout start, which replay runs it from (added within version 4);
- `push`: a weight push (`version`, `time` it ended, and `began`: when it began, added within
  version 4; a thread trace without it replays each push at its call's hand-over);
- `call`: one trainer call: its `step`, `batch`, `updates`, the `stream` and how many batches it
  had yielded (`read`), `handed_over` and `returned` times, and either the SchedulerRecord
  (`record`, metrics included), the event log (`events`) and the digests of the packed batch's
  arrays it returned (`arrays`, one per key) — or what it `raised`, with the event log up to its
  failure;
- `end`: the time the scheduler was closed and its `closing_events` (the event log after the
  last call's, through the close); the last line.

Arrays are stored losslessly: `{"dtype", "shape", "data"}` with the raw bytes in base64.

A trace is flushed line by line. A path ending in `.gz` is written gzip-compressed, each line
flushed as a whole gzip block; readers tell the two forms by their first bytes (GZIP_MAGIC). A
killed run's trace (no end line, maybe a last line cut partway, or a gzip stream that ends
early) is read with `read_trace(path, partial=True)`, which `replay` uses: `Trace.cut` says where
it ends, its replay stops after its last call, and a rollout the trace never saw end runs until
cancelled. A line over MAX_LINE bytes is refused, as is JSON nested too deep to parse, text that
is not UTF-8, a header of another format version or a file cut within it, a line of no kind
in KINDS, lines that contradict the run (a call reading a stream no line opened, or more batches
than it yielded; a restored state short of a task or count), and (by `replay`) a header whose
configuration no scheduler takes: each a TraceError naming the file and the line.

A `thread` trace is written from two threads, the trainer's (streams, batches, calls) and the
scheduler's (sessions, pushes), one whole line at a time. The trainer's thread cannot read the
scheduler's trio clock, so the scheduler's event log tells the times: a call's `handed_over` is
its `handed_over` event's time and `returned` its last event's (the delivery); a stream opened
while the scheduler ran has `time` null in its line and takes the time of its `reopened` event
(the k-th such stream, the k-th `reopened` event of the calls' logs); the header's `start` and
the end line's `time` are null, read as the first and last times the trace holds. A call that
raised has null times. The scheduler then runs on the real clock; its readings that no event
carries are recorded but not compared: each record's `waited` (the trainer thread's seconds)
and each push's end (versions are compared); nor is what happened after the last call returned
(the close is off the trainer's clock). A rollout's latency and deadline count from its
submission event's time, so they replay exactly. A call whose push the scheduler awaited
(`load_async`, vLLM's) reached the scheduler when that push began, and its hand-over came when
the push ended: replay makes the call at the push's recorded start and lets the push last until
the recorded hand-over, so a rollout that ended under the new version during the push (the
scheduler knows a version from its push's start) is taken as it was.

Replay runs the recorded configuration (with any overrides) against `ReplaySource`, which plays
each recorded rollout back by (task name, label) with its recorded duration and outcome, under
trio's MockClock: the trainer's calls are made at their recorded hand-over times and every
record, event and packed array is compared. The proximal log-probs are not replayed: they are the
trainer's weights' rescoring, and a trace holds no weights. Replay uses `NoRescoring` (zeros) and
compares every packed array but `proximal_logprobs`, whose recorded digest is left for
comparing two recordings. Every field a trace holds is read: version 3 traces also held a
whole-batch `digest`, which no replay could check (it covers the proximal log-probs); version 4
drops it, and reads version 3 traces without it (`READ_VERSIONS`).

`replay(path, **overrides)` runs a replay in a trio run of its own (`replay_async` from inside
another, through a worker thread), and `dew replay TRACE [--max-lag N ...]` from the command
line (with a progress line on standard error every few seconds); each says the replay matched
(steps, groups, events) or gives its first divergence: step, group, sample, event, field,
recorded and replayed values, and its time as seconds into the run.

Time lands exactly: trio's MockClock moves by differences, which can round a jump one ulp past
its target, so `ReplaySource` keeps the clock itself and lands it on the recorded times (session
ends, cancellations, hand-overs). A trace recorded under the mock clock replays bit for bit, and
so does the event log of one recorded on the real clock, whose event times are the scheduler's
own readings.

The package's modules: `_format` (constants, errors, JSON encoding), `_trace` (the records and
`read_trace`), `_record` (`Recorder` and the wrappers that feed it), `_replay_source`
(`ReplaySource`, its clock keeping), `_replay` (`replay`), `_divergence` (comparing the two
runs), `_cli` (`dew replay`).
"""

from dew.replay._cli import configure_cli, run_cli
from dew.replay._divergence import Divergence, ReplayedCall, ReplayNote, ReplayResult
from dew.replay._format import (
    CONFIG,
    FACADES,
    FORMAT,
    GZIP_MAGIC,
    KINDS,
    MAX_LINE,
    OUTCOMES,
    PROXIMAL,
    READ_VERSIONS,
    RESCORED,
    UNCOMPARED,
    VERSION,
    RecordedSourceError,
    TraceError,
)
from dew.replay._record import Recorder, RecordingPublisher, RecordingSource
from dew.replay._recorded import RecordedCall, RecordedSession, RecordedStream, Trace
from dew.replay._replay import replay, replay_async
from dew.replay._replay_source import NoRescoring, ReplayPublisher, ReplaySource, ReplayStalled
from dew.replay._trace import read_trace

__all__ = [
    "CONFIG",
    "FACADES",
    "FORMAT",
    "GZIP_MAGIC",
    "KINDS",
    "MAX_LINE",
    "OUTCOMES",
    "PROXIMAL",
    "READ_VERSIONS",
    "RESCORED",
    "UNCOMPARED",
    "VERSION",
    "Divergence",
    "NoRescoring",
    "RecordedCall",
    "RecordedSession",
    "RecordedSourceError",
    "RecordedStream",
    "Recorder",
    "RecordingPublisher",
    "RecordingSource",
    "ReplayNote",
    "ReplayPublisher",
    "ReplayResult",
    "ReplaySource",
    "ReplayStalled",
    "ReplayedCall",
    "Trace",
    "TraceError",
    "configure_cli",
    "read_trace",
    "replay",
    "replay_async",
    "run_cli",
]
