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
    parser.add_argument("--env", default="maze", choices=["maze", "textcraft"])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--horizon", type=int, default=6)
    parser.add_argument("--max_tokens_per_turn", type=int, default=24)
    parser.add_argument("--max_response_length", type=int, default=4096)
    parser.add_argument("--max_cache_len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per setting (after one warm-up)")
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    main()
