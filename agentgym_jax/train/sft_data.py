"""The data of `mode=sft`: rows from trajectory and AgentGym files, each tagged with its
environment, and the mixture rule that fixes every batch's rows before training.

The mixture rule (`mixture_schedule`): every row of every batch independently picks environment
e with probability w_e / sum(w) (`data.weights`, "env=w,..."; empty: w_e = the env's row count,
i.e. plain uniform sampling over rows), from a generator seeded by `seed`; within an environment,
rows are taken in a seeded permutation without replacement, a new permutation once all its rows
were used (an "epoch" of that environment). The whole schedule is fixed before training, so a
resumed run takes exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import ml_collections
import numpy as np

from agentgym_jax.config import ConfigError
from agentgym_jax.rollout import agentgym_format
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl


def parse_weights(spec: str) -> dict[str, float]:
    """`"webshop=2,alfworld=1"` -> {"webshop": 2.0, "alfworld": 1.0} (empty string: {})."""
    weights = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        env, _, value = (x.strip() for x in part.partition("="))
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not env or weight < 0:
            raise ConfigError(f"data.weights: expected 'env=weight,...' with weights >= 0, got {part!r} in {spec!r}")
        weights[env] = weight
    return weights


def mixture_schedule(
    sizes: Mapping[str, int], weights: Mapping[str, float], batch_size: int, steps: int, seed: int
) -> list[list[tuple[str, int]]]:
    """The (env, row index) of every row of every batch, `[steps][batch_size]`; see the module docstring."""
    if set(weights) != set(sizes):
        raise ConfigError(
            f"data.weights names {sorted(weights)} but the data has environments {sorted(sizes)}; give every one a weight"
        )
    envs = sorted(e for e in sizes if weights[e] > 0 and sizes[e] > 0)
    if not envs:
        raise ConfigError(f"no environment with rows and a positive weight: sizes {dict(sizes)}, weights {dict(weights)}")
    p = np.asarray([weights[e] for e in envs], np.float64)
    picks = np.random.default_rng(seed).choice(len(envs), size=(steps, batch_size), p=p / p.sum())  # [steps, batch]
    drawn = [0] * len(envs)
    orders: dict[tuple[int, int], np.ndarray] = {}
    schedule = []
    for row_picks in picks:
        rows = []
        for k in row_picks:
            epoch, offset = divmod(drawn[k], sizes[envs[k]])
            if (k, epoch) not in orders:
                orders[(k, epoch)] = np.random.default_rng([seed, k, epoch]).permutation(sizes[envs[k]])
            rows.append((envs[k], int(orders[(k, epoch)][offset])))
            drawn[k] += 1
        schedule.append(rows)
    return schedule


def load_rows(config: ml_collections.ConfigDict, framing) -> dict[str, list[Trajectory]]:
    """Every training row, grouped by environment, in file order."""
    rows: dict[str, list[Trajectory]] = collections.defaultdict(list)
    for path in paths(config.data.trajectories):
        for t in read_jsonl(path):
            if (t.success or config.data.include_failures) and any(t.loss_mask):
                rows[t.env].append(t)
    for path in paths(config.data.agentgym):
        for t in agentgym_format.import_file(path, framing):
            if t.success or config.data.include_failures:
                rows[t.env].append(t)
    if not rows:
        raise ConfigError("mode=sft found no training rows: set data.trajectories and/or data.agentgym")
    return dict(rows)


def paths(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def conversation_texts(config: ml_collections.ConfigDict) -> list[str] | None:
    """Message texts of the AgentGym files: what a job-built tokenizer learns from."""
    texts = [turn["value"] for path in paths(config.data.agentgym) for item in agentgym_format.read_file(path)
             for turn in item.get("conversations") or [] if isinstance(turn, Mapping)]
    return texts or None

