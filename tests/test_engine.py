"""RolloutServer on a real trio loop and real JAX: log-probs, sampling filters, weight pushes,
cancellation, stops, queueing, and the key/value cache against full recomputation.

Decode steps run in a worker thread, which trio's autojump clock would count as idle, so these
tests run on the real clock and order themselves with events and `wait_all_tasks_blocked`.
Every server shares one config and shape, so the engine compiles once for the whole module.
"""

import functools
import inspect
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import trio
import trio.testing

import dew.serve
from dew import models
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.sessions import Session, Status, check_session, pack
from dew.serve import RolloutServer, _engine, sample

CONFIG = models.TransformerConfig(d_model=32, heads=2, layers=2, d_ff=64, max_len=64)
SLOTS = 4
WIDTH = CONFIG.max_len
FORCED = 7


@functools.cache
def params(seed: int = 0) -> dict:
    return models.init(jax.random.key(seed), CONFIG)


@functools.cache
def forced_params() -> dict:
    """Params under which token FORCED is certain: the final norm outputs ones, and only
    FORCED's unembedding column sees them."""
    forced = jax.tree.map(jnp.array, params())
    forced["ln_f"] = {"scale": jnp.zeros(CONFIG.d_model), "bias": jnp.ones(CONFIG.d_model)}
    forced["unembed"] = jnp.zeros((CONFIG.d_model, CONFIG.vocab)).at[:, FORCED].set(1.0)
    return forced


def server(**kwargs) -> RolloutServer:
    return RolloutServer(CONFIG, kwargs.pop("params", params()), slots=SLOTS, **kwargs)


@jax.jit
def _apply_rows(weights, tokens, segment_ids):
    positions = jnp.broadcast_to(jnp.arange(WIDTH, dtype=jnp.int32), tokens.shape)
    return models.apply(weights, tokens, positions, segment_ids, config=CONFIG)


def full_logits(weights, sequence) -> np.ndarray:
    """`apply`'s logits at each position of one sequence: float32[len, vocab]."""
    tokens = np.zeros((1, WIDTH), np.int32)
    tokens[0, : len(sequence)] = sequence
    segment_ids = (np.arange(WIDTH) < len(sequence)).astype(np.int32)[None]
    return np.asarray(_apply_rows(weights, tokens, segment_ids))[0, : len(sequence)]


def scored_logits(call) -> np.ndarray:
    """`apply`'s logits of each completion token of a call, under `params()`:
    float64[completion, vocab]."""
    logits = full_logits(params(), np.concatenate([call.prompt, call.completion]))
    return logits[len(call.prompt) - 1 : -1].astype(np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def reference_filter(logits, temperature, top_k, top_p):
    """NumPy reference of the sampler: the kept ids and the filtered log-probs of one position."""
    if temperature == 0:
        kept = np.array([np.argmax(logits)])
        return kept, np.where(np.arange(len(logits)) == kept[0], 0.0, -np.inf)
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    order = order[: top_k or len(order)]
    if top_p is not None:
        probs = np.exp(log_softmax(scaled[order]))
        before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        order = order[before < top_p]
    kept = np.sort(order)
    filtered = np.full(len(logits), -np.inf)
    filtered[kept] = scaled[kept] - np.logaddexp.reduce(scaled[kept])
    return kept, filtered


async def idle(engine):
    """Wait until the engine's loop waits for work, so calls started together in one trio batch
    all queue before its next step admits them."""
    await trio.testing.wait_all_tasks_blocked()
    assert engine.stats().active == engine.stats().queued == 0


def assert_valid(*calls):
    check_session(Session(Status.COMPLETED, calls, reward=0.0))


@pytest.mark.medium
async def test_logprobs_equal_the_models_scoring_of_the_sampled_tokens():
    async with server() as engine:
        call = await engine.generate(np.array([5, 9, 200, 31], np.int32), max_tokens=20, key=3)
    assert_valid(call)
    assert len(call.completion) == 20 and call.support is None and call.version == 0
    scored = log_softmax(scored_logits(call))
    expected = scored[np.arange(20), call.completion]
    np.testing.assert_allclose(call.logprobs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 20, None), (1.3, None, 0.8), (0.6, 40, 0.9), (1.0, 1, None), (0.0, None, None)],
)
async def test_filtered_logprobs_and_support_match_a_numpy_reference(temperature, top_k, top_p):
    async with server() as engine:
        call = await engine.generate(
            np.array([1, 2, 3], np.int32),
            max_tokens=16,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            key=11,
        )
    assert_valid(call)
    assert len(call.support) == 16
    for position, logits in enumerate(scored_logits(call)):
        kept, filtered = reference_filter(logits, temperature, top_k, top_p)
        np.testing.assert_array_equal(call.support[position], kept)
        assert call.support[position].dtype == np.int32
        token = call.completion[position]
        np.testing.assert_allclose(call.logprobs[position], filtered[token], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, None), (0.8, 3, 0.9)])
