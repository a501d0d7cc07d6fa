"""vLLM as dew's engine, on real vLLM servers (its CPU build) serving a tiny Qwen2 checkpoint.

One engine of two servers is shared by the whole module (a server takes minutes to start on a
loaded CI machine); tests that push weights push what they need first. The test that kills a
server runs last. References are `transformers`' float32 forward pass of the same checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
import trio

from _checkpoint import tiny_qwen2
from _process_groups import left_running, slow_motion
from dew import replay
from dew._torch_media import hide_broken_media_packages
from dew.data import ArrayDataset, Task
from dew.envs import HarnessSource, Score
from dew.envs.prompts import PromptSource
from dew.gateway import Gateway, ServedGateway
from dew.models import hf
from dew.objectives.rl._session import track_progress
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Label, Status
from dew.serve import CallFailed, _vllm, _vllm_fork, _vllm_process, _vllm_start, tokenizer
from dew.serve._vllm_process import free_port
from dew.serve.vllm import VLLMEngine, VLLMError

hide_broken_media_packages()
import torch  # noqa: E402
import transformers  # noqa: E402

# httpcore sends a request's body from a one-chunk async generator: a call cancelled while it
# sends (the scheduler cancels the rollouts in flight when a run stops) leaves that generator
# suspended, and trio's finalizer warns when it is collected. httpx's leak, not the engine's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
)

MAX_LEN = 128
PROMPT = np.array([0, 1, 17, 42, 99, 7], np.int32)
LABEL = Label(0, 0, 0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return tiny_qwen2(root / "first", seed=0), tiny_qwen2(root / "second", seed=1)


@pytest.fixture(scope="module")
def params(folders):
    """Each checkpoint's params as dew loads them, to push."""
    return [hf.load(folder)[1] for folder in folders]


@pytest.fixture(scope="module")
def references(folders):
    return [
        transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for folder in folders
    ]


@pytest.fixture(scope="module")
def engine(folders, tmp_path_factory):
    with VLLMEngine.start(
        folders[0],
        servers=2,
        max_model_len=MAX_LEN,
        work_dir=tmp_path_factory.mktemp("engine"),
    ) as engine:
        yield engine


def reference_logprobs(model, call, *, temperature=1.0, top_k=None) -> np.ndarray:
    """Each completion token's log-prob under `model`, after temperature and top-k, as the
    behaviour policy drew it."""
    ids = torch.from_numpy(np.concatenate([call.prompt, call.completion])[None].astype(np.int64))
    with torch.no_grad():
        logits = model(ids).logits[0, len(call.prompt) - 1 : -1] / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = torch.where(logits < kth, -math.inf, logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(call.completion)), torch.tensor(call.completion)].numpy()


@pytest.mark.slow
async def test_generate_takes_ids_and_answers_ids_with_behaviour_logprobs(
    engine, params, references
):
    engine.load(params[0], 0)
    async with engine:
        call = await engine.generate(PROMPT, max_tokens=12, key=3)
        again = await engine.generate(PROMPT, max_tokens=12, key=3)
        filtered = await engine.generate(PROMPT, max_tokens=8, temperature=0.5, top_k=5, key=4)
    np.testing.assert_array_equal(call.prompt, PROMPT)
    assert call.completion.dtype == np.int32 and len(call.completion) == 12
    assert call.version == 0 and call.logprobs.dtype == np.float32
    np.testing.assert_allclose(call.logprobs, reference_logprobs(references[0], call), atol=2e-4)
    np.testing.assert_array_equal(again.completion, call.completion)
    # The log-prob of the distribution the token was drawn from, not the raw one.
    want = reference_logprobs(references[0], filtered, temperature=0.5, top_k=5)
    np.testing.assert_allclose(filtered.logprobs, want, atol=2e-4)


@pytest.mark.slow
async def test_a_stop_token_ends_the_completion_and_stays_in_it(engine, params, references):
    engine.load(params[0], 0)
    async with engine:
        call = await engine.generate(PROMPT, max_tokens=12, key=3)
        stop = int(call.completion[3])
        first = int(np.flatnonzero(call.completion == stop)[0])
        stopped = await engine.generate(PROMPT, max_tokens=12, key=3, stop=[stop])
        # A prompt near max_len: the completion ends at max_len.
        long = np.resize(PROMPT, MAX_LEN - 3)
        clipped = await engine.generate(long, max_tokens=12, key=3)
    np.testing.assert_array_equal(stopped.completion, call.completion[: first + 1])
    assert len(clipped.completion) == 3


@pytest.mark.slow
async def test_bad_calls_are_refused_naming_the_argument(engine):
    async with engine:
        with pytest.raises(ValueError, match="prompt must hold 1 to max_len - 1 = 127"):
            await engine.generate(np.zeros(MAX_LEN, np.int32), max_tokens=1)
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate(PROMPT, max_tokens=1, top_p=0)
        with pytest.raises(VLLMError, match=f"{engine.urls[0]}|{engine.urls[1]}"):
            await engine.generate(np.array([100_000]), max_tokens=1)
    with pytest.raises(RuntimeError, match="async with"):
        await engine.generate(PROMPT, max_tokens=1)


