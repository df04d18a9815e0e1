"""An RL step's scoring and update over rows of mixed lengths: padded to the longest
(`algo.length_buckets=1`) against parts grouped by length, each run at its own bucket
(`--buckets`), side by side; with `--drop`, some groups train nothing (dynamic sampling left them
out), and grouped, their parts are not run at all.

    python bench/length_buckets.py                        # 16 rows of 256-2048 tokens, 4 micro-batches, 3 buckets
    python bench/length_buckets.py --drop 0.5             # half the groups of 4 left out
    python bench/length_buckets.py --seq 1024 --rounds 2  # a quick look

Both run the same jitted `prepare` (policy and reference log-probs) and `rl_update` (`ppo_epochs`
1, one mini-batch of `--micro` micro-batches) on the same batch, alternately, best of `--rounds`;
the parameters they reach are compared too (the grouping is exact: the largest difference is
printed). Row lengths are drawn uniformly from [seq / 8, seq] (an RL step's episodes, some ending
early, some at the horizon). Last line: `summary: length_buckets_speedup=<padded s / grouped s,
prepare + update> length_fraction=<positions the update ran>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from train_step import bench_model, best_seconds, random_batch  # noqa: E402

from agentgym_jax.models.decoder import init_params  # noqa: E402
from agentgym_jax.train.state import TrainState  # noqa: E402
from agentgym_jax.train.scoring import Forward  # noqa: E402
from agentgym_jax.train.steps import Batching, RLSpec, UpdateConfig, make_step_fns  # noqa: E402


def ragged(batch, seed: int = 1):
    """`batch` with row b cut to a length drawn from [seq / 8, seq] (right-padded, position -1)."""
    rows, seq = batch.tokens.shape
    lengths = np.random.default_rng(seed).integers(seq // 8, seq + 1, rows)
    real = np.arange(seq)[None] < lengths[:, None]
    mask = batch.loss_mask * real
    rewards = np.zeros_like(batch.token_rewards)
    rewards[np.arange(rows), lengths - 1] = batch.scores
    return batch.replace(positions=np.where(real, batch.positions, -1), loss_mask=mask, token_rewards=rewards), lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--buckets", type=int, default=3, help="algo.length_buckets of the grouped update")
    parser.add_argument("--drop", type=float, default=0.0, help="share of the groups of 4 rows that train nothing")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model = bench_model(args.layers, args.hidden, args.vocab)
    padded = UpdateConfig(Forward(model), Batching(num_microbatches=args.micro), RLSpec(kl_coef=0.001))
    grouped = dataclasses.replace(padded, batching=Batching(num_microbatches=args.micro, length_buckets=args.buckets))
    batch, lengths = ragged(random_batch(args.batch, args.seq, args.vocab, group_size=4))
    dropped = np.random.default_rng(2).permutation(args.batch // 4)[: round(args.drop * args.batch / 4)]
    batch = batch.replace(loss_mask=np.where(np.isin(batch.group_ids, dropped)[:, None], 0.0, batch.loss_mask))
    params = init_params(model, jax.random.PRNGKey(0))

    tx = optax.adamw(1e-6)  # one optimizer object: it is a static field of the state (a new one recompiles)
    fresh = lambda: TrainState.create(jax.tree.map(jnp.copy, params), tx, jax.random.PRNGKey(1))  # noqa: E731
    runs = {}  # (fresh copies: the update donates the state)
    for name, config in (("padded", padded), ("grouped", grouped)):
        fns = make_step_fns(config)
        rl_batch, prep_metrics = fns.prepare(params, params, batch)  # compiles
        state, metrics = fns.rl_update(fresh(), rl_batch)  # compiles
        runs[name] = dict(fns=fns, rl_batch=rl_batch, params=state.params, fraction=float(metrics["length_fraction"]),
                          score_fraction=float(prep_metrics["score_length_fraction"]))
    seconds = {(name, part): float("inf") for name in runs for part in ("prepare", "update")}
    for _ in range(args.rounds):  # alternate, so that load on the machine hits both alike
        for name, run in runs.items():
            fns, state = run["fns"], fresh()
            seconds[name, "prepare"] = min(seconds[name, "prepare"],
                                           best_seconds(lambda: fns.prepare(params, params, batch)[1], 1))
            seconds[name, "update"] = min(seconds[name, "update"],
                                          best_seconds(lambda: fns.rl_update(state, run["rl_batch"])[1], 1))
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(abs(a - b).max()), runs["padded"]["params"],
                                            runs["grouped"]["params"])))
    total = {name: seconds[name, "prepare"] + seconds[name, "update"] for name in runs}
    print(f"qwen2 L={args.layers} d={args.hidden} vocab={args.vocab}; {args.batch} rows of {lengths.min()}-"
          f"{lengths.max()} tokens (mean {lengths.mean():.0f}) padded to {args.seq}, {len(dropped)} of "
          f"{args.batch // 4} groups of 4 training nothing; {args.micro} micro-batches\n")
    print("| step | length_buckets | positions scored | positions updated | prepare s | update s | both s |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, config in (("padded", padded), ("grouped", grouped)):
        run = runs[name]
        print(f"| {name} | {config.length_buckets} | {run['score_fraction']:.3f} | {run['fraction']:.3f} | "
              f"{seconds[name, 'prepare']:.3f} | {seconds[name, 'update']:.3f} | {total[name]:.3f} |")
    print(f"\nlargest parameter difference after one update: {diff:.2e}")
    print(f"summary: length_buckets_speedup={total['padded'] / total['grouped']:.2f} "
          f"length_fraction={runs['grouped']['fraction']:.3f}")


if __name__ == "__main__":
    main()
