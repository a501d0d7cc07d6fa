"""LoRA adapter pushes into a real vLLM server (its CPU build): with `lora_rank`, each push has
the server load the adapter alone in place under one name, and its log-probs are then the base
model's with that adapter, as transformers + PEFT compute them; in a fleet, each push loads the
adapter into every server, and a server that dies in the middle of one is left out as a full
push leaves it out, the push landing on the others; an adapter trained with dropout serves
without it.

One engine of two servers for the module (a server takes a minute or more to start here),
started for adapters of rank 8: the tests of one server's calls attach to its first server
alone, the fleet's tests (last, as one kills the second server) push through both. The
adapters are PEFT's own (`get_peft_model(...).save_pretrained`), their A and B drawn at random:
PEFT starts B at 0, which would leave the base model's log-probs as they are.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio

from _checkpoint import tiny_qwen2
from _hf_folders import answer_with_digits, chat_checkpoint
from _process_groups import slow_motion
from dew._torch_media import hide_broken_media_packages
from dew.models import hf
from dew.models.hf import lora
from dew.objectives.rl._session import track_progress
from dew.serve._vllm_push import LOAD_ADAPTER, lora_problem
from dew.serve.vllm import CallFailed, VLLMEngine, VLLMError
from test_vllm_push import dew_logprobs

pytestmark = pytest.mark.filterwarnings(
    "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage:ResourceWarning"
)

RANK = 8
MAX_LEN = 512
PROMPT = np.array([0, 1, 17, 42, 99, 7], np.int32)
# The server's KV cache blocks hold 128 tokens on a CPU: prompts longer than that share blocks.
BLOCK = 128
# The call in flight through a push: it must still be drawing when a call after the push joins
# (the servers run in slow motion until then: `slow_motion`).
OLD_TOKENS = 240
# What a push of float32 weights must land within: float32 rounding of the two forward passes.
ATOL = 1e-5


def peft_adapter(base: Path, seed: int):
    """A transformers + PEFT model of `base` with a rank-RANK adapter on the attention's query
    and value projections and the MLP's down projection, its A and B drawn from `seed`."""
    hide_broken_media_packages()
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return adapted.eval()


def save_adapter(folder: Path, adapted) -> None:
    """The engine's adapter writer here: PEFT's own (adapter_config.json and
    adapter_model.safetensors)."""
    adapted.save_pretrained(folder)