@pytest.mark.slow
def test_servers_started_with_dews_flags_alone_are_not_asked_their_configuration(
    engine, caplog, monkeypatch
):
    """They run as dew's flags say: `/server_info`, whose first answer took each server 4-8 s
    of a loaded machine at every start, about 2.5 of its CPU-seconds (vLLM collects the
    machine's environment on it, `pip list` included), is not asked, and the dtype dew gave
    them is still checked against the model's. Runs before the tests that attach to these
    servers, which ask it."""
    logs = [process.log.read_text() for process in engine.processes]
    assert all('"GET /is_paused' in log for log in logs)  # each request is in its log
    assert not any('"GET /server_info' in log for log in logs)
    monkeypatch.setattr(engine, "_model", types.SimpleNamespace(dtype="bfloat16"))
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        engine._check_serving(engine._servers[0])
    named = [r.getMessage() for r in caplog.records if "computes in" in r.getMessage()]
    assert len(named) == 1 and "computes in float32, the run's model in bfloat16" in named[0]
    assert '"GET /server_info' not in engine.processes[0].log.read_text()


@pytest.mark.slow
async def test_a_push_changes_what_is_served_and_the_version(engine, params, references):
    engine.load(params[1], 7)
    assert engine.version == 7
    async with engine:
        calls = [await engine.generate(PROMPT, max_tokens=10, key=k) for k in range(4)]
    for call in calls:
        assert call.version == 7
        np.testing.assert_allclose(
            call.logprobs, reference_logprobs(references[1], call), atol=2e-4
        )


async def wait_held(url: str, ended) -> None:
    """Waits until the server at `url` holds a call (running or waiting), from its Prometheus
    metrics. Fails, rather than hangs, when `ended()` says the calls ended first."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    async with httpx.AsyncClient() as client:
        with trio.fail_after(120):
            while True:
                text = (await client.get(f"{url}/metrics")).text
                lines = [line for line in text.splitlines() if line.startswith(names)]
                if sum(float(line.rsplit(" ", 1)[1]) for line in lines) >= 1:
                    return
                assert not ended(), "the calls ended before the server was seen holding one"
                await trio.sleep(0.05)


@pytest.mark.slow
async def test_a_push_while_calls_run_keeps_them_running_under_their_version(
    engine, params, references
):
    engine.load(params[0], 10)
    results, progress = {}, {}
    groups = [process.pid for process in engine.processes]
    async with engine:

        async def one(index):
            progress[index] = track_progress()
            results[index] = await engine.generate(PROMPT, max_tokens=100, key=index)

        async with trio.open_nursery() as nursery:
            # In slow motion until the calls are paused, so that no call can run to its end
            # between the client's read of its first token and the pause (as each did under a
            # loaded machine when the servers ran freely: no call straddled the push).
            with slow_motion(groups):
                for index in range(4):
                    nursery.start_soon(one, index)
                with trio.fail_after(120):  # until each call has drawn a token under version 10
                    while len(progress) < 4 or min(p.length()[0] for p in progress.values()) < 1:
                        await trio.sleep(0.01)
                # They freeze there; the push pauses them again, and resumes them.
                await trio.to_thread.run_sync(engine.pause)
            drawn = [progress[index].length()[0] for index in range(4)]
            await engine.load_async(params[1], 11)
            after = await engine.generate(PROMPT, max_tokens=10, key=9)
    print(f"tokens drawn when the calls were paused: {drawn}")
    assert [len(results[index].completion) for index in range(4)] == [100] * 4
    assert {results[index].version for index in range(4)} == {10}
    assert after.version == 11
    np.testing.assert_allclose(after.logprobs, reference_logprobs(references[1], after), atol=2e-4)
    # A call drew its first tokens under the old weights and the rest under the new: its
    # log-probs are the old weights' up to some token, the new ones' from there on. (One that
    # raced ahead of the others may have ended before the pause; in slow motion not all can.)
    straddled = 0
    for call in results.values():
        old, new = (reference_logprobs(model, call) for model in references)
        changed = np.flatnonzero(~np.isclose(call.logprobs, old, atol=2e-4))
        if len(changed):
            assert changed[0] >= 1
            np.testing.assert_allclose(call.logprobs[changed[0] :], new[changed[0] :], atol=2e-4)
            straddled += 1
    assert straddled >= 1


@pytest.mark.slow
async def test_a_cancelled_call_says_how_many_tokens_it_drew(engine, params):
    """As dew's engine does: a call counts toward its rollout's progress (what the scheduler
    reads of a rollout it cancels) as its tokens stream in."""
    engine.load(params[0], 12)
    budget = MAX_LEN - len(PROMPT)

    async def cancelled_call() -> int:
        """Start a call, pause the servers once its first token is in, cancel it; the tokens
        its rollout's progress counts."""
        progress = None

        async def rollout():
            nonlocal progress
            progress = track_progress()  # as the scheduler gives each rollout's task
            await engine.generate(PROMPT, max_tokens=budget, key=5)

        groups = [process.pid for process in engine.processes]
        async with engine, trio.open_nursery() as nursery:
            # In slow motion until its first token is in: the tiny model draws its whole
            # budget in a few hundred ms, and a client slowed by a loaded machine read it all
            # in its first read when the servers ran freely (a clean-clone CI run saw 122 of
            # 122 tokens before a pause, five calls running).
            with slow_motion(groups):
                nursery.start_soon(rollout)
                with trio.fail_after(120):
                    while progress is None or progress.length()[0] < 1:
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        tokens, calls = progress.length()
        assert calls == 1 and tokens >= 1
        assert progress.sampling is None  # no call samples for it any more
        # The version the call started under, said as it started (issue 46 item 4): the
        # scheduler counts the running rollout's lag from it, not from its submission.
        assert progress.oldest is not None and progress.oldest[1] == 12
        return tokens

    # Should a slice still let a call draw its whole budget, it is tried again: one of a few
    # must stop part-way.
    drawn = []
    while len(drawn) < 5 and (not drawn or drawn[-1] == budget):
        drawn.append(await cancelled_call())
    assert 1 <= drawn[-1] < budget, f"each call drew its whole budget before the pause: {drawn}"


