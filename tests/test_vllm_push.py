"""Weight pushes into real vLLM servers (its CPU build), for a checkpoint whose output projection
is its embedding (`tie_word_embeddings`, as most small checkpoints people train) and for one with
a separate head: after each push the server's log-probs are dew's own under the pushed weights.

One server per checkpoint, shared by the module and started together (a server takes a minute to
start here). The pushed weights are other checkpoints' scaled up (`sharpened`), so that a head
left at its start-up weights, or keys and values cached under the old weights, are far off, not
within noise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio

from _checkpoint import sharpened, tiny_qwen2
from dew.models import hf
from dew.serve.vllm import VLLMEngine

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
)

KINDS = ("tied", "untied")
MAX_LEN = 384
PROMPT = np.array([0, 1, 17, 42, 99, 7], np.int32)
# The servers' KV cache blocks hold 128 tokens on a CPU: prompts longer than that share blocks.
BLOCK = 128
# What a push of float32 weights must land within: float32 rounding of the two forward passes.
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per kind: the served checkpoint folder, its model, and two strongly changed params."""
    root = tmp_path_factory.mktemp("push")
    made = {}
    for kind in KINDS:
        tied = kind == "tied"
        folders = [
            tiny_qwen2(root / f"{kind}-{seed}", seed=seed, tied=tied, max_len=512)
            for seed in range(3)
        ]
        model = hf.load(folders[0])[0]
        assert model.config.tied is tied
        pushes = [sharpened(hf.load(folder)[1]) for folder in folders[1:]]
        made[kind] = (folders[0], model, pushes)
    return made


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """A started engine per kind, the servers starting at once."""
    with contextlib.ExitStack() as stack:
        with concurrent.futures.ThreadPoolExecutor(len(KINDS)) as pool:
            futures = {
                kind: pool.submit(
                    VLLMEngine.start,
                    checkpoints[kind][0],
                    max_model_len=MAX_LEN,
                    work_dir=tmp_path_factory.mktemp(f"engine-{kind}"),
                )
                for kind in KINDS
            }
        for future in futures.values():  # each engine that started stops with the stack
            if future.exception() is None:
                stack.enter_context(future.result())
        yield {kind: future.result() for kind, future in futures.items()}