async def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_drawn_from(
    temperature, top_k, top_p
):
    prompt, sampling = np.array([1, 2, 3], np.int32), dict(temperature=temperature, key=5)
    sampling.update(top_k=top_k, top_p=top_p, max_tokens=12)
    async with server() as engine:
        async with trio.open_nursery() as nursery:  # in one step with a call that asks for none
            calls = {}

            async def run(top):
                calls[top] = await engine.generate(prompt, top_logprobs=top, **sampling)

            nursery.start_soon(run, 0)
            nursery.start_soon(run, 4)
    plain, asked = calls[0], calls[4]
    assert plain.top_logprobs is None and len(asked.top_logprobs) == 12
    # Asking changes nothing that is drawn.
    np.testing.assert_array_equal(asked.completion, plain.completion)
    np.testing.assert_array_equal(asked.logprobs, plain.logprobs)
    for position, logits in enumerate(scored_logits(asked)):
        _, filtered = reference_filter(logits, temperature, top_k, top_p)
        drawable = np.flatnonzero(np.isfinite(filtered))
        best = drawable[np.argsort(-filtered[drawable], kind="stable")][:4]
        ids, values = asked.top_logprobs[position]
        assert ids.dtype == np.int32 and values.dtype == np.float32
        np.testing.assert_array_equal(ids, best)  # at most the tokens it can draw
        np.testing.assert_allclose(values, filtered[best], rtol=1e-5, atol=1e-4)
        assert asked.logprobs[position] <= values[0] + 1e-6


@pytest.mark.parametrize(("temperature", "top_k"), [(0.5, None), (1.6, 12), (1.0, None)])
async def test_the_objective_at_the_sampling_temperature_rescores_the_engines_logprobs(
    temperature, top_k
):
    """Behaviour (the engine's) and proximal (the trainer's, over packed rows) log-probs of the
    same weights agree when the objective knows the sampling temperature; then the behaviour
    importance is 1, as it must be for a rollout that is not stale."""
    async with server() as engine:
        calls = [
            await engine.generate(
                np.array([3, 1, 4, 1 + i], np.int32),
                max_tokens=10,
                temperature=temperature,
                top_k=top_k,
                key=i,
            )
            for i in range(4)
        ]
    group = [Session(Status.COMPLETED, (call,), reward=float(i)) for i, call in enumerate(calls)]
    packed = pack(
        [group], width=WIDTH, rows=1, support_capacity=None if top_k is None else 4 * 10 * 12
    )
    assert packed.packed == (0,)
    trained = packed.batch["loss_mask"] > 0
    objective = GRPOObjective(models.model(CONFIG), temperature=temperature)
    proximal = np.asarray(objective.packed_log_probs(params(), packed.batch))
    behavior = packed.batch["behavior_logprobs"]
    np.testing.assert_allclose(proximal[trained], behavior[trained], rtol=1e-5, atol=1e-4)
    if temperature != 1.0:
        # An objective that ignored the temperature would see a mismatch that is not staleness.
        untempered = GRPOObjective(models.model(CONFIG)).packed_log_probs(params(), packed.batch)
        assert np.abs(np.asarray(untempered)[trained] - behavior[trained]).max() > 0.1