def engine_mismatch(batch) -> float:
    """The k3 estimate of KL(behaviour || proximal) over the trained tokens: the step's
    `mismatch/engine` at lag 0."""
    trained = batch["loss_mask"] > 0
    log_rho = batch["proximal_logprobs"][trained].astype(np.float64) - batch["behavior_logprobs"][
        trained
    ].astype(np.float64)
    return float(np.mean(np.expm1(log_rho) - log_rho))


@pytest.mark.slow
async def test_each_push_lands_the_engine_agreeing_with_dews_rescoring_at_lag_0(
    engine, folders, params
):
    model = hf.load(folders[0])[0]
    chat = tokenizer.HuggingFaceTokenizer.from_file(folders[0] / "tokenizer.json")
    source = PromptSource(
        engine,
        lambda task: f"count to {task.name}",
        lambda task, reply: Score(len(reply) / 50),
        max_tokens=24,
        tokenizer=chat,
    )
    scheduler = RolloutScheduler(
        GRPOObjective(model),
        source,
        engine,
        width=64,
        rows=4,
        groups=2,
        ahead=0,
        sync_every=1,
        truncation="score",
    )
    dataset = scheduler.tasks(ArrayDataset({"task_id": np.arange(10)}, batch_size=2))
    mismatches = []
    async with engine, scheduler:
        batches = iter(dataset.stream())
        for updates in range(5):
            # Each step trains other weights than the last: a push that did not land would
            # leave the engine sampling under the previous ones.
            batch = await scheduler.step(next(batches), params[updates % 2], updates)
            assert engine.version == updates
            trained = batch["loss_mask"] > 0
            assert trained.sum() > 0 and set(batch["versions"][trained].tolist()) == {updates}
            mismatches.append(engine_mismatch(batch))
    assert max(mismatches) <= 1e-6, mismatches
    # The same tokens rescored under the other weights are far off: the check can fail.
    other = GRPOObjective(model).packed_log_probs(params[1], batch)
    stale = dict(batch, proximal_logprobs=np.asarray(other))
    assert engine_mismatch(stale) > 1e-3


@pytest.mark.slow
def test_a_push_runs_beside_the_rollouts_and_the_gateway_in_the_schedulers_run(
    engine, folders, params, tmp_path
):
    """The scheduler's thread facade, as `dew train` drives it, over a harness behind the
    gateway: while the second push writes its folder, the push waits for the agents to make
    gateway round trips in the scheduler's trio run, which a push that held the run would never
    see; while the servers are paused, the agents see them paused."""
    model = hf.load(folders[0])[0]
    chat = tokenizer.HuggingFaceTokenizer.from_folder(folders[0])
    writing = threading.Event()  # set while the second push writes its folder
    trips, paused = [], []

    def save(folder, variables):
        if folder.name == "push-1":
            writing.set()
            deadline = time.monotonic() + 120
            while len(trips) < 3:  # three gateway round trips, made while this thread waits
                assert time.monotonic() < deadline, "nothing ran in the trio run during the push"
                time.sleep(0.01)
            writing.clear()
        hf.save(folder, model, variables, tokenizer_from=folders[0])

    pusher = VLLMEngine.attach(
        engine.urls, checkpoint=folders[0], model=model, push_dir=tmp_path, save=save
    )

    async def agent(base_url: str, api_key: str, task: Task) -> str:
        async with (
            openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api,
            httpx.AsyncClient() as vllm,
        ):
            if task.name == "1":  # batch 1 runs while the trainer pushes version 1
                while not writing.is_set() and pusher.version < 1:
                    await trio.sleep(0.01)
                while pusher.version < 1:
                    await api.models.list()
                    trips.append(pusher.version)
                    answers = [await vllm.get(f"{url}/is_paused") for url in pusher.urls]
                    paused.append(any(answer.json()["is_paused"] for answer in answers))
            messages = [{"role": "user", "content": "hello"}]
            answer = await api.chat.completions.create(model="m", messages=messages)
            return answer.choices[0].message.content

    source = ServedGateway(
        pusher,
        lambda gateway: HarnessSource(gateway, agent, lambda result: Score(1.0)),
        {"max_context": MAX_LEN, "max_tokens": 8, "tokenizer": chat, "announce": False},
    )
    scheduler = RolloutScheduler(
        GRPOObjective(model), source, pusher, width=MAX_LEN, rows=2, groups=2, truncation="score"
    )
    stream = iter(scheduler.tasks(ArrayDataset({"task_id": np.arange(4)}, batch_size=1)).stream())
    try:
        with scheduler:
            read = [next(stream), next(stream)]
            for updates in range(2):
                scheduler(read.pop(0), params[updates], updates)
                read.append(next(stream))
                record = scheduler.last_record
                assert (record.groups, record.version) == (1, updates)
    finally:
        pusher.close()
    assert len(trips) >= 3 and trips[0] == 0
    assert any(paused), "the agents never saw a server paused during the push"
    assert pusher.version == 1 and len(pusher.push_seconds) == 2