def dew_logprobs(model, params, call) -> np.ndarray:
    """float64[completion]: each drawn token's log-prob under dew's model with `params`, at
    temperature 1 (the calls' sampling)."""
    ids = np.concatenate([call.prompt, call.completion]).astype(np.int32)[None]
    width = ids.shape[1]
    logits = model(
        params,
        jnp.asarray(ids),
        jnp.arange(width, dtype=jnp.int32)[None],
        jnp.ones((1, width), jnp.int32),
    )
    logprobs = jax.nn.log_softmax(logits[0, len(call.prompt) - 1 : -1], axis=-1)
    drawn = np.asarray(logprobs)[np.arange(len(call.completion)), call.completion]
    return drawn.astype(np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
async def test_each_push_serves_the_pushed_weights_head_included(kind, engines, checkpoints):
    """A tied head is reloaded with the embedding: before, vLLM's CPU build kept computing
    logits with the start-up head's packed copy ("ParallelLMHead: Failed to load weights")."""
    engine = engines[kind]
    _, model, pushes = checkpoints[kind]
    for version, params in enumerate(pushes, start=1):
        await engine.load_async(params, version)
        async with engine:
            calls = [await engine.generate(PROMPT, max_tokens=16, key=key) for key in range(3)]
        for call in calls:
            assert call.version == version
            np.testing.assert_allclose(
                call.logprobs, dew_logprobs(model, params, call), rtol=0, atol=ATOL
            )


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
async def test_a_prompt_sharing_cached_blocks_is_computed_under_the_pushed_weights(
    kind, engines, checkpoints
):
    """A push empties the servers' prefix cache: a prompt whose first block another prompt
    left in the cache before the push is computed under the pushed weights, not from the
    keys and values the old ones cached (vLLM keys its cache on the tokens alone)."""
    engine = engines[kind]
    _, model, pushes = checkpoints[kind]
    rng = np.random.default_rng(len(kind))
    shared = rng.integers(0, model.vocab, BLOCK + 40, dtype=np.int32)
    first, second = (
        np.concatenate([shared, rng.integers(0, model.vocab, 20, dtype=np.int32)]) for _ in range(2)
    )
    await engine.load_async(pushes[0], 10)
    async with engine:
        await engine.generate(first, max_tokens=4, key=0)  # its blocks stay in the cache
    await engine.load_async(pushes[1], 11)
    async with engine:
        call = await engine.generate(second, max_tokens=8, key=1)
    assert call.version == 11
    np.testing.assert_allclose(
        call.logprobs, dew_logprobs(model, pushes[1], call), rtol=0, atol=ATOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_dew_train_at_its_default_batch_keeps_the_engine_agreeing_with_dews_rescoring(
    kind, engines, checkpoints, tmp_path, capsys
):
    """`dew train` at its default batch (8 tasks x 16 samples, and the batch ahead: a burst
    past vLLM's step budget) trains to its end, each step's `mismatch/engine` (the
    behaviour-proximal KL of the tokens drawn under the trainer's own version) float noise. With
    the head left at its start-up weights, a tied checkpoint's climbed from 1e-14 to 3e-3 in
    three updates; with chunked prefill, the first burst killed the server."""
    from dew.cli import main

    engine = engines[kind]
    run = tmp_path / "run"
    argv = ["train", "--model", str(checkpoints[kind][0]), "--engine", "vllm", "--run", str(run)]
    argv += ["--engine-url", *engine.urls, "--eval-every", "0", "--samples", "0", "--steps", "6"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    said = capsys.readouterr().out.splitlines()
    assert f"attaching to vLLM at {engine.urls[0]}" in said
    assert any(line.startswith("vLLM ready in ") for line in said), said
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2, 3, 4, 5, 6]
    # A step has a figure where it trained tokens drawn under the trainer's own version (most
    # are drawn a version behind, ahead of their step); one after the first push at least.
    mismatches = [line["mismatch/engine"] for line in lines if "mismatch/engine" in line]
    print(f"{kind}: mismatch/engine per step {mismatches}")
    assert len(mismatches) >= 2, lines
    assert max(mismatches) <= 1e-6, mismatches


@pytest.mark.slow
def test_a_server_computing_in_another_dtype_than_the_model_is_named_in_one_line(
    engines, checkpoints, tmp_path, caplog
):
    """A server's dtype and the run's model's differ (a server started without `--dtype
    float32` serves a float32 checkpoint in bfloat16; here a float32 server and a bfloat16
    model): dew attached without a word, and mismatch/engine sat at 1e-8 instead of 1e-14."""
    folder, model, _ = checkpoints["tied"]
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        attached = VLLMEngine.attach(
            engines["tied"].urls,
            checkpoint=folder,
            model=attrs.evolve(model, dtype="bfloat16"),
            push_dir=tmp_path,
        )
    attached.close()
    said = [record.getMessage() for record in caplog.records]
    named = [line for line in said if "computes in" in line]
    assert len(named) == 1, said
    assert "computes in float32, the run's model in bfloat16" in named[0]
    assert "start it with --dtype bfloat16" in named[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
async def test_a_burst_of_seeded_calls_beyond_a_steps_token_budget_is_served(
    kind, engines, checkpoints
):
    """dew's burst at its defaults: more prompt tokens at once than vLLM's scheduler takes a step
    (2,048 by default), each call seeded. With chunked prefill on, vLLM's CPU engine split the
    prompt crossing the budget over two steps and died of it ("CPU Generator does not use
    offset"); the servers dew starts run without it. Runs last: before, it killed the server."""
    engine = engines[kind]
    _, model, _ = checkpoints[kind]
    rng = np.random.default_rng(7)
    prompts = rng.integers(0, model.vocab, (160, 25), dtype=np.int32)
    calls = {}
    async with engine:

        async def one(index):
            calls[index] = await engine.generate(prompts[index], max_tokens=4, key=index)

        async with trio.open_nursery() as nursery:
            for index in range(len(prompts)):
                nursery.start_soon(one, index)
    assert sorted(calls) == list(range(len(prompts)))
    assert all(len(call.completion) == 4 for call in calls.values())
    assert engine.processes[0].exit_code() is None