def test_sample_matches_the_reference_under_ties_and_wide_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    logits[0, :10] = 20.0
    temperature = np.array([1.0, 0.5, 2.0, 0.0, 1.0, 0.8], np.float32)
    top_k = np.array([5, 50, 3, 50, 50, 10], np.int32)
    top_p = np.array([np.inf, 0.5, 0.95, np.inf, 0.3, 0.7], np.float32)
    keys = np.stack([jax.random.key_data(jax.random.PRNGKey(i)) for i in range(6)])
    tokens, logprobs, kept = jax.jit(sample)(
        logits, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys
    )
    for row in range(6):
        want_kept, filtered = reference_filter(
            logits[row].astype(np.float64), temperature[row], top_k[row], top_p[row]
        )
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(kept[row])), want_kept)
        assert int(tokens[row]) in want_kept
        np.testing.assert_allclose(logprobs[row], filtered[int(tokens[row])], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(kept[0])), np.arange(5))


def test_sample_draws_each_kept_token_at_its_filtered_probability():
    """Over many keys, each token's share of the draws is its probability under the filtered
    distribution (within five standard errors), and a filtered-out token is never drawn."""
    rows = 40_000
    logits = np.tile(np.array([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]], np.float32), (rows, 1))
    keys = np.stack([np.arange(rows, dtype=np.uint32), np.full(rows, 7, np.uint32)], axis=1)
    tokens, _, _ = jax.jit(sample)(
        logits,
        temperature=np.full(rows, 0.8, np.float32),
        top_k=np.full(rows, 4, np.int32),
        top_p=np.full(rows, np.inf, np.float32),
        keys=keys,
    )
    kept, filtered = reference_filter(logits[0].astype(np.float64), 0.8, 4, None)
    probability = np.exp(filtered)
    share = np.bincount(np.asarray(tokens), minlength=6) / rows
    assert set(np.flatnonzero(share)) == set(kept)
    error = np.sqrt(probability * (1 - probability) / rows)
    assert np.all(np.abs(share - probability) <= 5 * error + 1e-12), (share, probability)


async def test_the_server_keeps_its_own_copy_of_pushed_weights():
    """The trainer may delete or donate its arrays once load returns."""
    pushed = jax.tree.map(jnp.array, forced_params())
    async with server() as engine:
        engine.load(pushed, version=1)
        for leaf in jax.tree.leaves(pushed):
            leaf.delete()
        call = await engine.generate(np.array([1, 2], np.int32), max_tokens=3, key=0)
    assert call.version == 1
    np.testing.assert_array_equal(call.completion, [FORCED] * 3)


async def test_a_server_built_without_a_copy_serves_the_callers_arrays():
    """`copy=False` (a held-out evaluation's engine, between a trainer's updates) holds no
    second copy of the weights, and draws what a copying server draws."""
    given = jax.tree.map(jnp.array, forced_params())
    prompt = np.array([1, 2], np.int32)
    async with RolloutServer(CONFIG, given, slots=2, copy=False) as engine:
        assert all(
            served is leaf
            for served, leaf in zip(
                jax.tree.leaves(engine._params), jax.tree.leaves(given), strict=True
            )
        )
        call = await engine.generate(prompt, max_tokens=3, key=0)
    async with RolloutServer(CONFIG, given, slots=2) as engine:
        assert not set(map(id, jax.tree.leaves(engine._params))) & set(
            map(id, jax.tree.leaves(given))
        )
        copied = await engine.generate(prompt, max_tokens=3, key=0)
    np.testing.assert_array_equal(call.completion, copied.completion)
    np.testing.assert_array_equal(call.completion, [FORCED] * 3)
    with pytest.raises(TypeError, match="copy must be a bool, got 'no'"):
        RolloutServer(CONFIG, given, copy="no")


