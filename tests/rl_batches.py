"""Random multi-turn batches for the `rl/` tests: interleaved policy / environment tokens, padding,
all-masked rows, and garbage values at masked positions (which every function must ignore)."""

from __future__ import annotations

import numpy as np


def random_loss_mask(rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
    """`[batch, seq]` bool: per row a prompt, then turns of 1-4 policy tokens and 0-3 environment
    tokens, then padding. Row 1 is all-masked (an episode the policy never acted in)."""
    mask = np.zeros((batch, seq), bool)
    for row in range(batch):
        if row == 1:
            continue
        t = int(rng.integers(0, 3))  # prompt / first observation
        end = seq - int(rng.integers(0, 3))  # padding
        while t < end:
            n = int(rng.integers(1, 5))
            mask[row, t : min(t + n, end)] = True
            t += n + int(rng.integers(0, 4))
    return mask


def last_policy_token(mask_row: np.ndarray) -> int:
    return int(np.flatnonzero(mask_row)[-1])


def random_token_rewards(rng: np.random.Generator, mask: np.ndarray) -> np.ndarray:
    """Outcome reward on the last policy token of each row, per-turn rewards on some turn ends,
    garbage on environment tokens (which the contract says is ignored)."""
    rewards = np.where(mask, 0.0, rng.normal(size=mask.shape) * 100)
    for row in range(mask.shape[0]):
        if not mask[row].any():
            continue
        turn_ends = np.flatnonzero(mask[row] & ~np.append(mask[row, 1:], False))
        for t in turn_ends[:-1]:
            if rng.random() < 0.4:
                rewards[row, t] = rng.normal()
        rewards[row, turn_ends[-1]] = rng.normal()
    return rewards


def with_garbage(rng: np.random.Generator, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`x` on the mask, huge / infinite values off it."""
    garbage = rng.choice([1e30, -1e30, np.inf, -np.inf, 1e4], size=x.shape)
    return np.where(mask, x, garbage)