@pytest.mark.slow
def test_attaching_checks_the_model_and_the_server(engine, folders, tmp_path):
    with pytest.raises(VLLMError, match=f"{engine.urls[0]} serves \\['first'\\], not the run's"):
        VLLMEngine.attach(engine.urls[:1], name="other", checkpoint=folders[0], push_dir=tmp_path)
    with pytest.raises(VLLMError, match="http://127.0.0.1:9 does not answer"):
        VLLMEngine.attach(
            ["http://127.0.0.1:9"], name="first", checkpoint=folders[0], push_dir=tmp_path
        )
    attached = VLLMEngine.attach(
        engine.urls[:1], name="first", checkpoint=folders[0], push_dir=tmp_path, version=10
    )
    assert attached.max_len == MAX_LEN and attached.version == 10
    attached.close()


@pytest.mark.slow
def test_a_server_reporting_raw_logprobs_or_chunking_prefills_on_a_cpu_is_refused_naming_both(
    folders, tmp_path, monkeypatch
):
    """`start` refuses what attach refuses, each problem named in one error (one server start
    for both). vLLM's default logprobs mode reports log-probs before temperature, top-k and
    top-p: a run would train on log-probs of another distribution than the one its tokens were
    drawn from. A CPU server with chunked prefill on dies of a burst of seeded calls
    (dew.serve._vllm_limits): refused before any call. The server runs in vLLM's default
    process layout, as users run it, the suite's one that does (the others run their model
    worker in their engine core: tests/conftest.py): a model worker process of its own beside
    its engine core, both spawned, and the refusal stops all three processes of its group."""
    started = record_servers(monkeypatch)
    with pytest.raises(VLLMError, match="cannot serve the run") as caught:
        VLLMEngine.start(
            folders[0],
            servers=1,
            max_model_len=MAX_LEN,
            work_dir=tmp_path,
            arguments=["--logprobs-mode", "raw_logprobs", "--enable-chunked-prefill"],
            environment={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        )
    assert "start it with --logprobs-mode processed_logprobs" in str(caught.value)
    assert "start it with --no-enable-chunked-prefill" in str(caught.value)
    (server,) = started
    log = server.log.read_text()
    assert "(EngineCore pid=" in log and "(Worker pid=" in log, log[-3000:]
    assert not left_running(server.pid)


@pytest.mark.slow
def test_a_port_in_use_is_refused_before_starting(engine, folders):
    port = int(engine.urls[0].rsplit(":", 1)[1])
    with pytest.raises(VLLMError, match=f"port {port} on 127.0.0.1 is in use"):
        VLLMEngine.start(folders[0], max_model_len=MAX_LEN, port=port)


@pytest.mark.slow
def test_a_checkpoint_vllm_refuses_fails_with_its_error(tmp_path, monkeypatch):
    """The server's own error reaches the caller. Its first start finds its port taken (dew
    picks a free port, and vLLM binds it after its imports, while any other process may take
    it): it starts again on another, where vLLM refuses the checkpoint."""
    folder = tiny_qwen2(tmp_path / "broken")
    config = (folder / "config.json").read_text()
    (folder / "config.json").write_text(
        config.replace("Qwen2ForCausalLM", "NoSuchModelForCausalLM")
    )
    picked = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])

        def pick(host):
            picked.append(next(ports, None) or free_port(host))
            return picked[-1]

        monkeypatch.setattr(_vllm_start, "free_port", pick)
        with pytest.raises(VLLMError, match="exited with code") as caught:
            VLLMEngine.start(
                folder,
                max_model_len=MAX_LEN,
                ready_timeout=600,
                work_dir=tmp_path,
            )
    assert "NoSuchModelForCausalLM" in str(caught.value)
    assert len(picked) == 2 and f":{picked[1]} exited" in str(caught.value)


