"""The KV-cache sampler: sampling distribution, stops, continuation, compilation count.

Two stand-in models honour the KVCache contract exactly like the decoder (write at `index`,
attend by position, padding at -1): `toy_forward`, one attention layer plus a bigram table, and
`fixed_forward`, whose next-token distribution is a known constant. Tests against the real
decoder and transformers are further down.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_hf
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax.models import decoder
from agentgym_jax.models.cache import KVCache, attention_mask, write_rows
from agentgym_jax.models.hf_checkpoint import load_pretrained
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.parallel.mesh import make_mesh
from agentgym_jax.sampling import buckets
from agentgym_jax.sampling.config import SamplingConfig
from agentgym_jax.sampling.sampler import Sampler, SamplerShardings, StopReason, Turn
from agentgym_jax.sampling.step import from_forward

VOCAB, DIM = 32, 16


def toy_params(seed: int = 0, shift: bool = False) -> dict[str, jax.Array]:
    """Random attention weights; `shift=True` makes greedy decoding emit token + 1 (mod VOCAB)."""
    rng = np.random.default_rng(seed)
    params = {
        "q": rng.normal(size=(VOCAB, DIM)),
        "k": rng.normal(size=(VOCAB, DIM)),
        "v": rng.normal(size=(VOCAB, DIM)),
        "out": rng.normal(size=(DIM, VOCAB)),
        "bigram": rng.normal(size=(VOCAB, VOCAB)),
    }
    if shift:
        params["out"] *= 0.01
        params["bigram"] = 20.0 * np.roll(np.eye(VOCAB), 1, axis=1)
    return {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}


def toy_forward(params, tokens, positions, cache: KVCache):
    """One attention layer over the cache (causal by position) plus a bigram table."""
    k = write_rows(cache.k, params["k"][tokens][None, :, None], cache.index)  # [1, B, 1, T, DIM] in
    v = write_rows(cache.v, params["v"][tokens][None, :, None], cache.index)
    new_cache = cache.written(k, v, positions)
    key_positions = new_cache.positions
    scores = jnp.einsum("btd,bsd->bts", params["q"][tokens], k[0, :, 0]) / np.sqrt(DIM)
    scores = jnp.where(attention_mask(positions, key_positions), scores, -1e9)
    mixed = jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v[0, :, 0])
    logits = mixed @ params["out"] + params["bigram"][tokens]
    return logits, new_cache


def toy_cache(batch: int, max_len: int) -> KVCache:
    return KVCache.init(1, batch, max_len, 1, DIM)


def numpy_toy_logits(params, tokens: list[int]) -> np.ndarray:
    """[len, VOCAB] float64 logits of `toy_forward` for one sequence, without a cache (the reference)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    ids = np.asarray(tokens)
    scores = p["q"][ids] @ p["k"][ids].T / np.sqrt(DIM)  # [len, len]
    scores = np.where(np.tril(np.ones_like(scores, bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ p["v"][ids] @ p["out"] + p["bigram"][ids]


def toy_sampler(config: SamplingConfig, max_cache_len: int = 256, **kw) -> Sampler:
    return Sampler(from_forward(toy_forward), toy_cache, config, max_cache_len=max_cache_len, **kw)


@contextlib.contextmanager
def count_compilations():
    """Counts XLA backend compilations (every jit cache miss, eager ops included) in the block.

    jax reports each compilation as a '/jax/core/compile/backend_compile_duration' event through
    `jax.monitoring`; counting those catches recompiles that counting Python traces would miss.
    """
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def numpy_sampling_logprobs(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """float64 log-probs of the sampling distribution (temperature, top-k, nucleus), -inf outside."""
    x = logits.astype(np.float64) / config.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if config.top_k:
        keep[:] = False
        keep[order[: config.top_k]] = True
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if config.top_p < 1.0:
        mass = np.cumsum(probs[order])
        n = int(np.argmax(mass >= config.top_p)) + 1  # smallest prefix reaching top_p
        nucleus = np.zeros_like(keep)
        nucleus[order[:n]] = True
        keep &= nucleus
    y = np.where(keep, x, -np.inf)
    return y - (np.log(np.sum(np.exp(y[keep] - y[keep].max()))) + y[keep].max())


def test_buckets():
    assert buckets.powers_of_two(16, 100) == (16, 32, 64, 100)
    assert buckets.powers_of_two(1, 40, threes=True) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40)
    assert buckets.powers_of_two(128, 1280, threes=True) == (128, 192, 256, 384, 512, 768, 1024, 1280)
    for low, high in [(1, 1024), (16, 4096), (128, 2048), (3, 100), (128, 128)]:  # at most twice the shapes
        plain, threes = buckets.powers_of_two(low, high), buckets.powers_of_two(low, high, threes=True)
        assert set(plain) <= set(threes) and len(threes) <= 2 * len(plain) - 1
    assert buckets.bucket(17, (16, 32, 64)) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket 64"):
        buckets.bucket(65, (16, 32, 64), "chunk length")
    with pytest.raises(ValueError, match="strictly increasing"):
        buckets.check_buckets("batch_buckets", (4, 2))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_sampling_config_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**bad)


def test_logprobs_equal_numpy_filtered_distribution():
    """Sampled ids lie in the filtered support; log-probs match a float64 NumPy recomputation."""
    config = SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=12, top_p=0.8, return_raw_logprobs=True)
    params = toy_params(1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    sampler = toy_sampler(config)
    state = sampler.prefill(params, prompts)
    _, turn = sampler.generate(params, state, jax.random.key(0))
    assert (turn.count == 12).all() and (turn.stop == StopReason.TOKEN_LIMIT).all()
    for row, prompt in enumerate(prompts):
        sampled = turn.tokens[row].tolist()
        reference = numpy_toy_logits(params, prompt + sampled)[len(prompt) - 1 : -1]  # [12, V]
        for step, token in enumerate(sampled):
            expected = numpy_sampling_logprobs(reference[step], config)
            assert np.isfinite(expected[token]), f"row {row} step {step}: {token} outside the filtered support"
            np.testing.assert_allclose(turn.logprobs[row, step], expected[token], atol=2e-5)
            scaled = reference[step] / config.temperature  # unfiltered, at the sampling temperature
            raw = scaled - np.logaddexp.reduce(scaled)
            np.testing.assert_allclose(turn.raw_logprobs[row, step], raw[token], atol=2e-5)


def test_a_repeated_prompt_is_computed_once():
    """Six rows, two distinct prompts (a task's group repeats its prompt): prefill computes 2 rows
    of the 16-token chunk bucket, not 8, and every row's next-token logits are its prompt's
    (float64 NumPy, no cache); a row's slots past its own prompt are empty."""
    params = toy_params(3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3], [1, 2, 3]]
    sampler = toy_sampler(SamplingConfig(max_new_tokens=4))
    state = sampler.prefill(params, prompts)
    assert sampler.work.prompt_tokens_computed == 2 * 16
    assert state.logits.shape[0] == 6  # 6 rows are one batch bucket (2^k and 3 * 2^k)
    for row, prompt in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(state.logits)[row], numpy_toy_logits(params, prompt)[-1], rtol=1e-5, atol=1e-5)
        assert int(state.cache.index[row]) == len(prompt)
        np.testing.assert_array_equal(np.asarray(state.cache.positions)[row, : len(prompt) + 1], [*range(len(prompt)), -1])