async def test_a_push_between_steps_frees_the_weights_it_replaces_at_once():
    """An engine with no step under way serves pushed weights at once and lets its old ones go,
    rather than holding both until its next step: a trainer pushes just before its update,
    when an engine that has finished its rollouts would hold two copies through the update's
    peak (issue 42: SmolLM2-135M's 0.5 GiB)."""
    async with server() as engine:
        await idle(engine)
        served = [weakref.ref(leaf) for leaf in jax.tree.leaves(engine._params)]
        engine.load(forced_params(), version=1)
        assert [ref() for ref in served] == [None] * len(served)
        assert engine.version == 1
        call = await engine.generate(np.array([1, 2], np.int32), max_tokens=3, key=0)
    assert call.version == 1
    np.testing.assert_array_equal(call.completion, [FORCED] * 3)


async def test_a_weight_push_changes_later_tokens_and_the_call_keeps_its_start_version():
    async with server() as engine, trio.open_nursery() as nursery:
        calls = []

        async def long_call():
            calls.append(await engine.generate(np.array([4, 4], np.int32), max_tokens=50, key=0))

        nursery.start_soon(long_call)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.stats().active == 1
        engine.load(forced_params(), version=1)
        assert engine.version == 1
        after = await engine.generate(np.array([4, 4], np.int32), max_tokens=5, key=1)
    (call,) = calls
    assert_valid(call, after)
    assert call.version == 0 and after.version == 1
    np.testing.assert_array_equal(after.completion, [FORCED] * 5)
    swapped = int(np.argmax(call.logprobs > -1e-4))
    assert 1 <= swapped <= 40
    old = log_softmax(scored_logits(call))[np.arange(swapped), call.completion[:swapped]]
    np.testing.assert_allclose(call.logprobs[:swapped], old, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(call.completion[swapped:], FORCED)
    np.testing.assert_allclose(call.logprobs[swapped:], 0.0, atol=1e-4)


async def test_cancelling_a_running_call_frees_its_slot_for_a_queued_one():
    prompt = np.array([8, 8, 8], np.int32)
    async with server() as engine, trio.open_nursery() as nursery:
        cancelled = trio.CancelScope()
        finished = []
        await idle(engine)

        async def cancellable():
            with cancelled:
                await engine.generate(prompt, max_tokens=60, key=0)
            finished.append(cancelled.cancelled_caught)

        nursery.start_soon(cancellable)
        for key in range(1, SLOTS):
            nursery.start_soon(functools.partial(engine.generate, prompt, max_tokens=60, key=key))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(functools.partial(engine.generate, prompt, max_tokens=2, key=10))
        await trio.testing.wait_all_tasks_blocked()
        assert engine.stats().active == SLOTS and engine.stats().queued == 1
        cancelled.cancel(reason="test")
        queued = await engine.generate(prompt, max_tokens=2, key=11)
        stats = engine.stats()
        assert stats.active == SLOTS - 1, "the long calls finished before the queued ones ran"
        nursery.cancel_scope.cancel(reason="test over")
    assert finished == [True]
    assert len(queued.completion) == 2


async def test_cancelling_a_queued_call_leaves_the_queue():
    prompt = np.array([8, 8, 8], np.int32)
    async with server() as engine, trio.open_nursery() as nursery:
        await idle(engine)
        for key in range(SLOTS):
            nursery.start_soon(functools.partial(engine.generate, prompt, max_tokens=30, key=key))
        await trio.testing.wait_all_tasks_blocked()
        queued = []

        async def cancel_when_queued(scope):
            await trio.testing.wait_all_tasks_blocked()
            queued.append(engine.stats().queued)
            scope.cancel(reason="test")

        with trio.CancelScope() as scope:
            nursery.start_soon(cancel_when_queued, scope)
            await engine.generate(prompt, max_tokens=30, key=9)
        assert scope.cancelled_caught and queued == [1]
        stats = engine.stats()
        assert (stats.active, stats.queued) == (SLOTS, 0)
        nursery.cancel_scope.cancel(reason="test over")


async def test_stop_tokens_max_tokens_and_max_len_end_the_completion():
    prompt = np.array([3, 1, 4], np.int32)
    async with server(params=forced_params()) as engine:
        stopped = await engine.generate(prompt, max_tokens=10, stop=(FORCED,))
        counted = await engine.generate(prompt, max_tokens=6)
        capped = await engine.generate(np.full(60, 2, np.int32), max_tokens=50)
    np.testing.assert_array_equal(stopped.completion, [FORCED])
    np.testing.assert_array_equal(counted.completion, [FORCED] * 6)
    assert len(capped.prompt) + len(capped.completion) == CONFIG.max_len
    async with server() as engine:
        low = tuple(range(130))
        calls = [await engine.generate(prompt, max_tokens=40, stop=low, key=k) for k in range(4)]
    for call in calls:
        assert call.completion[-1] in low
        assert not np.isin(call.completion[:-1], low).any()
    assert_valid(stopped, counted, capped, *calls)


async def test_32_concurrent_calls_complete_and_each_scores_as_if_alone():
    calls = {}
    async with server() as engine, trio.open_nursery() as nursery:

        async def run(index):
            prompt = np.arange(1 + index % 5, dtype=np.int32) + index
            calls[index] = await engine.generate(prompt, max_tokens=4 + index % 7, key=index)

        for index in range(32):
            nursery.start_soon(run, index)
    assert sorted(calls) == list(range(32))
    assert_valid(*calls.values())
    for index, call in calls.items():
        assert len(call.completion) == 4 + index % 7
        scored = log_softmax(scored_logits(call))
        expected = scored[np.arange(len(call.completion)), call.completion]
        np.testing.assert_allclose(call.logprobs, expected, rtol=1e-5, atol=1e-5)


async def test_a_keyed_call_alone_is_reproducible_and_keys_differ():
    prompt = np.array([7, 7, 7], np.int32)
    async with server() as engine:
        first = await engine.generate(prompt, max_tokens=12, top_p=0.95, key=5)
        again = await engine.generate(prompt, max_tokens=12, top_p=0.95, key=5)
        other = await engine.generate(prompt, max_tokens=12, top_p=0.95, key=6)
    np.testing.assert_array_equal(first.completion, again.completion)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    assert not np.array_equal(first.completion, other.completion)


async def test_requests_of_one_shape_compile_the_decode_step_once():
    async with server() as engine:
        await engine.generate(np.array([1, 2], np.int32), max_tokens=3, key=0)
        compiled = _engine._decode_step._cache_size()
        await engine.generate(np.array([9, 8, 7, 6], np.int32), max_tokens=5, top_k=3, key=1)
        await engine.generate(np.array([5], np.int32), max_tokens=4, temperature=0.0)
    assert _engine._decode_step._cache_size() == compiled


def test_key_value_cache_decoding_equals_full_recomputation():
    weights = params()
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, CONFIG.vocab, size=n).astype(np.int32) for n in (12, 9, 15)]
    prompt_lengths = (5, 3, 7)
    prefill = jax.jit(functools.partial(models.prefill, config=CONFIG))
    decode = jax.jit(functools.partial(models.decode, config=CONFIG))
    cache = models.init_cache(CONFIG, slots=3, max_len=WIDTH)
    for slot, (sequence, length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        padded = np.zeros(8, np.int32)
        padded[:length] = sequence[:length]
        cache, prompt_logits = prefill(weights, cache, padded, np.int32(slot))
        full = full_logits(weights, sequence)
        np.testing.assert_allclose(prompt_logits[:length], full[:length], rtol=1e-5, atol=1e-5)
    position = np.array(prompt_lengths, np.int32)
    for _ in range(5):
        tokens = np.array([s[p] for s, p in zip(sequences, position, strict=True)], np.int32)
        cache, logits = decode(weights, cache, tokens, position)
        for slot, sequence in enumerate(sequences):
            full = full_logits(weights, sequence)
            np.testing.assert_allclose(logits[slot], full[position[slot]], rtol=1e-5, atol=1e-5)
        position = position + 1


async def test_leaving_the_server_fails_calls_still_waiting_on_it():
    errors = []

    async def waiting(engine, started):
        started.set()
        try:
            await engine.generate(np.array([1], np.int32), max_tokens=60)
        except RuntimeError as error:
            errors.append(str(error))

    async with trio.open_nursery() as nursery:
        async with server() as engine:
            started = trio.Event()
            nursery.start_soon(waiting, engine, started)
            await started.wait()
            await trio.testing.wait_all_tasks_blocked()
    assert errors == ["RolloutServer stopped before the call finished"]


async def test_an_error_in_the_body_leaves_the_server_as_itself():
    with pytest.raises(KeyError, match="body"):
        async with server():
            raise KeyError("body")


async def test_generate_needs_the_running_server():
    with pytest.raises(RuntimeError, match="async with"):
        await server().generate(np.array([1], np.int32), max_tokens=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": np.array([], np.int32)}, "prompt must hold 1 to max_len - 1 = 63"),
        ({"prompt": np.zeros(64, np.int32)}, "got 64"),
        ({"prompt": np.array([1.0])}, "prompt must be 1-D integer"),
        ({"prompt": np.array([260])}, r"prompt ids must be in \[0, 260\)"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
        ({"top_p": 0.0}, r"top_p must be within \(0, 1\], got 0.0"),
        ({"stop": (300,)}, "stop ids must be < vocab 260"),
        ({"key": -1}, "key must be an int >= 0, got -1"),
        ({"top_logprobs": -1}, "top_logprobs must be an int >= 0, got -1"),
        ({"top_logprobs": 21}, "top_logprobs must be <= 20, got 21"),
    ],
)
async def test_generate_names_the_bad_argument(kwargs, match):
    arguments = {"prompt": np.array([1, 2], np.int32), "max_tokens": 4, **kwargs}
    async with server() as engine:
        with pytest.raises(ValueError, match=match):
            await engine.generate(arguments.pop("prompt"), **arguments)


def test_construction_and_load_name_the_bad_argument():
    with pytest.raises(ValueError, match="slots must be an int >= 1, got 0"):
        RolloutServer(CONFIG, params(), slots=0)
    with pytest.raises(ValueError, match="max_len must be <= model.max_len 64, got 65"):
        RolloutServer(CONFIG, params(), max_len=65)
    engine = server()
    wrong = jax.tree.map(jnp.array, params())
    wrong["blocks"][1]["up"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match=r"variables\['blocks'\]\[1\]\['up'\] must be float32"):
        engine.load(wrong, version=1)
    with pytest.raises(ValueError, match="version must be an int >= 0, got -1"):
        engine.load(params(), version=-1)
    assert engine.version == 0


def test_a_push_checks_shapes_and_dtypes_off_the_leaves_without_tracing(monkeypatch):
    engine = server()

    def traced(*args, **kwargs):
        raise AssertionError("load traced the pushed variables")

    # The trainer pushes every step: a trace per push would cost more than the check itself.
    monkeypatch.setattr(jax, "eval_shape", traced)
    # NumPy float64 leaves are what JAX would hold as float32 (x64 off): accepted, as JAX does.
    engine.load(jax.tree.map(lambda leaf: np.asarray(leaf, np.float64), params()), version=1)
    wrong = jax.tree.map(np.asarray, params())
    wrong["embed"] = wrong["embed"].astype(np.int32)
    with pytest.raises(
        ValueError, match=r"variables\['embed'\] must be float32\[260, 32\], got int32"
    ):
        engine.load(wrong, version=2)
    assert engine.version == 1


def test_the_public_surface_keeps_its_signatures():
    # ServedSource joined dew.serve (it was dew.train's, which still re-exports it).
    assert set(dew.serve.__all__) == {
        "CallFailed",
        "chat_template",
        "EngineStats",
        "RolloutServer",
        "Sampling",  # an engine's setting, from dew.serve._sampling (dew.envs re-exports it)
        "ServedSource",
        "sample",
        "tokenizer",
    }
    generate = inspect.signature(RolloutServer.generate).parameters
    assert list(generate) == [
        "self",
        "prompt",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "stop",
        "key",
        "top_logprobs",
    ]
    defaults = [generate[name].default for name in list(generate)[3:]]
    assert defaults == [1.0, None, None, (), None, 0]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(generate.values())[2:])
    init = inspect.signature(RolloutServer.__init__).parameters
    assert {name: p.default for name, p in init.items() if p.kind is p.KEYWORD_ONLY} == {
        "slots": 32,
        "max_len": None,
        "version": 0,
        "seed": 0,
        "tokenizer": dew.serve.tokenizer.BYTES,
        "copy": True,
    }
    assert list(init)[:3] == ["self", "model", "params"]
    assert list(inspect.signature(RolloutServer.load).parameters) == [
        "self",
        "variables",
        "version",
    ]