@pytest.mark.parametrize("zygote", ["1", "0"])
def test_a_server_never_ready_times_out_naming_it_and_its_log(
    folders, tmp_path, monkeypatch, zygote
):
    """Forked from a zygote (vLLM's CPU build) or, with DEW_VLLM_ZYGOTE=0, a fresh process."""
    monkeypatch.setenv("DEW_VLLM_ZYGOTE", zygote)
    started = record_servers(monkeypatch)
    with pytest.raises(VLLMError, match="was not ready within the timeout") as caught:
        VLLMEngine.start(folders[0], max_model_len=MAX_LEN, ready_timeout=1, work_dir=tmp_path)
    assert "http://127.0.0.1:" in str(caught.value) and str(tmp_path / "vllm-0.log") in str(
        caught.value
    )
    (server,) = started
    kind = _vllm_fork.ForkedServer if zygote == "1" else subprocess.Popen
    assert isinstance(server._process, kind) and not left_running(server.pid)


def test_servers_stop_together_and_one_still_starting_is_killed_after_a_short_grace():
    """vLLM runs a SIGTERM that comes during its start only once its engine is built: a server
    stopped before it was ready (a failed start, a Ctrl-C while the servers start) held its
    stop for the whole 20-second grace. Here processes stand for the servers, their `wait`
    recording the time it was given: one that was ready ends on its SIGTERM within the grace;
    one still starting, which ignores SIGTERM, is killed 2 seconds after the same SIGTERM."""
    programs = {
        True: "import time; print(flush=True); time.sleep(60)",
        False: "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(flush=True); time.sleep(60)",
    }

    class Recorded:
        def __init__(self, program):
            self.popen = subprocess.Popen(
                [sys.executable, "-c", program], stdout=subprocess.PIPE, start_new_session=True
            )
            self.popen.stdout.readline()  # its SIGTERM handling is set
            self.popen.stdout.close()
            self.pid, self.timeouts = self.popen.pid, []

        def poll(self):
            return self.popen.poll()

        def wait(self, timeout=None):
            self.timeouts.append(timeout)
            return self.popen.wait(timeout)

    servers = []
    for ready in (True, False):
        server = object.__new__(_vllm.ServerProcess)
        server._process, server._ready = Recorded(programs[ready]), ready
        servers.append(server)
    _vllm_process.stop_servers(servers)
    ready, starting = (server._process for server in servers)
    assert _vllm_process._STARTING_GRACE < ready.timeouts[0] <= _vllm_process._GRACE
    assert ready.poll() == -signal.SIGTERM
    assert starting.timeouts[0] <= _vllm_process._STARTING_GRACE
    assert starting.poll() == -signal.SIGKILL


@pytest.mark.medium
def test_a_zygote_that_cannot_import_vllm_fails_the_start_quoting_its_log(folders, tmp_path):
    """vLLM's import fails in the zygote (here a broken `vllm` package first on the servers'
    PYTHONPATH): the start fails with its error, as a fresh server's exit would."""
    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this vLLM is broken")\n')
    with pytest.raises(VLLMError, match="did not start: dew's vLLM zygote") as caught:
        VLLMEngine.start(
            folders[0],
            max_model_len=MAX_LEN,
            work_dir=tmp_path,
            environment={"PYTHONPATH": str(broken.parent)},
        )
    assert "ImportError: this vLLM is broken" in str(caught.value)


@pytest.mark.parametrize("setting", ["false", "", "yes"])
def test_a_zygote_setting_other_than_0_or_1_is_refused_naming_it(
    folders, tmp_path, monkeypatch, setting
):
    monkeypatch.setenv("DEW_VLLM_ZYGOTE", setting)
    # A VLLMError, which `dew train` says in one line (a ValueError ended it with a traceback).
    with pytest.raises(VLLMError, match=f"DEW_VLLM_ZYGOTE must be 0 or 1, not '{setting}'"):
        VLLMEngine.start(folders[0], max_model_len=MAX_LEN, work_dir=tmp_path)


def test_a_zygote_killed_before_it_forks_fails_the_fork_quoting_its_log(tmp_path):
    """Killed as it imports vLLM (the kernel's out-of-memory killer, an operator): the fork it
    was asked for fails naming its end, not waiting for an answer that never comes."""
    zygote = _vllm_fork._Zygote(dict(os.environ))
    zygote.process.kill()
    with pytest.raises(_vllm_fork.ZygoteFailed, match="ended with code -9 before it forked"):
        zygote.fork(["--help"], dict(os.environ), tmp_path / "server.log")
    zygote.close()
    assert not zygote.log.exists()