def fixed_forward(params, tokens, positions, cache: KVCache):
    """Next-token logits `params [V]` whatever the input; keeps the cache bookkeeping."""
    logits = jnp.broadcast_to(params, (*tokens.shape, params.shape[0]))
    return logits, cache.written(cache.k, cache.v, positions)


def test_top_p_never_samples_outside_the_nucleus():
    probs = np.full(VOCAB, 0.0)
    probs[[7, 3, 20, 11, 5]] = [0.4, 0.3, 0.15, 0.1, 0.04]
    probs[probs == 0] = 0.01 / (VOCAB - 5)
    # mass before token 20 is 0.70 < 0.8, before token 11 it is 0.85: nucleus {7, 3, 20}
    config = SamplingConfig(max_new_tokens=32, top_p=0.8)
    sampler = Sampler(from_forward(fixed_forward), toy_cache, config, max_cache_len=64)
    params = jnp.log(jnp.asarray(probs, jnp.float32))
    state = sampler.prefill(params, [[0]] * 64)
    _, turn = sampler.generate(params, state, jax.random.key(42))
    draws = turn.tokens.ravel()  # 2048 draws
    assert set(np.unique(draws)) <= {7, 3, 20}
    freq = np.array([(draws == t).mean() for t in (7, 3, 20)])
    expected = np.array([0.4, 0.3, 0.15]) / 0.85
    sigma = np.sqrt(expected * (1 - expected) / draws.size)
    assert (np.abs(freq - expected) < 5 * sigma).all(), (freq, expected)
    logprob_of = dict(zip((7, 3, 20), np.log(expected)))
    np.testing.assert_allclose(turn.logprobs.ravel(), [logprob_of[t] for t in draws], atol=1e-5)


