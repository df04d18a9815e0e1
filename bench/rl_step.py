"""One GRPO step of the SmolLM2 TextCraft recipe: the update as today's main runs it, plain rows,
a group's shared prefix computed once, and log-probs only where the loss reads them, side by
side; and the whole RL step (rollout + update) before and after.

    python bench/rl_step.py                              # SmolLM2-135M, the recorded groups, rollout too
    python bench/rl_step.py --no-rollout --rounds 1      # the update only
    python bench/rl_step.py --no-rollout --variants shared+gathered,shared+gathered+even   # main and these
    python bench/rl_step.py --record runs/tc/trajectories.jsonl   # re-record the groups from a run

The batch: 4 tasks x 6 samples as `configs/textcraft_smollm.py` trains them. Their structure is
recorded from the recipe's own RL steps (`bench/data/textcraft_smollm_steps.json`: per row its
length, the prefix it shares with its group, and where its policy tokens are), and rebuilt with
random token ids (what is computed depends on lengths, shared prefixes and loss positions, not on
the ids). Every variant runs `prepare` (KL on: the reference's scoring pass, and `main`'s also
the policy's; this tree skips the policy's where nothing reads it before the update, as in the
recipe's one on-policy update: `UpdateConfig.scores_policy`) and `rl_update` with the recipe's
optimizer settings:

- `main`: the update of `--baseline` (default: main before issue 43) run from a git worktree in a
  subprocess, plain rows, 8 micro-batches of 3 rows, 3 length buckets: the recipe as it was;
- `plain`: this tree, the same settings;
- `shared`: each group's 6 rows as one prefix tree (`algo.shared_prefix`), 4 micro-batches of one
  group, the output layer at every token (`model.logprobs_at=all`);
- `shared+gathered`: and the output layer only at the loss's tokens (`model.logprobs_at=loss`);
- `shared+gathered+even`: and each group's tree run at the shortest of 4 evenly spaced lengths
  that holds it (`algo.length_spacing=even`; halvings of a 1,536 width ran every tree of
  1,000-1,500 positions at 1,536), the recipe now.

Columns: tokens in the batch (real; padded), token positions the trunk computed (prepare's
scoring passes and the update's), seconds per update (best of `--rounds`, after a first compiling call),
XLA's temp memory of the compiled update. The rollout (`--rollout`, on by default): one step's
episodes of the recipe (4 TextCraft training tasks x 6 samples, horizon 6, temperature 0.7) from
the pretrained policy, played by `--baseline`'s code and by this tree's, on a server the script
starts. Last line: `summary: update_speedup=<main / shared+gathered+even> rl_step_speedup=<(rollout +
update) main / now> computed_token_fraction=<trunk positions computed / real tokens, now>`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if "AGENTGYM_BENCH_CHILD" not in os.environ:  # a child imports the tree on its PYTHONPATH (the baseline's)
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from agentgym_jax.models import fetch  # noqa: E402
from agentgym_jax.models.hf_checkpoint import load_pretrained  # noqa: E402
from agentgym_jax.rollout.batch import TokenBatch, bucket  # noqa: E402
from agentgym_jax.train.state import TrainState  # noqa: E402
from agentgym_jax.train.steps import Batching, Forward, RLSpec, UpdateConfig, make_step_fns  # noqa: E402

GROUPS = ROOT / "bench" / "data" / "textcraft_smollm_steps.json"
BASELINE = "3a31f6a"  # main when issue 43 was filed: plain rows, the head at every position
# The recipe's update (configs/smollm.py): Adam 1e-5, KL 0.05 to the SFT policy, temperature 0.7,
# one epoch of one mini-batch, log-probs a 128-position chunk at a time.
VARIANTS = {
    "main": dict(batching=dict(num_microbatches=8, length_buckets=3), forward={}),
    "plain": dict(batching=dict(num_microbatches=8, length_buckets=3), forward=dict(logprobs_at="all")),
    "shared": dict(batching=dict(num_microbatches=4, length_buckets=3, shared_prefix=True),
                   forward=dict(logprobs_at="all")),
    "shared+gathered": dict(batching=dict(num_microbatches=4, length_buckets=3, shared_prefix=True),
                            forward=dict(logprobs_at="loss")),
    "shared+gathered+even": dict(batching=dict(num_microbatches=4, length_buckets=4, length_spacing="even",
                                               shared_prefix=True), forward=dict(logprobs_at="loss")),
}


def record(trajectories: pathlib.Path, out: pathlib.Path) -> None:
    """The structure of each RL step's groups in a run's trajectories: per row its length, the
    prefix it shares with the rest of its group, and the [start, end) spans of its policy tokens."""
    steps: dict[int, dict[int, list[dict]]] = {}
    for line in trajectories.read_text().splitlines():
        t = json.loads(line)
        if t.get("train_step", -1) < 0:
            continue
        steps.setdefault(t["train_step"], {}).setdefault(t["group_id"], []).append(t)
    recorded = []
    for step in sorted(steps):
        groups = []
        for rows in steps[step].values():
            ids = [np.asarray(r["token_ids"]) for r in rows]
            shortest = min(len(x) for x in ids)
            same = np.all(np.stack([x[:shortest] for x in ids]) == ids[0][:shortest], axis=0)
            shared = int(np.argmin(same)) if not same.all() else shortest
            groups.append({"shared": shared, "rows": [{"length": len(x), "policy": _spans(r["loss_mask"])}
                                                      for x, r in zip(ids, rows)]})
        recorded.append({"step": step, "groups": groups})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": str(trajectories), "steps": recorded}, indent=1) + "\n")
    print(f"recorded {len(recorded)} steps of {trajectories} into {out}")


def _spans(mask: list[int]) -> list[list[int]]:
    edges = np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]]))
    return [[int(a), int(b)] for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]


def recorded_batch(step: dict, vocab: int, seed: int = 0) -> TokenBatch:
    """Rows with `step`'s recorded structure and random ids: each group's rows agree on their
    shared prefix and on nothing after it; 0/1 outcomes on their last policy token."""
    rng = np.random.default_rng(seed)
    rows, masks, groups = [], [], []
    for g, group in enumerate(step["groups"]):
        prefix = rng.integers(0, vocab, group["shared"])
        for row in group["rows"]:
            tail = rng.integers(0, vocab, row["length"] - group["shared"])
            if len(tail):
                tail[0] = (tail[0] + len(rows)) % vocab  # rows part right after the shared prefix
            mask = np.zeros(row["length"], np.float32)
            for a, b in row["policy"]:
                mask[a:b] = 1
            rows.append(np.concatenate([prefix, tail])), masks.append(mask), groups.append(g)
    seq = bucket(max(len(r) for r in rows), 64)
    n = len(rows)
    tokens = np.zeros((n, seq), np.int32)
    positions = np.full((n, seq), -1, np.int32)
    loss_mask = np.zeros((n, seq), np.float32)
    token_rewards = np.zeros((n, seq), np.float32)
    scores = rng.integers(0, 2, n).astype(np.float32)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        tokens[i, : len(row)], positions[i, : len(row)], loss_mask[i, : len(row)] = row, np.arange(len(row)), mask
        token_rewards[i, np.flatnonzero(mask)[-1]] = scores[i]
    return TokenBatch(tokens=tokens, positions=positions, loss_mask=loss_mask, old_logprobs=np.zeros((n, seq), np.float32),
                      token_rewards=token_rewards, group_ids=np.asarray(groups, np.int32), scores=scores)


def time_update(variant: str, model_name: str, step: dict, rounds: int) -> dict:
    """One variant's update on `step`'s batch: seconds (first call, best of `rounds`), positions
    computed, temp memory of the compiled update."""
    model, params = load_pretrained(fetch.resolve(model_name))
    spec = VARIANTS[variant]
    config = UpdateConfig(Forward(model, logprob_chunk=128, **spec["forward"]), Batching(**spec["batching"]),
                          RLSpec(kl_coef=0.05, kl_estimator="low_var_kl", temperature=0.7))
    batch = recorded_batch(step, model.vocab_size)
    if spec["batching"].get("shared_prefix"):
        from agentgym_jax.rollout.packing import pack_groups

        batch = pack_groups(batch, 6)
    fns = make_step_fns(config)
    state = TrainState.create(params, optax.adam(1e-5), jax.random.PRNGKey(1))
    ref = jax.tree.map(jnp.copy, params)

    def update(state):
        rl_batch, prep = fns.prepare(state.params, ref, batch)
        state, metrics = fns.rl_update(state, rl_batch)
        return state, jax.device_get((prep, metrics))

    start = time.perf_counter()
    state, (prep, metrics) = update(state)
    first = time.perf_counter() - start
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        state, _ = update(state)
        seconds.append(time.perf_counter() - start)
    rl_batch, _ = fns.prepare(state.params, ref, batch)
    memory = fns.rl_update.lower(state, rl_batch).compile().memory_analysis()
    real = int((np.asarray(batch.positions) >= 0).sum())
    layout = getattr(batch, "layout", None)
    passes = 1 + int(getattr(config, "scores_policy", True))  # the reference's scoring pass, and the policy's where it runs
    return {"variant": variant, "first_s": first, "update_s": min(seconds), "real_tokens": real,
            "padded_tokens": int(np.asarray(batch.tokens).size),
            "packed_tokens": int((np.asarray(layout.positions) >= 0).sum()) if layout is not None else real,
            "positions": float(prep.get("score_positions", float("nan"))) * passes + float(metrics.get("positions", float("nan"))),
            "temp_gb": getattr(memory, "temp_size_in_bytes", 0) / 1e9}


def run_child(tree: pathlib.Path, args: list[str]) -> dict:
    """This script's `--child` in another checkout (`tree` on PYTHONPATH): its JSON answer."""
    env = {**os.environ, "PYTHONPATH": str(tree), "AGENTGYM_BENCH_CHILD": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_tree(ref: str) -> pathlib.Path:
    """A detached worktree of `ref` (made once, reused) to run the baseline's code."""
    tree = pathlib.Path(tempfile.gettempdir()) / f"agentgym_bench_{ref}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                       capture_output=True)
    return tree


def rollout_seconds(model_name: str, seed: int) -> float:
    """Seconds of one RL step's rollout of the recipe (4 TextCraft tasks x 6 samples) played by
    the pretrained policy with this tree's code, after a first (compiling) step."""
    from agentgym_jax.job import play, setup
    from agentgym_jax.job import settings as job_settings
    from configs import textcraft_smollm

    config = textcraft_smollm.get_config()
    config.workdir = tempfile.mkdtemp(prefix="bench_rl_step_")
    config.model.hf_dir = model_name
    config.seed = seed
    with setup.open_job(config) as job:
        framing, model = setup.tokenizer_and_model(config, job.workdir, [])
        params = setup.initial_params(config, model, job.mesh, jax.random.PRNGKey(seed), value_head=False)
        rollout = job_settings.rollout(config)
        with setup.make_engine(config, job, model, framing, rollout) as engine:
            policy = setup.local_policy(config, job, params, False)
            tasks = play.task_batch(job.info.splits["train"], 0, config.rollout.batch_tasks, seed)
            horizon = config.horizon_schedule.horizons[0]
            times = []
            for step in range(2):  # the first compiles the sampler's shapes
                start = time.perf_counter()
                engine.run(policy, tasks, horizon, jax.random.PRNGKey(step), policy_version=0)
                times.append(time.perf_counter() - start)
    return times[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pretrained:smollm2-135m-instruct")
    parser.add_argument("--step", type=int, default=0, help="which recorded step's groups")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", default=BASELINE, help="the git ref whose update and rollout are 'main'")
    parser.add_argument("--no-rollout", dest="rollout", action="store_false")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "main"),
                        help="this tree's variants to time, comma-separated (main always runs)")
    parser.add_argument("--record", type=pathlib.Path, help="a run's trajectories.jsonl to record the groups from")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--what", default="update", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if unknown := set(args.variants.split(",")) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
    if args.record:
        return record(args.record, GROUPS)
    step = json.loads(GROUPS.read_text())["steps"][args.step]
    if args.child:
        result = time_update(args.variant, args.model, step, args.rounds) if args.what == "update" else \
            {"rollout_s": rollout_seconds(args.model, 0)}
        print(json.dumps(result))
        return

    tree = baseline_tree(args.baseline)
    common = ["--model", args.model, "--step", str(args.step), "--rounds", str(args.rounds)]
    results = [run_child(tree, [*common, "--variant", "main"])]
    results += [run_child(ROOT, [*common, "--variant", v]) for v in args.variants.split(",") if v != "main"]
    by = {r["variant"]: r for r in results}
    print("| variant | real tokens | padded | packed | positions computed | first call s | update s | speed-up | temp GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['variant']} | {r['real_tokens']} | {r['padded_tokens']} | {r['packed_tokens']} | {r['positions']:.0f} | "
              f"{r['first_s']:.1f} | {r['update_s']:.1f} | {by['main']['update_s'] / r['update_s']:.2f}x | {r['temp_gb']:.2f} |")
    now = by.get("shared+gathered+even", results[-1])
    rl_step = float("nan")
    if args.rollout:
        before = run_child(tree, [*common, "--what", "rollout"])["rollout_s"]
        after = run_child(ROOT, [*common, "--what", "rollout"])["rollout_s"]
        print(f"\n| RL step | rollout s | update s | total s |\n| --- | ---: | ---: | ---: |\n"
              f"| main ({args.baseline}) | {before:.1f} | {by['main']['update_s']:.1f} | {before + by['main']['update_s']:.1f} |\n"
              f"| now | {after:.1f} | {now['update_s']:.1f} | {after + now['update_s']:.1f} |")
        rl_step = (before + by["main"]["update_s"]) / (after + now["update_s"])
    print(f"summary: update_speedup={by['main']['update_s'] / now['update_s']:.2f} rl_step_speedup={rl_step:.2f} "
          f"computed_token_fraction={now['positions'] / (3 * now['real_tokens']):.3f}")


if __name__ == "__main__":
    main()