def record_servers(monkeypatch) -> list[_vllm.ServerProcess]:
    """The server processes `VLLMEngine.start` starts from now on, in order."""
    started = []

    class Recorded(_vllm.ServerProcess):
        def __init__(self, checkpoint, **options):
            super().__init__(checkpoint, **options)
            started.append(self)

    monkeypatch.setattr(_vllm_start, "ServerProcess", Recorded)
    return started


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
def test_servers_fork_from_a_zygote_that_imported_vllm_once(engine):
    """Both servers of the module's engine are children of one zygote, this process's, which
    imported vLLM's server before either started (`dew.serve._vllm_fork`)."""
    (zygote,) = {parent(process.pid) for process in engine.processes}
    assert parent(zygote) == os.getpid()
    assert "dew_vllm_zygote.py" in Path(f"/proc/{zygote}/cmdline").read_text()


@pytest.mark.slow
async def test_servers_outlive_a_killed_zygote_and_the_next_start_gets_a_new_one(
    folders, tmp_path, monkeypatch
):
    """A zygote killed while its server runs (the kernel's out-of-memory killer may pick it):
    the server serves on and stops as usual, its exit code lost (-1); the next start of the same
    environment forks from a new zygote. Its own environment (DEW_TEST), so that the zygote the
    module's other servers come from lives on."""
    started = record_servers(monkeypatch)
    options = dict(max_model_len=MAX_LEN, environment={"DEW_TEST": "zygote"})
    with VLLMEngine.start(folders[0], work_dir=tmp_path / "first", **options) as orphaned:
        (server,) = started
        zygote = parent(server.pid)
        os.kill(zygote, signal.SIGKILL)
        while parent(server.pid) == zygote:  # the system adopts the server once it died
            await trio.sleep(0.05)
        async with orphaned:
            call = await orphaned.generate(PROMPT, max_tokens=4, key=3)
        assert len(call.completion) == 4 and server.exit_code() is None
    assert server.exit_code() == -1 and not left_running(server.pid)
    with pytest.raises(VLLMError, match="was not ready within the timeout"):
        VLLMEngine.start(folders[0], work_dir=tmp_path / "second", ready_timeout=1, **options)
    assert started[1]._process._zygote.process.pid != zygote


@pytest.mark.slow
async def test_an_agent_harness_runs_through_the_gateway_with_vllm_serving(
    engine, folders, params, references
):
    engine.load(params[1], 15)
    chat = tokenizer.HuggingFaceTokenizer.from_file(folders[0] / "tokenizer.json")
    replies = []

    async def agent(base_url: str, api_key: str, task: Task) -> str:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
            messages = [{"role": "user", "content": "hello there"}]
            for _ in range(2):
                answer = await api.chat.completions.create(model="m", messages=messages)
                replies.append(answer.choices[0].message.content)
                messages += [
                    {"role": "assistant", "content": replies[-1]},
                    {"role": "user", "content": "and?"},
                ]
            return replies[-1]

    async with (
        engine,
        Gateway(
            engine, max_context=MAX_LEN, max_tokens=16, tokenizer=chat, announce=False
        ) as gateway,
    ):
        session = await HarnessSource(gateway, agent, lambda result: Score(1.0)).run(
            Task("t"), LABEL
        )
    assert session.status is Status.COMPLETED and session.reward == 1.0
    assert len(session.calls) == 2
    for call, reply in zip(session.calls, replies, strict=True):
        assert call.version == 15
        np.testing.assert_allclose(
            call.logprobs, reference_logprobs(references[1], call), atol=2e-4
        )
        assert chat.decode(call.completion[call.completion != chat.eos_id]) == reply
    # The second call's prompt holds the first one's tokens as the engine drew them.
    first, second = session.calls
    drawn = np.concatenate([first.prompt, first.completion])
    np.testing.assert_array_equal(second.prompt[: len(drawn)], drawn)


def dew_train(folder, run, urls, *options) -> list[str]:
    """`dew train`'s arguments for a short run of `folder` served by the vLLM servers at `urls`."""
    argv = ["train", "--model", str(folder), "--engine", "vllm", "--run", str(run)]
    argv += ["--engine-url", *urls, "--batch-size", "2", "--groups", "2"]
    return [*argv, "--tasks", "10", "--eval-every", "0", "--samples", "0", *options]


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_served(urls, version: int) -> None:
    """Every server serves the weights the run pushed last, under their version."""
    for url in urls:
        assert httpx.get(f"{url}/weight_info").json() == {"weight_version": str(version)}