def test_top_k_one_equals_greedy():
    params = toy_params(2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    greedy = toy_sampler(SamplingConfig(max_new_tokens=10, temperature=0.0))
    top1 = toy_sampler(SamplingConfig(max_new_tokens=10, temperature=1.3, top_k=1))
    _, a = greedy.generate(params, greedy.prefill(params, prompts), jax.random.key(0))
    _, b = top1.generate(params, top1.prefill(params, prompts), jax.random.key(1))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for row, prompt in enumerate(prompts):  # greedy really is the argmax of the model's logits
        reference = numpy_toy_logits(params, prompt + a.tokens[row].tolist())[len(prompt) - 1 : -1]
        np.testing.assert_array_equal(a.tokens[row], reference.argmax(-1))
    assert (a.logprobs == 0).all() and (b.logprobs == 0).all()  # a point mass


def test_rows_stop_on_end_of_turn_and_limit_independently():
    """Shift model: greedy emits last+1, +2, ... so every row's stop is known in advance."""
    params = toy_params(shift=True)
    config = SamplingConfig(max_new_tokens=8, temperature=0.0, eot_ids=(12, 30), pad_id=0)
    sampler = toy_sampler(config)
    prompts = [[1, 9], [3, 10], [4, 5, 6], [20, 21], [2]]
    state = sampler.prefill(params, prompts)
    state, _ = sampler.append(params, state, [[], [], [], [], []], live=[True, True, True, True, False])
    state, turn = sampler.generate(params, state, jax.random.key(0), limit=[8, 8, 2, 8, 8])
    # row 0: 10, 11, 12 (eot); row 1: 11, 12 (eot); row 2: 7, 8 (limit 2); row 3: 22..29 (limit 8)
    np.testing.assert_array_equal(turn.count, [3, 2, 2, 8, 0])
    np.testing.assert_array_equal(
        turn.stop,
        [StopReason.END_OF_TURN, StopReason.END_OF_TURN, StopReason.TOKEN_LIMIT, StopReason.TOKEN_LIMIT,
         StopReason.NOT_LIVE],
    )
    np.testing.assert_array_equal(turn.tokens[0], [10, 11, 12, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(turn.tokens[1], [11, 12, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(turn.tokens[2], [7, 8, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(turn.tokens[3], np.arange(22, 30))
    np.testing.assert_array_equal(turn.tokens[4], np.zeros(8))
    # Every sampled token is in the cache once, at the next position of its row; padding is -1.
    positions = np.asarray(state.cache.positions)[:5]
    for row, prompt in enumerate(prompts):
        cached = np.sort(positions[row][positions[row] >= 0])
        np.testing.assert_array_equal(cached, np.arange(len(prompt) + turn.count[row]))
    # The limited row resumes where it stopped: a second turn continues 9, 10, 11, 12 (eot).
    state, turn = sampler.generate(params, state, jax.random.key(0), limit=[0, 0, 8, 0, 0])
    np.testing.assert_array_equal(turn.tokens[2, :4], [9, 10, 11, 12])
    assert turn.count.tolist() == [0, 0, 4, 0, 0]


def test_continuation_equals_one_full_forward():
    """Three turns with environment chunks of different lengths give the logits of one full pass."""
    params = toy_params(3)
    config = SamplingConfig(max_new_tokens=6, temperature=1.0, eot_ids=(5,))
    sampler = toy_sampler(config, cache_buckets=(32, 64, 128, 256))
    prompts = [[1, 2, 3], [4, 6, 7, 8, 9, 10, 11], [12], [13, 14]]
    history = [list(p) for p in prompts]
    state = sampler.prefill(params, prompts)
    observations = [[[20, 21], [22], [23, 24, 25, 26, 27], []], [[28, 29, 30], [31, 1], [2], [3]]]
    live = [[True, True, True, True], [True, True, False, True]]  # row 2's episode ends after turn 2
    for turn_index in range(3):
        state, turn = sampler.generate(params, state, jax.random.key(1 + turn_index))
        for row in range(4):
            history[row] += turn.tokens[row, : turn.count[row]].tolist()
        if turn_index == 2:
            break
        state, overflow = sampler.append(params, state, observations[turn_index], live[turn_index])
        assert not overflow.any()
        for row in range(4):
            history[row] += observations[turn_index][row] if live[turn_index][row] else []
    assert turn.count[2] == 0 and turn.stop[2] == StopReason.NOT_LIVE
    # Each row holds its own tokens only (per-row write pointers): 27 at most, the 32 bucket.
    np.testing.assert_array_equal(np.asarray(state.cache.index), [len(h) for h in history])
    assert state.cache.max_len == 32
    assert len({len(h) for h in history}) == 4, history  # rows really are at different positions
    for row in (0, 1, 3):
        expected = numpy_toy_logits(params, history[row])[-1]
        np.testing.assert_allclose(np.asarray(state.logits[row]), expected, rtol=1e-5, atol=1e-5)


def test_cache_overflow_is_a_status_not_a_wrap():
    """max_cache_len=60, per row: a row whose real tokens would pass 60 overflows on append (its
    cache left as it was), another row still appends and decode stops it with CACHE_FULL at 60."""
    params = toy_params(5)
    sampler = toy_sampler(SamplingConfig(max_new_tokens=8, temperature=0.0), max_cache_len=60)
    state = sampler.prefill(params, [[1, 2], [3]])
    state, _ = sampler.generate(params, state, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(state.cache.index), [10, 9])  # own tokens, not 16 + 8
    state, overflow = sampler.append(params, state, [[7] * 51, [8] * 47])  # 61 > 60; 56 fits
    assert overflow.tolist() == [True, False]
    np.testing.assert_array_equal(np.asarray(state.cache.index), [10, 56])
    np.testing.assert_array_equal(np.sort(np.asarray(state.cache.positions)[0])[-10:], np.arange(10))
    assert np.asarray(state.live).tolist() == [False, True]

    state, turn = sampler.generate(params, state, jax.random.key(0))  # 4 slots left in row 1
    assert turn.count.tolist() == [0, 4]
    assert turn.stop.tolist() == [StopReason.NOT_LIVE, StopReason.CACHE_FULL]
    np.testing.assert_array_equal(np.asarray(state.cache.index), [10, 60])
    assert not np.asarray(state.live).any()
    _, turn = sampler.generate(params, state, jax.random.key(0))
    assert turn.count.tolist() == [0, 0] and turn.stop.tolist() == [StopReason.NOT_LIVE] * 2


def test_slots_fill_copy_and_chunks_sample_what_prefill_and_generate_do():
    """The slot path (fill rows, copy a prompt's slots out of a row that went on into the rows
    sharing it, decode in chunks of 3 steps over the active rows gathered from anywhere in the
    slot batch) samples, at temperature 1 with the same per-row seeds, the tokens and log-probs of
    prefill + generate; a row outside the chunk keeps its cache; then an observation filled into
    one row continues it like `append` does."""
    params = toy_params(4)
    config = SamplingConfig(max_new_tokens=7, temperature=1.0, eot_ids=(5,))
    prompts = [[1, 2, 3], [4, 6, 7, 8], [1, 2, 3]]
    seeds = np.array([[0, 0], [1, 0], [2, 0]])
    reference = toy_sampler(config, batch_buckets=(4,), cache_buckets=(16, 32, 64, 256))
    state, want = reference.generate(params, reference.prefill(params, prompts), jax.random.key(9), seeds=seeds)
    state, _ = reference.append(params, state, [[9, 10], [], []], live=[True, False, False])
    want_logits = np.asarray(state.logits)[0]

    sampler = toy_sampler(config, batch_buckets=(2, 4, 8), cache_buckets=(16, 32, 64, 256), fill_buckets=(2,),
                          decode_buckets=(2, 4))
    slots = sampler.init_slots(params, 8)
    index = np.zeros(8, np.int64)
    rows = [1, 4, 7]  # spread over the 8 slot rows; rows 5 and 6 hold tokens but sample nothing
    slots = sampler.fill(params, slots, [5, 4, 6], [prompts[0], prompts[1], [2, 2]], [True, True, True], index)
    prompt_logits = sampler.row_logits(slots, [5])
    index[5] = 3
    slots = sampler.fill(params, slots, [5], [[9, 9]], [False], index)  # row 5's episode goes on
    # Rows 1 and 7 share the prompt [1, 2, 3]: its slots copied out of row 5, its logits from before.
    slots = sampler.copy_prefix(slots, [5, 5], [1, 7], [3, 3], np.concatenate([prompt_logits] * 2))
    np.testing.assert_array_equal(np.asarray(slots.cache.index)[rows + [5, 6]], [3, 4, 3, 5, 2])
    np.testing.assert_array_equal(np.asarray(slots.cache.positions)[7, :4], [0, 1, 2, -1])
    row6 = lambda state: jax.tree.map(lambda x: np.asarray(x)[:, 6] if x.ndim == 5 else np.asarray(x)[6],
                                      (state.cache, state.logits))  # noqa: E731
    idle = row6(slots)
    live = np.zeros(8, bool)
    live[rows] = True
    limit = np.full(8, 7, np.int32)
    seeds8 = np.zeros((8, 2), np.int32)
    seeds8[rows] = seeds
    turn = Turn.start(live, limit, seeds=seeds8)
    index[rows + [5, 6]] = [3, 4, 3, 5, 2]
    tokens = [[] for _ in rows]
    logprobs = [[] for _ in rows]
    while turn.active.any():
        before, gathered = turn.count.copy(), 4 if turn.active.sum() > 2 else 2  # the decode bucket
        work = sampler.work.decode_row_steps
        slots, turn, (chunk, chunk_logprobs, _, _, index) = sampler.decode_chunk(
            params, slots, turn, jax.random.key(9), 3, index
        )
        assert chunk.shape == (8, 3)  # indexed by slot row
        computed = turn.count - before
        assert sampler.work.decode_row_steps - work == gathered * computed.max()
        for i, row in enumerate(rows):
            n = computed[row]
            tokens[i] += chunk[row, :n].tolist()
            logprobs[i] += chunk_logprobs[row, :n].tolist()
        assert computed[6] == 0 and (chunk[6] == config.pad_id).all()
    for i in range(len(rows)):
        assert tokens[i] == want.tokens[i, : want.count[i]].tolist()
        np.testing.assert_allclose(logprobs[i], want.logprobs[i, : want.count[i]], atol=1e-5)
    np.testing.assert_array_equal(turn.stop[rows], want.stop)
    # The row the chunks did not decode is bit for bit what it was.
    for a, b in zip(jax.tree.leaves(idle), jax.tree.leaves(row6(slots))):
        np.testing.assert_array_equal(a, b)
    index = np.asarray(index).astype(np.int64)
    slots = sampler.fill(params, slots, [1], [[9, 10]], [False], index)
    np.testing.assert_allclose(np.asarray(slots.logits)[1], want_logits, rtol=1e-5, atol=1e-5)
    # A row refilled with a shorter prompt (a smaller slot bucket) forgets all its old tokens.
    slots = sampler.fill(params, slots, [4], [list(range(1, 21))], [True], index)  # 20 tokens: bucket 32
    index[4] = 20
    slots = sampler.fill(params, slots, [4], [[3, 4]], [True], index)  # bucket 16
    row = np.asarray(slots.cache.positions)[4]
    np.testing.assert_array_equal(np.sort(row[row >= 0]), [0, 1])
    assert int(np.asarray(slots.cache.index)[4]) == 2


def test_fills_over_the_token_budget_go_in_parts_and_write_the_same_cache():
    """`fill_tokens` bounds the tokens one fill or append computes (what its attention holds grows
    with them), never more rows than the cache has: a fill goes in parts of some rows, the
    turn-batched `append` in pieces of some columns of every row (in place, nothing gathered); the
    parts write the cache and next-token logits of one call over every row."""
    params = toy_params(7)
    config = SamplingConfig(max_new_tokens=4, temperature=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 30, n).tolist() for n in (11, 15, 9, 13, 16)]  # width 16 each
    observations = [rng.integers(1, 30, n).tolist() for n in (13, 16, 12, 15, 14)]  # width 16 each
    kw = dict(batch_buckets=(6,), cache_buckets=(32, 64), fill_buckets=(1, 2, 4, 8), chunk_buckets=(4, 8, 16, 32, 64))
    results = []
    for fill_tokens in (8192, 32):  # one call of every row, then fills of 32 // 16 = 2 rows, appends of 6 x 4 tokens
        sampler = toy_sampler(config, max_cache_len=64, fill_tokens=fill_tokens, **kw)
        filled, fill, appended, append = [], sampler._fill, [], sampler._append
        sampler._fill = lambda slots, *args, fill=fill, filled=filled: filled.append(args[-2].shape) or fill(slots, *args)
        sampler._append = lambda *args, append=append, appended=appended: appended.append(
            (args[-2].shape, args[-1].tolist())) or append(*args)
        slots = sampler.init_slots(params, 5)
        index = np.zeros(6, np.int64)
        slots = sampler.fill(params, slots, [4, 0, 2, 1, 3], prompts, [True] * 5, index)
        index[[4, 0, 2, 1, 3]] = [len(p) for p in prompts]
        slots = sampler.fill(params, slots, [4, 0, 2, 1, 3], observations, [False] * 5, index)
        batched = sampler.prefill(params, prompts)
        batched, _ = sampler.append(params, batched, observations)
        results.append((slots, batched, filled, appended))
    (one, one_batched, whole, whole_append), (parts, parts_batched, split, pieces) = results
    assert whole == [(6, 16)] * 3  # the 5 rows' bucket of 8 capped at the cache's 6 rows
    assert whole_append == [((6, 16), [13, 16, 12, 15, 14, 0])]
    assert split == [(2, 16), (2, 16), (1, 16)] * 3  # fill, fill, prefill in parts of 2 rows
    assert pieces == [((6, 4), [4, 4, 4, 4, 4, 0])] * 3 + [((6, 4), [1, 4, 0, 3, 2, 0])]  # 4 tokens a row at a time
    for a, b in ((one, parts), (one_batched, parts_batched)):
        np.testing.assert_array_equal(np.asarray(a.cache.positions), np.asarray(b.cache.positions))
        np.testing.assert_array_equal(np.asarray(a.cache.index), np.asarray(b.cache.index))
        for x, y in ((a.cache.k, b.cache.k), (a.cache.v, b.cache.v)):  # (the cache's 6th row is padding)
            np.testing.assert_allclose(np.asarray(x)[:, :5], np.asarray(y)[:, :5], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a.logits)[:5], np.asarray(b.logits)[:5], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fill_tokens must be >= 1"):
        toy_sampler(config, fill_tokens=0)


def test_forced_turn_lengths():
    """End-of-turn is masked until the forced length and forced at it; forced 0 leaves a row free."""
    params = toy_params(6)
    sampler = toy_sampler(SamplingConfig(max_new_tokens=12, temperature=1.0, eot_ids=(5,)))
    state = sampler.prefill(params, [[1, 2], [3], [4, 4, 4]])
    _, turn = sampler.generate(params, state, jax.random.key(3), forced=[4, 11, 0])
    assert turn.count[:2].tolist() == [4, 11]
    assert turn.stop[:2].tolist() == [StopReason.END_OF_TURN] * 2
    for row, n in ((0, 4), (1, 11)):
        assert not np.isin(turn.tokens[row, : n - 1], (5,)).any() and turn.tokens[row, n - 1] == 5
        assert turn.logprobs[row, n - 1] == 0.0  # the only choice left: a point mass
    free = turn.tokens[2, : turn.count[2]]  # row 2 stops when it samples an end-of-turn id, if ever
    assert np.isin(free, (5,)).sum() == (turn.stop[2] == StopReason.END_OF_TURN)


def test_bad_input_is_refused():
    sampler = toy_sampler(SamplingConfig(max_new_tokens=4), max_cache_len=64)
    params = toy_params()
    with pytest.raises(ValueError, match="no empty prompt"):
        sampler.prefill(params, [[1], []])
    with pytest.raises(ValueError, match="prompt length 65 exceeds max_cache_len=64"):
        sampler.prefill(params, [[1] * 65])
    state = sampler.prefill(params, [[1], [2]])
    with pytest.raises(ValueError, match="expected 2 chunks"):
        sampler.append(params, state, [[1]])
    with pytest.raises(ValueError, match="expected 2 token limits"):
        sampler.generate(params, state, jax.random.key(0), limit=[1, 2, 3])
    with pytest.raises(ValueError, match="last cache bucket"):
        toy_sampler(SamplingConfig(), max_cache_len=64, cache_buckets=(16, 32))


# ---------------------------------------------------------------------------------------------
# The real decoder, loaded from a random tiny Qwen2 saved by transformers.


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """(transformers model, our config, our params loaded from its save_pretrained folder)."""
    folder = tmp_path_factory.mktemp("qwen2")
    hf_model = tiny_hf.save("qwen2", folder)
    config, params = load_pretrained(folder)
    return hf_model, config, params


def test_greedy_equals_transformers_generate(qwen2):
    """32 greedy tokens on a padded batch (HF left-pads, we right-pad): identical ids, same eos stop."""
    hf_model, config, params = qwen2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (9, 3, 14)]
    width = max(map(len, prompts))
    ids = np.zeros((3, width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's spinning thread pool crawls on a loaded 2-core machine
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0, dtype=torch.long),
            max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=2,
        )
    torch.set_num_threads(threads)
    want = out[:, width:].numpy()
    want = np.pad(want, ((0, 0), (0, 32 - want.shape[1])))  # rows that stopped on eos
    greedy = SamplingConfig(max_new_tokens=32, temperature=0.0, eot_ids=(2,))
    sampler = Sampler.for_decoder(config, greedy, max_cache_len=128)
    _, turn = sampler.generate(params, sampler.prefill(params, prompts), jax.random.key(0))
    np.testing.assert_array_equal(turn.tokens, want)

    # The same on a ("data", "fsdp", "tensor") = 4x1x2 mesh: params by the partition rules (heads
    # and MLP over tensor), rows over data, key/value heads over tensor.
    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    shardings = SamplerShardings.for_mesh(mesh, params, config)
    kv = NamedSharding(mesh, P(None, ("data", "fsdp"), "tensor", None, None))
    assert shardings.cache.k.is_equivalent_to(kv, 5)
    sharded = Sampler.for_decoder(config, greedy, max_cache_len=128, shardings=shardings)
    params = jax.device_put(params, shardings.params)
    assert sharded.batch_buckets[0] == 4
    state, turn = sharded.generate(params, sharded.prefill(params, prompts), jax.random.key(0))
    np.testing.assert_array_equal(turn.tokens, want)
    assert state.cache.k.sharding.is_equivalent_to(kv, 5)
    with pytest.raises(ValueError, match="multiples of the 4 row shards"):
        Sampler.for_decoder(config, greedy, max_cache_len=128, shardings=shardings, batch_buckets=(2, 4))


@pytest.fixture(scope="module")
def turn_sampler(qwen2):
    """One sampler for the multi-turn tests, so they share its compilations."""
    config = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9)
    return Sampler.for_decoder(qwen2[1], config, max_cache_len=512)


def test_decoder_continuation_equals_one_full_forward(qwen2, turn_sampler):
    """Three sampled turns + environment chunks through the cache == one forward over all tokens."""
    _, config, params = qwen2
    sampler = turn_sampler
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (4, 11, 1)]
    history = [list(p) for p in prompts]
    state = sampler.prefill(params, prompts)
    for turn_index in range(3):
        state, turn = sampler.generate(params, state, jax.random.key(turn_index), limit=[8, 3, 5])
        for row in range(3):
            history[row] += turn.tokens[row, : turn.count[row]].tolist()
        if turn_index < 2:
            chunks = [rng.integers(3, config.vocab_size, n).tolist() for n in rng.integers(0, 9, 3)]
            state, _ = sampler.append(params, state, chunks)
            for row in range(3):
                history[row] += chunks[row]
    lengths = np.array([len(h) for h in history])
    tokens = np.zeros((3, lengths.max()), np.int32)
    for row, h in enumerate(history):
        tokens[row, : len(h)] = h
    positions = np.where(np.arange(lengths.max()) < lengths[:, None], np.arange(lengths.max()), -1)
    full, _ = jax.jit(functools.partial(decoder.forward, config=config))(params, tokens, positions.astype(np.int32))
    want = np.asarray(full)[np.arange(3), lengths - 1]
    got = np.asarray(state.logits[:3])
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_ten_turns_after_warm_up_compile_nothing(qwen2, turn_sampler):
    """Warm-up: a 10-turn rollout of 6 episodes, 2 of which end after turn 5 (their rows then drop
    out of the appends and decodes). Then 5 episodes, 1 ending there: a new batch size, new prompt
    and chunk lengths and turn limits in the same buckets of rows, chunks and cache slots (row 0,
    the longest, grows the same way in both): nothing compiles."""
    _, config, params = qwen2
    sampler = turn_sampler

    def rollout(num_rows: int, ending: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        tokens = lambda n: rng.integers(0, config.vocab_size, n).tolist()  # noqa: E731
        prompts = [tokens(16)] + [tokens(rng.integers(1, 17)) for _ in range(num_rows - 1)]
        state = sampler.prefill(params, prompts)
        live = np.ones(num_rows, bool)
        for turn_index in range(10):
            limit = rng.integers(1, 9, num_rows)
            limit[0] = 8
            state, turn = sampler.generate(params, state, jax.random.key(turn_index), limit=limit.tolist())
            np.testing.assert_array_equal(turn.count, np.where(live, limit, 0))
            if turn_index == 4:
                live[num_rows - ending :] = False  # episodes end early
            chunks = [tokens(16)] + [tokens(rng.integers(1, 17)) for _ in range(num_rows - 1)]
            state, overflow = sampler.append(params, state, chunks, live.tolist())
            assert not overflow.any()

    rollout(6, 2, seed=0)
    with count_compilations() as compiled:
        rollout(5, 1, seed=1)
    assert compiled == []


# ---------------------------------------------------------------------------------------------
# The sampler at scale: sharded over a mesh, bf16 weights and cache, a cache that grows in place.


def _three_turns(sampler: Sampler, params, prompts, chunks, seed: int):
    """prefill, then turn / append / turn / append / turn; returns each turn's tokens, log-probs, counts."""
    params = sampler.sampling_params(params)
    state = sampler.prefill(params, prompts)
    turns = []
    for turn_index in range(3):
        state, turn = sampler.generate(params, state, jax.random.key(seed + turn_index))
        turns.append(turn)
        if turn_index < 2:
            state, overflow = sampler.append(params, state, chunks[turn_index])
            assert not overflow.any()
    return state, turns


@pytest.mark.parametrize("temperature, decode", [(0.0, "xla"), (1.0, "xla"), (0.0, "triton")],
                         ids=["greedy", "seeded", "greedy-triton"])
def test_sharded_multi_turn_sampling_equals_one_device(qwen2, temperature, decode):
    """Three turns with environment chunks between them, the cache growing through three buckets:
    on a 2x2x2 mesh (rows over data x fsdp, key/value heads over tensor) the same tokens and
    log-probs as on one device, greedy and seeded (temperature 1, top-p 0.9); and greedy with the
    decode steps on the GPU ragged decode kernel (interpreted here), per shard."""
    _, config, params = qwen2
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 12, 3, 9, 7)]
    chunks = [[rng.integers(3, config.vocab_size, n).tolist() for n in rng.integers(1, 12, 5)] for _ in range(2)]
    sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=0.9)
    kw = dict(max_cache_len=96, cache_buckets=(16, 48, 96), chunk_buckets=(16,))
    one = Sampler.for_decoder(config, sampling, batch_buckets=(8,), **kw)
    _, want = _three_turns(one, params, prompts, chunks, seed=11)

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = SamplerShardings.for_mesh(mesh, params, config)
    kernels = AttentionKernels(decode=decode, interpret=decode != "xla")
    sharded = Sampler.for_decoder(config, sampling, shardings=shardings, kernels=kernels, **kw)
    state, got = _three_turns(sharded, jax.device_put(params, shardings.params), prompts, chunks, seed=11)
    assert state.cache.max_len == 96  # it grew 16 -> 48 -> 96 (each row holding its own tokens only)
    kv = NamedSharding(mesh, P(None, ("data", "fsdp"), "tensor", None, None))
    assert state.cache.k.sharding.is_equivalent_to(kv, 5)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.tokens, w.tokens)
        np.testing.assert_array_equal(g.stop, w.stop)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5, rtol=0)


