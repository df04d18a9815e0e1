"""Failure patterns of one episode, read from its trajectory record alone: pure functions.

A pattern is a prompt to read the episode, not a verdict (three moves right in a row can be the
shortest path). `PATTERNS` names them in a fixed order, the bit order of `flag_bits`:

- repeated_action: the same action, the same sampled ids, at least `MIN_REPEATS` turns in a row;
- max_turns / token_budget: the episode was cut by the horizon, or by its token budget (the
  response budget `max_response_length` or the sampler's context `max_cache_len` ran out);
- invalid_streak: at least `MIN_INVALID_STREAK` invalid actions in a row, as far as the record
  shows: it keeps a count of invalid actions, not which turns they were, so the streak is the
  shortest one that count forces (or the status `invalid_action_limit`, which is a streak);
- truncated_turn: a policy turn cut by its token limit before it sampled the end-of-turn id
  (the text the environment received was cut off); needs the tokenizer's end-of-turn id.
"""

from __future__ import annotations

from collections.abc import Collection

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.rollout.trajectory import Trajectory

PATTERNS = ("repeated_action", "max_turns", "token_budget", "invalid_streak", "truncated_turn")
MIN_REPEATS = 3
MIN_INVALID_STREAK = 3


def longest_repeat(trajectory: Trajectory) -> int:
    """The most consecutive policy turns with identical sampled ids (0 for an episode without turns)."""
    longest = run = 0
    previous = None
    for start, end in trajectory.turn_spans:
        ids = trajectory.token_ids[start:end]
        run = run + 1 if ids == previous else 1
        longest = max(longest, run)
        previous = ids
    return longest


def shortest_invalid_streak(trajectory: Trajectory) -> int:
    """The longest run of invalid actions the record's count forces: k invalid among n stepped
    turns are separated by at most n - k valid ones, so some n - k + 1 runs hold all k and the
    longest holds at least ceil(k / (n - k + 1))."""
    stepped = len(trajectory.turn_rewards)
    invalid = min(trajectory.invalid_actions, stepped)
    return -(-invalid // (stepped - invalid + 1))


def truncated_turns(trajectory: Trajectory, end_of_turn_ids: Collection[int]) -> int:
    """Policy turns whose last sampled id is not an end-of-turn id."""
    return sum(trajectory.token_ids[end - 1] not in end_of_turn_ids for _, end in trajectory.turn_spans)


def patterns(trajectory: Trajectory, end_of_turn_ids: Collection[int] | None) -> list[str]:
    """The names (in `PATTERNS` order) of the patterns the episode shows; `truncated_turn` is
    looked for only when the end-of-turn ids are known."""
    status = trajectory.status
    found = {
        "repeated_action": longest_repeat(trajectory) >= MIN_REPEATS,
        "max_turns": status is EpisodeStatus.MAX_TURNS,
        "token_budget": status is EpisodeStatus.TOKEN_BUDGET,
        "invalid_streak": status is EpisodeStatus.INVALID_ACTION_LIMIT
        or shortest_invalid_streak(trajectory) >= MIN_INVALID_STREAK,
        "truncated_turn": end_of_turn_ids is not None and truncated_turns(trajectory, end_of_turn_ids) > 0,
    }
    return [name for name in PATTERNS if found[name]]


def flag_bits(names: Collection[str]) -> int:
    """Pattern names -> a bit mask (bit i: `PATTERNS[i]`), the index's compact form."""
    return sum(1 << i for i, name in enumerate(PATTERNS) if name in names)
