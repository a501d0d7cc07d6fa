"""A fleet of real vLLM servers (its CPU build) outlives a server that dies or stops answering.

One engine of three servers of a tied tiny checkpoint, shared by the module, with a read timeout
of a few seconds. The first test kills a server in the middle of a push (after the pause, as its
reload is asked for): the push lands on the others. The second kills a server behind the
engine's back and pushes: the push goes on with the one left. The third stops (SIGSTOP) the
server left mid-call: the read timeout cuts it off instead of waiting for ever, and with no
server left the engine says so.
"""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest
import trio

from _checkpoint import tiny_qwen2
from dew.models import hf
from dew.serve import CallFailed
from dew.serve.vllm import VLLMEngine, VLLMError

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
)

PROMPT = np.array([0, 1, 17, 42, 99, 7], np.int32)
READ_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    return [tiny_qwen2(root / f"tied-{seed}", seed=seed, tied=True) for seed in range(2)]


@pytest.fixture(scope="module")
def engine(folders, tmp_path_factory):
    """Three servers, each with its model worker in its engine core's process, as the suite's
    other servers (tests/conftest.py): the kills below reach both processes of a server's
    group. In vLLM's default layout, with a worker process of its own beside each engine core,
    each took 21 more CPU-seconds to start (47.5 against 26.5); that layout's start and the
    stop of its three processes are test_vllm.py's refused server's."""
    with VLLMEngine.start(
        folders[0],
        servers=3,
        max_model_len=128,
        work_dir=tmp_path_factory.mktemp("engine"),
        read_timeout=READ_TIMEOUT,
    ) as engine:
        yield engine


@pytest.mark.slow
async def test_a_server_killed_mid_push_is_left_out_and_the_push_lands_on_the_others(
    engine, folders, caplog, monkeypatch
):
    """The third server dies once it is paused, as the push asks it to reload: its reload
    fails, it is left out in one line, and the two others serve the pushed weights under the
    pushed version (a push that failed there would have stopped the run)."""
    params = hf.load(folders[1])[1]
    victim = engine.processes[2]
    post = engine._post_async

    async def dying(client, server, path, **options):
        if path == "/collective_rpc" and server.url == victim.url:
            victim.kill()  # its whole process group, as a crash in the middle of the push
        return await post(client, server, path, **options)

    monkeypatch.setattr(engine, "_post_async", dying)
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        await engine.load_async(params, 1)
    assert engine.version == 1
    left_out = [r.getMessage() for r in caplog.records if "is left out" in r.getMessage()]
    assert len(left_out) == 1 and victim.url in left_out[0] and "(2 left)" in left_out[0]
    async with engine:
        calls = [await engine.generate(PROMPT, max_tokens=4, key=key) for key in range(6)]
    assert {call.version for call in calls} == {1}


@pytest.mark.slow
async def test_a_server_killed_before_a_push_is_left_out_and_the_push_lands_on_the_other(
    engine, folders, caplog
):
    """Before, the push failed at the dead server's /pause and stopped the run."""
    params = hf.load(folders[0])[1]
    survivor, victim = engine.processes[:2]
    victim.kill()  # its whole process group, as a crash: nothing the engine sees
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        await engine.load_async(params, 2)
    assert engine.version == 2
    left_out = [r.getMessage() for r in caplog.records if "is left out" in r.getMessage()]
    assert len(left_out) == 1 and victim.url in left_out[0] and "(1 left)" in left_out[0]
    async with engine:
        calls = [await engine.generate(PROMPT, max_tokens=4, key=key) for key in range(4)]
    assert {call.version for call in calls} == {2}
    assert engine.calls == (0, 0, 0) and survivor.exit_code() is None


@pytest.mark.slow
async def test_a_server_that_stops_answering_is_cut_off_by_the_read_timeout(engine):
    """Before, a call to a stopped server waited for ever, with nothing said."""
    survivor = engine.processes[0]
    os.killpg(survivor.pid, signal.SIGSTOP)
    try:
        async with engine:
            with trio.fail_after(10 * READ_TIMEOUT):
                with pytest.raises(CallFailed, match="it sent nothing for 5 s") as failed:
                    await engine.generate(PROMPT, max_tokens=4)
                with pytest.raises(VLLMError, match="no vLLM server is alive"):
                    await engine.generate(PROMPT, max_tokens=4)
    finally:
        os.killpg(survivor.pid, signal.SIGCONT)
    assert survivor.url in str(failed.value) and str(survivor.log) in str(failed.value)