def peft_logprobs(adapted, call) -> np.ndarray:
    """float64[completion]: each drawn token's log-prob under transformers + PEFT, at
    temperature 1 (the calls' sampling)."""
    import torch

    ids = torch.tensor(np.concatenate([call.prompt, call.completion])[None].astype(np.int64))
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits[0, len(call.prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.double(), dim=-1).numpy()
    return logprobs[np.arange(len(call.completion)), call.completion]


def swapped_logprobs(first, second, call, switch: int) -> np.ndarray:
    """float64[completion]: each drawn token's log-prob when the adapter of `first` drew the
    tokens before `switch` and that of `second` the rest, over the keys and values `first`
    computed for the positions before: what a server that swaps adapters under a call in
    flight, without recomputing its cache, draws it from."""
    import torch

    ids = torch.tensor(np.concatenate([call.prompt, call.completion])[None].astype(np.int64))
    cut = len(call.prompt) + switch - 1  # the position whose logits draw token `switch`
    with torch.no_grad():
        before = first(input_ids=ids[:, :cut], use_cache=True)
        after = second(input_ids=ids[:, cut:-1], past_key_values=before.past_key_values)
    logits = torch.cat([before.logits[0, len(call.prompt) - 1 :], after.logits[0]])
    logprobs = torch.log_softmax(logits.double(), dim=-1).numpy()
    return logprobs[np.arange(len(call.completion)), call.completion]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("lora") / "base", seed=0, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def adapters(base):
    """Two adapters of the base checkpoint, far apart."""
    return [peft_adapter(base, seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def fleet(base, tmp_path_factory):
    """An engine of two servers, started for adapters of rank `RANK`: the fleet's tests push
    through it; the others through `engine`, attached to its first server alone."""
    with VLLMEngine.start(
        base,
        servers=2,
        max_model_len=MAX_LEN,
        lora_rank=RANK,
        save=save_adapter,
        work_dir=tmp_path_factory.mktemp("fleet"),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def engine(fleet, base, tmp_path_factory):
    """The fleet's first server as an engine of its own: a test of one server's calls and
    pushes (a call in flight through a push, a server that lost the adapter) needs every call
    on that server."""
    with VLLMEngine.attach(
        fleet.urls[:1],
        checkpoint=base,
        save=save_adapter,
        push_dir=tmp_path_factory.mktemp("engine"),
        lora=True,
    ) as attached:
        yield attached


@pytest.mark.slow
async def test_each_adapter_push_serves_the_base_model_with_that_adapter(
    engine, adapters, base, tmp_path
):
    """Each push loads only the adapter, in place under the one name calls give as their
    model; the calls report the pushed version (vLLM labels an adapter's calls "default"
    unless told) and draw with the base model + that adapter, as transformers + PEFT and dew's
    own `LoRAModel` (the adapter read back with `lora.load_adapter`) compute them."""

    model, params = hf.load(base)
    for version, adapted in enumerate(adapters, start=1):
        save_adapter(tmp_path / str(version), adapted)
        config, adapter = lora.load_adapter(tmp_path / str(version), model)
        ours = lora.LoRAModel(model, config), {"adapter": adapter, "base": params}
        await engine.load_async(adapted, version)
        async with engine:
            calls = [await engine.generate(PROMPT, max_tokens=16, key=key) for key in range(3)]
        for call in calls:
            assert call.version == version
            np.testing.assert_allclose(
                call.logprobs, peft_logprobs(adapted, call), rtol=0, atol=ATOL
            )
            np.testing.assert_allclose(call.logprobs, dew_logprobs(*ours, call), rtol=0, atol=ATOL)
            other = peft_logprobs(adapters[2 - version], call)
            assert np.abs(call.logprobs - other).max() > 100 * ATOL  # the adapters differ
        # What the push had the server read: the adapter's tensors, not the model's.
        pushed = engine.push_bytes[-1]
        assert pushed == (tmp_path / str(version) / "adapter_model.safetensors").stat().st_size
        assert pushed * 10 < (base / "model.safetensors").stat().st_size
    served = httpx.get(f"{engine.urls[0]}/v1/models").json()["data"]
    adapters_served = [entry for entry in served if entry.get("parent")]
    assert [entry["id"] for entry in adapters_served] == [engine.adapter]
    assert len(engine.push_seconds) >= 2


@pytest.mark.slow
async def test_a_prompt_sharing_cached_blocks_is_computed_under_the_pushed_adapter(
    engine, adapters
):
    """Each version's adapter comes from a folder of its own: vLLM keys its prefix cache on
    the adapter's name and path, so a prompt whose first block a call under the previous
    adapter left in the cache is computed under the new one (an in-place reload from one path
    would reuse those blocks)."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 300, BLOCK + 40, dtype=np.int32)
    first, second = (
        np.concatenate([shared, rng.integers(0, 300, 20, dtype=np.int32)]) for _ in range(2)
    )
    await engine.load_async(adapters[0], 10)
    async with engine:
        await engine.generate(first, max_tokens=4, key=0)  # its blocks stay in the cache
    await engine.load_async(adapters[1], 11)
    async with engine:
        call = await engine.generate(second, max_tokens=8, key=1)
    assert call.version == 11
    np.testing.assert_allclose(call.logprobs, peft_logprobs(adapters[1], call), rtol=0, atol=ATOL)


@pytest.mark.slow
async def test_a_call_in_flight_through_an_adapter_push_keeps_the_version_that_drew_it(
    engine, fleet, adapters
):
    """What vLLM does to a call in flight when the adapter is swapped in place: it goes on
    under the old adapter (read again from its folder at each step) while the server labels
    its tokens with the new version, until a call that arrived after the swap joins its batch;
    from then on both are drawn by the new adapter, the call in flight over the keys and values
    the old one computed. So its record keeps the version it was submitted under (that of its
    first token's adapter), not the label; and the old folder stays until it ends (vLLM reads
    it at each step)."""
    old_version = 20
    await engine.load_async(adapters[0], old_version)
    results, progress = {}, {}
    groups = [fleet.processes[0].pid]  # the server `engine` is attached to

    async def call(name, max_tokens, key):
        progress[name] = track_progress()
        results[name] = await engine.generate(PROMPT, max_tokens=max_tokens, key=key)

    async def drawn(name, at_least):
        with trio.move_on_after(120):
            while name not in progress or progress[name].length()[0] < at_least:
                await trio.sleep(0.01)
            return
        seen = {key: tracked.length() for key, tracked in progress.items()}
        pytest.fail(f"the {name} call drew no {at_least} tokens in 120 s: (tokens, calls) {seen}")

    # In slow motion, so that the old call cannot run to its end while the push and the new
    # call are under way (under a load of 13 the new call's first token came after the old
    # call's 240th, once, the servers running freely).
    async with engine, trio.open_nursery() as nursery:
        with slow_motion(groups):
            nursery.start_soon(call, "old", OLD_TOKENS, 5)
            await drawn("old", 5)
            await engine.load_async(adapters[1], old_version + 1)
            await drawn("old", progress["old"].length()[0] + 5)  # after the swap, alone
            alone = progress["old"].length()[0]
            nursery.start_soon(call, "new", 10, 6)
            await drawn("new", 1)
            joined = progress["old"].length()[0]  # when the new call drew its first token
    old, new = results["old"], results["new"]
    print(f"the old call had drawn {alone} tokens when the new one came, {joined} at its first")
    assert joined < OLD_TOKENS - 2  # a margin for the old call's stream behind the new one's
    assert (old.version, new.version) == (old_version, old_version + 1)
    assert len(old.completion) == OLD_TOKENS
    np.testing.assert_allclose(new.logprobs, peft_logprobs(adapters[1], new), rtol=0, atol=ATOL)
    # The old adapter drew it up to some token after the new call came, the new one the rest.
    under_old = np.abs(old.logprobs - peft_logprobs(adapters[0], old)) <= ATOL
    switch = int(np.argmin(under_old)) if not under_old.all() else len(old.completion)
    print(f"the call in flight was drawn by the new adapter from token {switch} on")
    assert alone <= switch < len(old.completion)
    np.testing.assert_allclose(
        old.logprobs, swapped_logprobs(*adapters, old, switch), rtol=0, atol=ATOL
    )


@pytest.mark.slow
async def test_a_server_that_lost_the_adapter_gets_no_calls_until_the_next_push_loads_it(
    engine, adapters
):
    """A server restarted under its URL knows no adapter of the run's name (made so here by
    unloading it): a call naming it fails as one the scheduler resubmits elsewhere (before, as
    a refusal, which ends the run), the server gets no more calls, and the next push loads the
    adapter into it again."""
    await engine.load_async(adapters[0], 30)
    forget = {"lora_name": engine.adapter}
    httpx.post(f"{engine.urls[0]}/v1/unload_lora_adapter", json=forget).raise_for_status()
    async with engine:
        with pytest.raises(CallFailed, match=f"no adapter '{engine.adapter}'"):
            await engine.generate(PROMPT, max_tokens=4, key=0)
        with pytest.raises(VLLMError, match="no vLLM server is alive"):
            await engine.generate(PROMPT, max_tokens=4, key=0)
    await engine.load_async(adapters[1], 31)
    async with engine:
        call = await engine.generate(PROMPT, max_tokens=8, key=1)
    assert call.version == 31
    np.testing.assert_allclose(call.logprobs, peft_logprobs(adapters[1], call), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_dew_train_lora_pushes_the_adapter_and_the_engine_agrees_with_dew(
    engine, base, tmp_path, capsys
):
    """`dew train --lora` on the vLLM server: each push loads the adapter alone (push/bytes
    a small share of the checkpoint's), and the engine's behaviour log-probs equal dew's own
    base + adapter rescoring (`mismatch/engine`, over the tokens drawn under the trainer's own
    version, float noise)."""
    from dew.cli import main

    run = tmp_path / "run"
    argv = ["train", "--model", str(base), "--lora", "--engine", "vllm", "--run", str(run)]
    argv += ["--engine-url", *engine.urls, "--eval-every", "0", "--samples", "0"]
    argv += ["--steps", "3", "--tasks", "4", "--groups", "2", "--batch-size", "2"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2, 3]
    full = (base / "model.safetensors").stat().st_size
    assert all(0 < line["push/bytes"] * 10 < full for line in lines), lines
    mismatches = [line["mismatch/engine"] for line in lines if "mismatch/engine" in line]
    print(f"mismatch/engine per step {mismatches}; push/bytes {lines[-1]['push/bytes']}")
    assert mismatches, lines
    assert max(mismatches) <= 1e-6, mismatches
    # The servers' adapter is the run's last: its folder under the run's vLLM folder.
    served = httpx.get(f"{engine.urls[0]}/v1/models").json()["data"]
    (adapter,) = [entry for entry in served if entry["id"] == engine.adapter]
    assert Path(adapter["root"]).parent == run / "vllm" / "process-0"


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint vLLM's CPU build serves (heads of 64) with a tokenizer, chat
    template, and replies of digits, so the copy task's groups differ in reward and the
    adapter trains."""
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1}
    shape |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}
    shape |= {"max_position_embeddings": MAX_LEN}
    return answer_with_digits(chat_checkpoint(tmp_path_factory.mktemp("digits"), shape))


@pytest.mark.slow
def test_dew_train_lora_starts_its_vllm_server_for_adapters_and_trains_through_it(
    digits_folder, tmp_path
):
    """`dew train --lora --engine vllm` without `--engine-url`: dew starts the server with
    what adapter pushes need (`--enable-lora`, a `--max-lora-rank` at least the run's), each
    batch is drawn under the adapter the update before pushed (`--ahead 0`), and the server's
    log-probs are dew's own base + adapter rescoring (`mismatch/engine`) at float rounding,
    with an adapter that moves them far more than that; the run's folder holds the adapter."""
    from dew.cli import main

    run, rank = tmp_path / "run", 4
    argv = ["train", "--model", str(digits_folder), "--lora", "--lora-rank", str(rank)]
    argv += ["--lora-targets", "q_proj,v_proj,down_proj", "--learning-rate", "0.01"]
    argv += ["--engine", "vllm", "--engine-servers", "1", "--run", str(run), "--ahead", "0"]
    argv += ["--steps", "4", "--tasks", "8", "--batch-size", "4", "--groups", "8"]
    argv += ["--max-tokens", "2", "--eval-every", "0", "--samples", "0"]
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam
        assert main(argv) == 0
    log = (run / "vllm" / "process-0" / "vllm-0.log").read_text()
    (served_rank,) = {int(found) for found in re.findall(r"'max_lora_rank': (\d+)", log)}
    assert "'enable_lora': True" in log and served_rank >= rank
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["updates"] for line in lines] == [1, 2, 3, 4]
    assert [line["push/version"] for line in lines] == [0, 1, 2, 3]
    full = (digits_folder / "model.safetensors").stat().st_size
    assert all(0 < line["push/bytes"] * 10 < full for line in lines), lines
    # Each batch was drawn under the trainer's own version, so each step compares.
    mismatches = [line["mismatch/engine"] for line in lines]
    print(f"mismatch/engine per step {mismatches}")
    assert max(mismatches) <= 1e-6, mismatches
    # The batches after the first were drawn under a trained adapter (B starts at zero), and
    # the run's adapter moves the log-probs far past that bound: a server that left it out
    # would not pass.
    assert any(line["grad_norm"] > 0 for line in lines[:-1]), lines
    model, params = hf.load(digits_folder)
    config, adapter = lora.load_adapter(run / "checkpoints" / "adapter", model)
    assert config == lora.LoRAConfig(rank, 16.0, ("down_proj", "q_proj", "v_proj"))
    adapted = lora.LoRAModel(model, config), {"adapter": adapter, "base": params}
    tokens = jnp.arange(2, 14, dtype=jnp.int32)[None]
    positions, segments = jnp.arange(12, dtype=jnp.int32)[None], jnp.ones_like(tokens)
    base, moved = (
        jax.nn.log_softmax(forward(variables, tokens, positions, segments))
        for forward, variables in ((model, params), adapted)
    )
    assert float(jnp.abs(moved - base).max()) > 1e-3


@pytest.mark.slow
def test_attaching_a_lora_run_to_a_server_of_a_smaller_rank_is_refused_naming_the_flag(
    engine, base, tmp_path
):
    """A run whose adapter's rank is past the server's `--max-lora-rank` is refused as it
    attaches, naming the flags to start the server with, not at its first push."""

    model = lora.LoRAModel(hf.load(base)[0], lora.LoRAConfig(rank=16, alpha=32.0))
    with pytest.raises(VLLMError) as refused:
        VLLMEngine.attach(engine.urls, checkpoint=base, model=model, push_dir=tmp_path)
    assert "rank up to 8, the run's is 16" in str(refused.value)
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in str(refused.value)


def test_a_server_without_lora_is_named_with_the_flags_it_needs():
    """What `/server_info` says of a server started without `--enable-lora` (its LoRA config
    null) and of one that says nothing of LoRA (another server: nothing to say)."""
    said = lora_problem({"vllm_config": {"lora_config": None}}, 4)
    assert said == (
        "it serves no LoRA adapters: start it with --enable-lora --max-lora-rank 8 --max-loras 1"
    )
    assert lora_problem({"vllm_config": {}}, 4) is None
    assert lora_problem({"vllm_config": {"lora_config": {"max_lora_rank": 8}}}, 8) is None


# --- the fleet: run last, as one of them kills the second server ----------------------------


async def _calls(fleet: VLLMEngine, count: int) -> list:
    async with fleet:
        return [await fleet.generate(PROMPT, max_tokens=6, key=key) for key in range(count)]


async def _served_under(fleet: VLLMEngine, adapter, version: int, *, calls: int) -> None:
    """`calls` calls through the fleet report `version` and draw from the base model with
    `adapter`, as transformers + PEFT compute it."""
    for call in await _calls(fleet, calls):
        assert call.version == version
        np.testing.assert_allclose(call.logprobs, peft_logprobs(adapter, call), rtol=0, atol=ATOL)


def _adapter_paths(engine: VLLMEngine, url: str) -> list[str]:
    """The folders of the adapters server `url` holds under the run's adapter name."""
    cards = httpx.get(f"{url}/v1/models").raise_for_status().json()["data"]
    return [card["root"] for card in cards if card["id"] == engine.adapter]


@pytest.mark.slow
async def test_an_adapter_push_loads_the_adapter_into_every_server_of_the_fleet(fleet, adapters):
    await fleet.load_async(adapters[0], 1)
    pushed = [_adapter_paths(fleet, url) for url in fleet.urls]
    assert pushed[0] == pushed[1] and len(pushed[0]) == 1 and pushed[0][0].endswith("adapter-1")
    await _served_under(fleet, adapters[0], 1, calls=4)


@pytest.mark.slow
async def test_a_server_killed_mid_adapter_push_is_left_out_and_the_push_lands_on_the_other(
    fleet, adapters, caplog, monkeypatch
):
    """The second server dies once it is paused, as the push asks it to load the adapter: its
    load fails, it is left out in one line, and the other serves the pushed adapter under the
    pushed version, as a full push does (tests/test_vllm_fleet.py)."""
    victim = fleet.processes[1]
    post = fleet._post_async

    async def dying(client, server, path, **options):
        if path == LOAD_ADAPTER and server.url == victim.url:
            victim.kill()  # its whole process group, as a crash in the middle of the push
        return await post(client, server, path, **options)

    monkeypatch.setattr(fleet, "_post_async", dying)
    with caplog.at_level(logging.WARNING, logger="dew.serve._vllm"):
        await fleet.load_async(adapters[1], 2)
    assert fleet.version == 2
    left_out = [r.getMessage() for r in caplog.records if "is left out" in r.getMessage()]
    assert len(left_out) == 1 and victim.url in left_out[0] and "(1 left)" in left_out[0]
    assert _adapter_paths(fleet, fleet.urls[0])[0].endswith("adapter-2")
    await _served_under(fleet, adapters[1], 2, calls=3)


@pytest.mark.slow
async def test_an_adapter_trained_with_dropout_loads_and_serves_without_it(
    fleet, base, monkeypatch
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
        fleet, "_save", lambda to, pushed: lora.save_adapter(to, pushed["adapter"], adapted.lora)
    )
    await fleet.load_async(variables, 3)
    (held,) = _adapter_paths(fleet, fleet.urls[0])
    assert json.loads((Path(held) / lora.ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.1
    for call in await _calls(fleet, 2):
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
        # Twice the float32 rounding bound: every entry of A and B moved 0.3 makes the logits
        # larger, and their rounding with them (1.0014e-5 seen once in a full suite's run).
        np.testing.assert_allclose(call.logprobs, ours, rtol=0, atol=2 * ATOL)