async def test_a_call_tells_its_rollout_the_version_it_starts_under_once_it_has_a_slot():
    """Issue 46 item 4 on dew's own engine: every slot busy at version 0, a call queues; a push
    of version 1 lands while it waits; once a slot frees it starts under 1, and its rollout's
    progress says so (note_progress(version=1)): the scheduler counts that rollout's lag from 1,
    not from the 0 it was submitted under. The running calls said 0 as they started."""
    from dew.objectives.rl._session import track_progress

    prompt = np.array([8, 8, 8], np.int32)
    progress = {}
    async with server() as engine, trio.open_nursery() as nursery:
        await idle(engine)
        running = [trio.CancelScope() for _ in range(SLOTS)]

        async def rollout(name: str, max_tokens: int, key: int, scope: trio.CancelScope):
            progress[name] = track_progress()
            with scope:
                await engine.generate(prompt, max_tokens=max_tokens, key=key)

        for key in range(SLOTS):
            nursery.start_soon(rollout, f"running {key}", 60, key, running[key])
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(rollout, "queued", 2, SLOTS, trio.CancelScope())
        await trio.testing.wait_all_tasks_blocked()
        assert engine.stats().queued == 1
        assert progress["queued"].oldest is None  # no slot yet: nothing said
        engine.load(params(1), version=1)
        for scope in running:
            scope.cancel(reason="free the slots")
    assert {progress[f"running {key}"].oldest[1] for key in range(SLOTS)} == {0}
    assert progress["queued"].oldest[1] == 1
    assert progress["queued"].calls == 1