@pytest.mark.slow
def test_dew_train_trains_a_checkpoint_with_vllm_serving_and_replays_its_record(
    engine, folders, tmp_path
):
    from dew.cli import main

    run, trace = tmp_path / "run", tmp_path / "run.trace"
    # At the default batch ahead, rollouts run during the pushes, and one may end under the
    # version being pushed: the trace holds each push's start, which replay needs for it.
    argv = dew_train(folders[0], run, engine.urls, "--steps", "5", "--record", str(trace))
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    lines = metrics(run)
    assert [line["updates"] for line in lines] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(line["loss"]) for line in lines)
    # The last push came before the fifth step.
    assert_served(engine.urls, 4)
    # The trace replays without vLLM: every decision and packed array as recorded.
    assert main(["replay", str(trace)]) == 0
    result = replay.replay(trace)
    assert result.matched and (result.steps, result.groups) == (5, 10)
    assert [version for _, version in replay.read_trace(trace).pushes] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_an_interrupted_vllm_run_resumes_at_its_checkpoint_and_trains_nothing_twice(
    engine, folders, tmp_path, capsys
):
    """Ctrl-C stops the run after the step in progress, with its checkpoint; the resumed run
    pushes the checkpoint's weights before any rollout and trains the data positions after it.
    vLLM's draws are not reproducible (a batch's numerics vary with what it holds), so what is
    exact is the trainer's state, the step and the data position, not the rollouts."""
    from dew.cli import main
    from dew.train import COMMIT

    run, steps = tmp_path / "run", 6
    argv = dew_train(folders[0], run, engine.urls, "--steps", str(steps))

    def press_ctrl_c_after_the_first_step():
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").exists() or not metrics(run):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c_after_the_first_step)
    with jax.numpy_dtype_promotion("standard"):
        presser.start()
        try:
            assert main(argv) == 130  # INTERRUPTED: stopped after the step in progress
        finally:
            presser.join()
        commit = json.loads((run / "checkpoints" / COMMIT).read_text())
        stopped = commit["updates"]
        assert 1 <= stopped < steps and commit["position"] == stopped
        assert len(metrics(run)) == stopped
        capsys.readouterr()
        # Other URLs (here the same servers in another order) may serve the resumed run.
        again = dew_train(folders[0], run, engine.urls[::-1], "--steps", str(steps), "--resume")
        assert main(again) == 0
    assert f"resuming at step {stopped}, data position {stopped}" in capsys.readouterr().out
    lines = metrics(run)
    assert [line["step"] for line in lines] == list(range(steps))
    assert [line["updates"] for line in lines] == list(range(1, steps + 1))
    # Each data position trained once: no rollout of the stopped run trains again.
    assert [line["position"] for line in lines] == list(range(steps))
    assert_served(engine.urls, steps - 1)


@pytest.mark.slow
def test_a_pool_of_processes_trains_each_on_its_share_of_the_vllm_servers(
    engine, folders, tmp_path
):
    """`dew train --processes 2 --engine-url A B`: process 0 pushes to and samples from A,
    process 1 from B, so no server takes two processes' pushes."""
    import sys

    run = tmp_path / "run"
    command = [sys.executable, "-m", "dew", *dew_train(folders[0], run, engine.urls)]
    command += ["--steps", "2", "--processes", "2"]
    environment = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    logs = {path.name: path.read_text() for path in (run / "logs").glob("process-*.log")}
    assert done.returncode == 0, done.stdout + done.stderr + str(logs)
    lines = metrics(run)
    assert [line["updates"] for line in lines] == [1, 2]
    assert all(line["groups"] == 2 and math.isfinite(line["loss"]) for line in lines)
    assert_served(engine.urls, 1)
    # Each process wrote its pushes for its own server.
    assert sorted(path.name for path in (run / "vllm").iterdir()) == ["process-0", "process-1"]


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        (["--engine", "vllm"], "engine vllm serves a --model checkpoint folder"),
        (["--engine-url", "http://127.0.0.1:9"], "engine_url names vLLM servers"),
        (["--engine", "sglang"], "'engine' must be in"),
    ],
)
def test_dew_train_refuses_engine_options_that_do_not_go_together(
    tmp_path, capsys, options, culprit
):
    from dew.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "--run", str(tmp_path / "run"), *options])
    assert exited.value.code == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_pool_refuses_urls_that_do_not_split_over_its_processes(folders, tmp_path, capsys):
    from dew.cli import main

    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"]
    with pytest.raises(SystemExit) as exited:
        main([*dew_train(folders[0], tmp_path / "run", urls), "--processes", "2"])
    assert exited.value.code == 2
    assert (
        "--engine-url: each of the 2 processes pushes to servers of its own, so the 3 URLs must "
        "split evenly over them" in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
async def test_a_push_cancelled_after_its_pause_resumes_the_servers(engine, params, references):
    engine.load(params[0], 50)
    async with engine, httpx.AsyncClient() as client:

        async def paused(url: str) -> bool:
            return (await client.get(f"{url}/is_paused")).json()["is_paused"]

        with trio.CancelScope() as push:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.load_async, params[1], 51)
                with trio.fail_after(120):
                    while not await paused(engine.urls[0]):
                        await trio.sleep(0.01)
                push.cancel()  # the reload is under way: the servers are paused
        assert not [url for url in engine.urls if await paused(url)]
        assert engine.version == 50
        with trio.fail_after(120):
            call = await engine.generate(PROMPT, max_tokens=6, key=1)
    assert call.version == 50


async def concurrent_calls(engine, count: int) -> list:
    """`count` calls made at once (so that they go to both servers): each one's Call, or the
    CallFailed it raised."""
    results: list = [None] * count

    async def one(key: int) -> None:
        try:
            results[key] = await engine.generate(PROMPT, max_tokens=6, key=key)
        except CallFailed as error:
            results[key] = error

    async with trio.open_nursery() as nursery:
        for key in range(count):
            nursery.start_soon(one, key)
    return results


