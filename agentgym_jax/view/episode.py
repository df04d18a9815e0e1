"""One episode as the page replays it: the prompt, then per policy turn the sampled tokens, the
reward the environment paid and the environment's answer, every token with its id, text, loss
mask and log-prob, exactly as the record holds them (nothing re-tokenized)."""

from __future__ import annotations

from typing import Any

from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.view.index import step_of
from agentgym_jax.view.patterns import patterns
from agentgym_jax.view.tokens import TokenText


def episode_view(t: Trajectory, text: TokenText | None) -> dict[str, Any]:
    """JSON-ready: `prompt` and each turn's `policy` / `observation` are token columns (`ids`,
    `text` (None without a tokenizer), `mask`, `logprob`) over consecutive ranges of the record:
    the prompt up to the first policy turn, the policy turn's span, then everything up to the next
    turn (template ids closing a cut turn, the environment's message, the next header)."""
    pieces = text.pieces(t.token_ids) if text is not None else None

    def tokens(start: int, end: int) -> dict[str, Any]:
        return dict(
            start=start, ids=t.token_ids[start:end], text=None if pieces is None else pieces[start:end],
            mask=t.loss_mask[start:end], logprob=t.logprobs[start:end],
        )

    spans = t.turn_spans
    bounds = [start for start, _ in spans[1:]] + [len(t.token_ids)]
    end_of_turn = None if text is None else text.end_of_turn_ids
    turns = []
    for i, ((start, end), next_start) in enumerate(zip(spans, bounds)):
        turns.append(dict(
            policy=tokens(start, end), observation=tokens(end, next_start),
            reward=t.turn_rewards[i] if i < len(t.turn_rewards) else None,  # a last turn may never have been sent
            repeat=i > 0 and t.token_ids[start:end] == t.token_ids[spans[i - 1][0]:spans[i - 1][1]],
            truncated=None if end_of_turn is None else t.token_ids[end - 1] not in end_of_turn,
        ))
    return dict(
        env=t.env, task_id=t.task_id, sample_idx=t.sample_idx, attempt=t.attempt, step=step_of(t),
        policy_version=t.policy_version, group_id=t.group_id, status=t.status.value, reward=t.reward, invalid_actions=t.invalid_actions,
        patterns=patterns(t, end_of_turn), timings=t.timings,
        prompt=tokens(0, spans[0][0] if spans else len(t.token_ids)), turns=turns,
        text=t.text if pieces is None else None,  # without a tokenizer, the record's own decoding
    )