def test_growing_the_cache_frees_the_old_one(qwen2):
    """After a turn that grows the cache, the smaller buffers are gone (not live beside the new)."""
    _, config, params = qwen2
    sampler = Sampler.for_decoder(
        config, SamplingConfig(max_new_tokens=8, temperature=0.0), max_cache_len=64,
        cache_buckets=(16, 32, 64), chunk_buckets=(16,),
    )
    state = sampler.prefill(params, [list(range(5, 15)), [8]])
    small = state.cache
    assert small.max_len == 16
    state, _ = sampler.generate(params, state, jax.random.key(0))  # row 0 needs 10 + 8 slots: grows to 32
    assert state.cache.max_len == 32
    assert small.k.is_deleted() and small.v.is_deleted() and small.positions.is_deleted()


def test_bf16_sampler_reads_one_bf16_copy_and_keeps_a_bf16_cache(qwen2):
    """Compute in bfloat16 over float32 weights: `sampling_params` makes one bf16 copy (in the
    sampler's param shardings, the value head left out), the KV cache is bf16 and sharded, and a
    float32 sampler over float32 weights reads the weights themselves (no copy)."""
    _, config, params = qwen2
    with_critic = {**params, "value_head": decoder.init_value_head(config, jax.random.key(1))}
    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    shardings = SamplerShardings.for_mesh(mesh, params, config)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.0)
    bf16 = Sampler.for_decoder(config, sampling, max_cache_len=64, dtype=jnp.bfloat16, shardings=shardings)
    copy = bf16.sampling_params(jax.device_put(with_critic, {**shardings.params, "value_head": shardings.replicated}))
    assert set(copy) == set(params)
    for leaf, sharding, original in zip(jax.tree.leaves(copy), jax.tree.leaves(shardings.params), jax.tree.leaves(params)):
        assert leaf.dtype == jnp.bfloat16 and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), np.asarray(original.astype(jnp.bfloat16), np.float32))
    state, turn = bf16.generate(copy, bf16.prefill(copy, [[5, 6, 7], [8, 9]]), jax.random.key(0))
    assert state.cache.k.dtype == state.cache.v.dtype == jnp.bfloat16
    assert state.cache.k.sharding.is_equivalent_to(shardings.cache.k, 5)
    assert turn.count.tolist() == [4, 4]

    f32 = Sampler.for_decoder(config, sampling, max_cache_len=64, dtype=jnp.float32)
    same = f32.sampling_params(with_critic)
    assert set(same) == set(params) and all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params)))
    assert f32.prefill(same, [[5]]).cache.k.dtype == jnp.float32


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_the_jobs_sampler_is_sharded_with_its_cache_in_the_compute_dtype(tmp_path, compute):
    """`setup.make_sampler`: the job's mesh (2x2x2 here), rows and key/value heads sharded, and the
    KV cache in `model.compute_dtype`."""
    from agentgym_jax.models import build_tokenizer as bt
    from agentgym_jax.models.chat import ChatFraming
    from agentgym_jax.models.config import ModelConfig
    from agentgym_jax.models.tokenizer import load_tokenizer
    from agentgym_jax.job import settings, setup
    from configs import quickstart

    config = quickstart.get_config()
    config.model.compute_dtype = compute
    config.mesh.update(dict(data=2, fsdp=2, tensor=2))
    framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp_path, ["go north", "take the key"], 300)))
    model = ModelConfig.small(vocab_size=len(framing.tokenizer))
    sampler = setup.make_sampler(config, model, framing, settings.rollout(config))
    params = sampler.sampling_params(decoder.init_params(model, jax.random.key(0)))
    state = sampler.prefill(params, [[5, 6, 7]])
    assert state.cache.k.dtype == state.cache.v.dtype == jnp.dtype(compute)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(compute)}
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    kv = NamedSharding(mesh, P(None, ("data", "fsdp"), "tensor", None, None))
    assert state.cache.k.sharding.is_equivalent_to(kv, 5)
    assert state.live.shape == (4,)  # the smallest batch bucket: one row per batch shard
