"""LoRA adapter pushes into a fleet of real vLLM servers (its CPU build): each push loads the
adapter into every server, and a server that dies in the middle of one is left out as a full
push leaves it out, the push landing on the others; an adapter trained with dropout serves
without it.

One engine of two servers started for adapters of rank 8, shared by the module; the adapters
are PEFT's own, as tests/test_vllm_lora.py draws them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _checkpoint import tiny_qwen2
from dew.models import hf
from dew.models.hf import lora
from dew.serve._vllm_push import LOAD_ADAPTER
from dew.serve.vllm import VLLMEngine
from test_vllm_lora import ATOL, MAX_LEN, PROMPT, RANK, peft_adapter, peft_logprobs, save_adapter

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_qwen2(tmp_path_factory.mktemp("lora-fleet") / "base", seed=0, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def adapters(base):
    return [peft_adapter(base, seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def engine(base, tmp_path_factory):
    with VLLMEngine.start(
        base,
        servers=2,
        max_model_len=MAX_LEN,
        lora_rank=RANK,
        save=save_adapter,
        work_dir=tmp_path_factory.mktemp("engine"),
    ) as started:
        yield started


async def _calls(engine: VLLMEngine, count: int) -> list:
    async with engine:
        return [await engine.generate(PROMPT, max_tokens=6, key=key) for key in range(count)]


def _adapter_paths(engine: VLLMEngine, url: str) -> list[str]:
    """The folders of the adapters server `url` holds under the run's adapter name."""
    cards = httpx.get(f"{url}/v1/models").raise_for_status().json()["data"]
    return [card["root"] for card in cards if card["id"] == engine.adapter]


@pytest.mark.slow
async def test_an_adapter_push_loads_the_adapter_into_every_server_of_the_fleet(engine, adapters):
    await engine.load_async(adapters[0], 1)
    pushed = [_adapter_paths(engine, url) for url in engine.urls]
    assert pushed[0] == pushed[1] and len(pushed[0]) == 1 and pushed[0][0].endswith("adapter-1")
    for call in await _calls(engine, 4):
        assert call.version == 1
        np.testing.assert_allclose(
            call.logprobs, peft_logprobs(adapters[0], call), rtol=0, atol=ATOL
        )


@pytest.mark.slow
async def test_a_server_killed_mid_adapter_push_is_left_out_and_the_push_lands_on_the_other(
    engine, adapters, caplog, monkeypatch
):
    """The second server dies once it is paused, as the push asks it to load the adapter: its
    load fails, it is left out in one line, and the other serves the pushed adapter under the
    pushed version, as a full push does (tests/test_vllm_fleet.py)."""
    victim = engine.processes[1]
    post = engine._post_async

    async def dying(client, server, path, **options):
        if path == LOAD_ADAPTER and server.url == victim.url:
            victim.kill()  # its whole process group, as a crash in the middle of the push
        return await post(client, server, path, **options)

    monkeypatch.setattr(engine, "_post_async", dying)
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        await engine.load_async(adapters[1], 2)
    assert engine.version == 2
    left_out = [r.getMessage() for r in caplog.records if "is left out" in r.getMessage()]
    assert len(left_out) == 1 and victim.url in left_out[0] and "(1 left)" in left_out[0]
    assert _adapter_paths(engine, engine.urls[0])[0].endswith("adapter-2")
    for call in await _calls(engine, 3):
        assert call.version == 2
        np.testing.assert_allclose(
            call.logprobs, peft_logprobs(adapters[1], call), rtol=0, atol=ATOL
        )


@pytest.mark.slow
async def test_an_adapter_trained_with_dropout_loads_and_serves_without_it(
    engine, base, monkeypatch
):
    """dew's adapter of a run with `--lora-dropout` (its `adapter_config.json` saying
    `lora_dropout`) loads into the fleet's live server, which draws from it as dew's merged
    forward scores it: inference drops nothing, in vLLM as in dew."""
    model, params = hf.load(base)
    adapted = lora.LoRAModel(model, lora.LoRAConfig(RANK, 16, ("q_proj", "v_proj"), dropout=0.1))
    variables = adapted.variables(params, jax.random.key(0))
    variables["adapter"] = jax.tree.map(lambda leaf: leaf + 0.3, variables["adapter"])
    # The engine writes this push as a dew train run's engine does: dew's own adapter folder.
    monkeypatch.setattr(
        engine, "_save", lambda to, pushed: lora.save_adapter(to, pushed["adapter"], adapted.lora)
    )
    await engine.load_async(variables, 3)
    (held,) = _adapter_paths(engine, engine.urls[0])
    assert json.loads((Path(held) / lora.ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.1
    for call in await _calls(engine, 2):
        assert call.version == 3
        ids = np.concatenate([call.prompt, call.completion]).astype(np.int32)
        logits = adapted(
            variables,
            jnp.asarray(ids)[None],
            jnp.arange(len(ids), dtype=jnp.int32)[None],
            jnp.ones((1, len(ids)), jnp.int32),
        )[0]
        scored = np.asarray(jax.nn.log_softmax(logits, -1))[len(call.prompt) - 1 : -1]
        ours = scored[np.arange(len(call.completion)), call.completion]
        np.testing.assert_allclose(call.logprobs, ours, rtol=0, atol=ATOL)