async def served_calls(url: str) -> float:
    """How many calls the server at `url` has finished, from its Prometheus metrics."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    lines = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@pytest.mark.slow
async def test_a_restarted_server_gets_no_calls_until_the_next_push_reloads_it(
    engine, folders, params, references, caplog
):
    engine.load(params[1], 40)
    # A server restarted under its URL serves its checkpoint again, labelled "default": made
    # so here by reloading the checkpoint into it and labelling it so.
    victim = engine.urls[1]
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folders[0])}}
    httpx.post(f"{victim}/collective_rpc", json=reload, timeout=120).raise_for_status()
    label = {"new_version": "default"}
    httpx.post(f"{victim}/update_weight_version", json=label).raise_for_status()
    async with engine:
        first = await concurrent_calls(engine, 4)
        failed = [result for result in first if isinstance(result, CallFailed)]
        assert failed, "no call went to the restarted server"
        for error in failed:
            assert victim in str(error) and "'default'" in str(error)
        assert any("restarted?" in record.getMessage() for record in caplog.records)
        # Its weights are not the run's: every call now goes to the other server.
        for call in await concurrent_calls(engine, 4):
            assert call.version == 40
            np.testing.assert_allclose(
                call.logprobs, reference_logprobs(references[1], call), atol=2e-4
            )
        # The next push reloads it, and it takes calls again, under the pushed weights.
        await engine.load_async(params[1], 41)
        before = await served_calls(victim)
        for call in await concurrent_calls(engine, 4):
            assert call.version == 41
            np.testing.assert_allclose(
                call.logprobs, reference_logprobs(references[1], call), atol=2e-4
            )
        with trio.fail_after(30):
            while await served_calls(victim) == before:
                await trio.sleep(0.05)


class KeptSessions:
    """A source that keeps every session its inner source returns."""

    def __init__(self, source):
        self.source = source
        self.sessions = []

    async def run(self, task, label):
        session = await self.source.run(task, label)
        self.sessions.append(session)
        return session


@pytest.mark.slow
async def test_a_killed_servers_rollouts_are_resubmitted_to_the_server_left(
    engine, folders, params
):
    victim = engine.processes[1]
    chat = tokenizer.HuggingFaceTokenizer.from_folder(folders[0])
    kept = KeptSessions(
        PromptSource(
            engine,
            lambda task: "hello",
            lambda task, reply: Score(len(reply) / 100),
            max_tokens=100,
            tokenizer=chat,
        )
    )
    model = hf.load(folders[0])[0]
    scheduler = RolloutScheduler(
        GRPOObjective(model), kept, engine, width=MAX_LEN, rows=4, groups=2, ahead=0,
        truncation="score",
    )  # fmt: skip
    dataset = scheduler.tasks(ArrayDataset({"task_id": np.arange(4)}, batch_size=2))
    async with engine, scheduler:
        batches = iter(dataset.stream())
        # The first step pushes version 30, and a push resumes every server: the victim is
        # paused after it, for the second step, which pushes nothing.
        await scheduler.step(next(batches), params[0], 30)
        kept.sessions.clear()
        stepped = trio.Event()

        async def step():
            await scheduler.step(next(batches), params[0], 30)
            stepped.set()

        # Paused, the victim holds the calls it takes until it is killed: none ends first. (A
        # paused server's metrics stand still, so the engine's count tells that it holds one.)
        httpx.post(f"{victim.url}/pause", params={"mode": "keep"}).raise_for_status()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step)
            with trio.fail_after(120):
                while engine.calls[1] == 0:
                    assert not stepped.is_set(), "the step ended with no call on the victim"
                    await trio.sleep(0.05)
            os.killpg(victim.pid, signal.SIGKILL)
        assert engine.calls == (0, 0)
        record = scheduler.last_record
        assert record.resubmitted["infra_error"] >= 1
        assert (record.groups, record.abandoned) == (2, 0)
        failed = [session for session in kept.sessions if session.status is Status.INFRA_ERROR]
        assert failed and all(victim.url in session.error for session in failed)
        # Its own account of the death is in its log, which the failure names.
        assert all(str(victim.log) in session.error for session in failed)
        # Pushes skip the dead server; calls go to the live one.
        engine.load(params[1], 31)
        assert (await engine.generate(PROMPT, max_tokens=4)).version == 31
        # With no server left, the engine stops the run with a clear error.
        engine.processes[0].kill()
        with pytest.raises(CallFailed):
            await engine.generate(PROMPT, max_tokens=4)
        with pytest.raises(VLLMError, match="no vLLM server is alive") as dead:
            await engine.generate(PROMPT, max_tokens=4)
        assert all(str(process.log) in str(dead.value) for process in engine.processes)
        with pytest.raises(VLLMError, match="no vLLM server is alive to push version 32"):
            engine.load(params[1], 32)
