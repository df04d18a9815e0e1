"""Rollout engine: how long the sampler waits on environments, and what continuation saves.

    python bench/rollout.py --env=maze [--tasks=4 --group_size=4 --horizon=6 --rounds=2]

A batch of `tasks x group_size` multi-turn episodes on local servers (started here), sampled by a
tiny random decoder (`ModelConfig.small`, tokenizer built in a tmp dir). Warm-up rounds run until
one compiles nothing (the timed rounds print their compile time, normally 0); they report
- sampler wait fraction: wall time the sampler sat idle waiting on the environments (resets
  included) / wall time of `RolloutEngine.run`, for the default straggler wait and lock-step;
- tokens per turn pushed through the model with KV-cache continuation (every token once: the
  prompt, then each turn's new environment ids and sampled ids) vs re-prefilling the whole
  history before every turn (what a client without continuation does). Real tokens, no padding.
The last line is `summary: sampler_wait_fraction=<w> continuation_token_ratio=<r>` (w for the
default settings; r = continuation tokens / re-prefill tokens, lower is better).

    python bench/rollout.py --workload=ragged [--tasks=32 --group_size=8 --horizon=10 --num_slots=64]

Ragged multi-turn batches, side by side on the same episodes: the turn-batched engine (every
episode a sampler row, each turn waits for the batch's longest; lock-step) against the slot
engine (continuous batching: `--num_slots` rows, decode in chunks of `--decode_chunk` steps over
the rows whose turn is in progress, refill, shared group prompts). Turn lengths are forced (end-of-turn masked until a length drawn
from a fixed heavy-tailed distribution in [5, 512], then forced); observations of drawn lengths
come from a real server (`bench/ragged_env.py`). A tiny random decoder; each engine first runs
`--warmup_tasks` tasks to compile, then the workload timed (compilations left in it are counted
and their time left out of tokens/s). Prints rollout tokens/s (sampled + appended), the
useful fraction (decode row-steps that sampled a token / row-steps computed), KV slots used per
real token, prompt tokens prefilled per real prompt token and the sampler's wait on the
environments. Last line `summary: ragged_speedup=<x> useful_fraction=<u> slots_per_token=<s>`
(slot engine tokens/s over turn-batched tokens/s; u and s of the slot engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import functools
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.envs.launcher import LocalServers  # noqa: E402
from agentgym_jax.envs.pool import EnvPool  # noqa: E402
from agentgym_jax.models import build_tokenizer as bt  # noqa: E402
from agentgym_jax.models import decoder  # noqa: E402
from agentgym_jax.models.chat import ChatFraming  # noqa: E402
from agentgym_jax.models.config import ModelConfig  # noqa: E402
from agentgym_jax.models.tokenizer import load_tokenizer  # noqa: E402
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from agentgym_jax.rollout.trajectory import Trajectory  # noqa: E402
from agentgym_jax.sampling import buckets  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler  # noqa: E402


print = functools.partial(print, flush=True)  # noqa: A001  (progress lines through pipes)


def token_counts(trajectories: list[Trajectory]) -> tuple[int, int, int]:
    """(turns, tokens with continuation, tokens re-prefilling the history every turn)."""
    turns = continuation = reprefill = 0
    for t in trajectories:
        turns += t.num_turns
        if t.turn_spans:
            continuation += t.turn_spans[-1][1]  # every id once, up to the last sampled one
            reprefill += sum(start + (end - start) for start, end in t.turn_spans)  # history + the turn
    return turns, continuation, reprefill


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="default", choices=["default", "ragged"])
    parser.add_argument("--num_slots", type=int, default=64, help="ragged: sampler slots of the slot engine")
    parser.add_argument("--decode_chunk", type=int, default=8, help="ragged: decode steps between refills")
    parser.add_argument("--env", default="maze", choices=["maze", "textcraft"])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--horizon", type=int, default=6)
    parser.add_argument("--max_tokens_per_turn", type=int, default=24)
    parser.add_argument("--max_response_length", type=int, default=4096)
    parser.add_argument("--max_cache_len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per setting (after one warm-up)")
    parser.add_argument("--warmup_tasks", type=int, default=4, help="ragged: tasks of the untimed compile run")
    args = parser.parse_args(argv)
    if args.workload == "ragged":
        return ragged(parser, argv)

    with tempfile.TemporaryDirectory() as tmp:
        framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp, bt.environment_instructions())))
    model_config = ModelConfig.small(vocab_size=len(framing.tokenizer))
    params = decoder.init_params(model_config, jax.random.key(0))
    settings = {
        "default": RolloutConfig(
            group_size=args.group_size, max_tokens_per_turn=args.max_tokens_per_turn,
            max_response_length=args.max_response_length,
        ),
    }
    settings["lock-step"] = dataclasses.replace(settings["default"], straggler_wait_s=None)
    sampler = Sampler.for_decoder(
        model_config, settings["default"].sampling_config(framing), max_cache_len=args.max_cache_len
    )
    task_ids = list(range(args.tasks))
    print(f"{jax.devices()[0].platform}: {args.env}, {args.tasks} tasks x {args.group_size}, horizon "
          f"{args.horizon}, <= {args.max_tokens_per_turn} tokens/turn, model {model_config.num_layers}x"
          f"{model_config.hidden_size}, vocab {model_config.vocab_size}")
    wait_fraction, token_ratio = {}, {}
    compile_s: list[float] = []  # every XLA compilation, so the timed rounds can show they had none
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compile_s.append(seconds)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    with LocalServers([args.env]) as servers:
        for name, config in settings.items():
            with RolloutEngine(sampler, framing, EnvPool(servers.urls[args.env]), None, config) as engine:
                for warm_up in range(3):  # until a round compiles nothing (new cache/chunk buckets)
                    start, compiled = time.monotonic(), len(compile_s)
                    engine.run(params, task_ids, args.horizon, jax.random.key(100 + warm_up), policy_version=0)
                    print(f"[{name}] warm-up round {time.monotonic() - start:.1f} s, "
                          f"{len(compile_s) - compiled} compilations")
                    if len(compile_s) == compiled:
                        break
                compiled = len(compile_s)
                stats, trajectories = [], []
                for r in range(args.rounds):
                    batch = engine.run(params, task_ids, args.horizon, jax.random.key(r), policy_version=0)
                    s = engine.last_stats
                    stats.append(s)
                    trajectories += batch
                    statuses = sorted({t.status.value for t in batch})
                    print(f"[{name}] round {r}: {s.wall_s:.2f} s, {s.turns} turns in {s.sampler_calls} sampler "
                          f"calls, wait {s.sampler_wait_s:.3f} s ({100 * s.wait_fraction:.1f}%), statuses {statuses}")
                wall, wait = sum(s.wall_s for s in stats), sum(s.sampler_wait_s for s in stats)
                turns, continuation, reprefill = token_counts(trajectories)
                wait_fraction[name], token_ratio[name] = wait / wall, continuation / reprefill
                print(f"[{name}] total: wall {wall:.2f} s, sampler busy {sum(s.sampler_busy_s for s in stats):.2f} s "
                      f"({sum(compile_s[compiled:]):.2f} s compiling), waiting {wait:.3f} s "
                      f"= {100 * wait_fraction[name]:.1f}% of wall; {turns} turns, "
                      f"{sum(s.sampler_calls for s in stats)} sampler calls")
                print(f"[{name}] tokens per turn: continuation {continuation / turns:.1f}, re-prefill "
                      f"{reprefill / turns:.1f} (ratio {token_ratio[name]:.3f})")
    print(f"summary: sampler_wait_fraction={wait_fraction['default']:.4f} "
          f"continuation_token_ratio={token_ratio['default']:.4f}")


RAGGED_ENV = "bench.ragged_env:RaggedLengthEnv"


def shared_pointer_slots(trajectories: list[Trajectory], chunk_bucket, horizon: int) -> int:
    """Cache slots one row would span with one write pointer shared by all rows, lock-step (the
    design before per-row pointers): the prompt bucket, then per turn the observation chunk's
    bucket and the longest turn of the batch."""
    slots = chunk_bucket(max(t.turn_spans[0][0] for t in trajectories))
    for k in range(horizon):
        turns = [t.turn_spans[k] for t in trajectories if len(t.turn_spans) > k]
        if not turns:
            break
        if k:
            gaps = [t.turn_spans[k][0] - t.turn_spans[k - 1][1] for t in trajectories if len(t.turn_spans) > k]
            slots += chunk_bucket(max(gaps))
        slots += max(e - s for s, e in turns)
    return slots


def ragged(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    parser.set_defaults(tasks=32, group_size=8, horizon=10, max_tokens_per_turn=512, max_response_length=16384,
                        max_cache_len=8192)
    args = parser.parse_args(argv)
    from bench import ragged_env  # noqa: E402  (the server imports it as bench.ragged_env too)

    with tempfile.TemporaryDirectory() as tmp:
        framing = ChatFraming(load_tokenizer(bt.build_tokenizer(tmp, [ragged_env.RaggedLengthEnv.instruction])))
    # Tiny on purpose: the ratio is the point, and the machine is shared.
    model_config = ModelConfig.small(vocab_size=len(framing.tokenizer), hidden_size=32, intermediate_size=64,
                                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=16384)
    params = decoder.init_params(model_config, jax.random.key(0))
    base = RolloutConfig(group_size=args.group_size, max_tokens_per_turn=args.max_tokens_per_turn,
                         max_response_length=args.max_response_length, straggler_wait_s=None)
    settings = {
        "turn-batched": base,
        "slots": dataclasses.replace(base, num_slots=args.num_slots, decode_chunk=args.decode_chunk),
    }
    turn_lengths = lambda task, sample, turn: ragged_env.draw_length(ragged_env.TURN, task, sample, turn)  # noqa: E731
    task_ids = list(range(args.tasks))
    print(f"{jax.devices()[0].platform}: ragged, {args.tasks} tasks x {args.group_size}, {args.horizon} turns, "
          f"turns and observations of {ragged_env.MIN_LEN}-{ragged_env.MAX_LEN} tokens (lognormal, median "
          f"{ragged_env.MEDIAN}), model {model_config.num_layers}x{model_config.hidden_size}, vocab "
          f"{model_config.vocab_size}, {args.num_slots} slots, decode chunks of {args.decode_chunk}")
    compile_s: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compile_s.append(seconds)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    results = {}
    with LocalServers([RAGGED_ENV]) as servers:
        url = servers.urls[RAGGED_ENV]
        for name, config in settings.items():
            # Few shapes to compile, but fine where padding costs: decode chunks gather the active
            # rows in steps of 8, fills go 1, 4 or 16 rows at a time (grouped by chunk bucket).
            sampler = Sampler.for_decoder(
                model_config, config.sampling_config(framing), max_cache_len=args.max_cache_len,
                batch_buckets=(16, 64, 256), chunk_buckets=(64, 128, 256, 512, 1024), fill_buckets=(1, 4, 16),
                decode_buckets=tuple(range(8, args.num_slots, 8)) + (args.num_slots,),
                cache_buckets=tuple(b for b in (1024, 2048, 4096) if b < args.max_cache_len) + (args.max_cache_len,),
            )
            with RolloutEngine(sampler, framing, EnvPool(url, max_concurrency=256), None, config,
                               turn_lengths=turn_lengths) as engine:
                for tasks in (task_ids[: args.warmup_tasks], task_ids):
                    compiled = len(compile_s)
                    trajectories = engine.run(params, tasks, args.horizon, jax.random.key(7), policy_version=0)
                    s = engine.last_stats
                    print(f"[{name}] {'timed' if tasks is task_ids else 'warm-up'} run, {len(tasks)} tasks: "
                          f"{s.wall_s:.1f} s, {len(compile_s) - compiled} compilations "
                          f"({sum(compile_s[compiled:]):.1f} s)")
                results[name] = (engine.last_stats, trajectories, sum(compile_s[compiled:]), sampler)
    rates = {}
    for name, (s, trajectories, compiling, sampler) in results.items():
        response = sum(len(t.token_ids) - t.turn_spans[0][0] for t in trajectories)
        sampled = sum(sum(t.loss_mask) for t in trajectories)
        real = sum(len(t.token_ids) for t in trajectories)
        rates[name] = response / (s.wall_s - compiling)  # compilations left after the warm-up: not timed
        print(f"[{name}] {response} tokens ({sampled} sampled + {response - sampled} appended) in {s.wall_s:.2f} s, "
              f"{compiling:.2f} s of it compiling: {rates[name]:.0f} tokens/s (without compiling); {s.turns} turns, "
              f"{s.sampler_calls} sampler calls; statuses {sorted({t.status.value for t in trajectories})}")
        print(f"[{name}] useful fraction {s.useful_fraction:.3f} ({s.decode_live_steps} live row-steps / "
              f"{s.decode_row_steps} computed); prompt tokens prefilled per real prompt token "
              f"{s.prompt_tokens_computed / s.prompt_tokens:.3f}; sampler wait {s.sampler_wait_s:.2f} s "
              f"({100 * s.wait_fraction:.1f}% of wall)")
        # The slots the rows' caches spanned when their episodes ended, per token of the
        # trajectories; and what one write pointer shared by all rows would have spanned.
        chunk_bucket = lambda n, sampler=sampler: buckets.bucket(n, sampler.chunk_buckets)  # noqa: E731
        shared = shared_pointer_slots(trajectories, chunk_bucket, args.horizon) * len(trajectories)
        results[name] = (*results[name], s.cache_slots / real)
        print(f"[{name}] KV slots used per real token {s.cache_slots / real:.3f} (one shared write pointer, "
              f"lock-step, would use {shared / real:.2f})")
    a, b = (results[name][1] for name in settings)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    print(f"trajectories identical token for token: {same} of {len(a)}")
    slots = results["slots"][0]
    print(f"summary: ragged_speedup={rates['slots'] / rates['turn-batched']:.3f} "
          f"useful_fraction={slots.useful_fraction:.4f} slots_per_token={results['slots'][4]:.4f}")


if __name__ == "__main__":
    main()