async def test_the_cache_holds_the_blocks_its_calls_reach_and_one_block_when_idle():
    """A call past the first block (32 positions) adds the next while it runs, the engine lets
    it go once idle, and calls running across the change score as if alone."""
    reached = set()
    calls = {}
    async with server() as engine:
        assert engine.stats().cache_positions == 32  # of max_len 64

        async def run(index, prompt_length, max_tokens):
            prompt = (np.arange(prompt_length, dtype=np.int32) * 7 + index) % CONFIG.vocab
            calls[index] = await engine.generate(prompt, max_tokens=max_tokens, key=index)

        async def watch():
            while True:
                reached.add(engine.stats().cache_positions)
                await trio.sleep(0.001)  # a sample of what each step held, not an ordering

        async with trio.open_nursery() as watching:
            watching.start_soon(watch)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, 0, 4, 10)  # within the first block
                nursery.start_soon(run, 1, 20, 30)  # past it while decoding
                nursery.start_soon(run, 2, 40, 3)  # its prompt past it
            watching.cancel_scope.cancel()
        await idle(engine)
        assert engine.stats().cache_positions == 32
    assert reached == {32, 64}
    assert_valid(*calls.values())
    for call in calls.values():
        scored = log_softmax(scored_logits(call))
        expected = scored[np.arange(len(call.completion)), call.completion]
        np.testing.assert_allclose(call.logprobs, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.medium
def test_a_server_of_a_long_context_holds_one_block_of_its_cache_until_calls_reach_further():
    """At 4,096 positions a slot, 32 slots of the test's model would hold 64 MiB of keys and
    values from the start; the engine holds the first block's 0.5 MiB."""
    config = models.TransformerConfig(d_model=32, heads=2, layers=2, d_ff=64, max_len=4096)
    engine = RolloutServer(config, models.init(jax.random.key(0), config), slots=32)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(engine._cache))
    whole = jax.eval_shape(lambda: models.init_cache(config, slots=32, max_len=4096))
    assert engine.stats().cache_positions == 32
    assert held * 128 == sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(whole))
