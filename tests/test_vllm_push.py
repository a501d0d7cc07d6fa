"""Weight pushes into real vLLM servers (its CPU build), for a checkpoint whose output projection
is its embedding (`tie_word_embeddings`, as most small checkpoints people train) and for one with
a separate head: after each push the server's log-probs are dew's own under the pushed weights.

One server per checkpoint, shared by the module and started together (a server takes a minute to
start here). The pushed weights are another checkpoint's with the embedding scaled up, so the
logits are sharp and a head left at its start-up weights is far off, not within noise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _checkpoint import tiny_qwen2
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


def sharpened(params: dict, scale: float = 40.0) -> dict:
    """`params` with the embedding (and the head, where separate) scaled up: logits spread over
    tens of nats, where a tiny random model's are nearly uniform."""
    out = dict(params, embed=params["embed"] * jnp.float32(scale))
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"] * jnp.float32(scale)
    return out


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
