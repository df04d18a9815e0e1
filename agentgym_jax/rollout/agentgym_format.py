"""AgentGym's conversation files (AgentTraj-L, AgentEvol inference output) <-> our trajectories.

The format: a JSON list (or JSON lines) of
`{"item_id": "<env>_<task id>", "conversations": [{"from": "human"|"gpt"|"system",
"loss": true|false|null, "value": str}, ...]}`, optionally with `"reward"` and `"success"`.
AgentGym trains on `gpt` turns; a `gpt` turn with `"loss": false` (the "Ok." that acknowledges the
instruction) is context only. Here:
- import (for SFT, any tokenizer with a chat template): the conversation is framed by
  `ChatFraming.encode`; `loss_mask` is 1 exactly on the tokens of `gpt` turns whose `loss` is true
  or null (content and the end-of-turn token), 0 elsewhere. `human`/`system` turns never carry
  loss; one marked `"loss": true` is refused rather than silently ignored. The ids equal
  `apply_chat_template(add_generation_prompt=False)`: unlike a rollout, a final assistant turn is
  followed by the template's after-end-of-turn ids (ChatML's "\n", loss_mask 0), and a final
  human turn by no generation header.
- export: a trajectory's token ids are cut at its turn spans; each policy turn's text is the
  decoding of its ids (end-of-turn token dropped), and the text between turns is decoded and
  split at the chat template's markup (`ChatFraming.parts`) into human turns (a function-calling
  episode's tool results, `ChatFraming.tool_parts`, too: the format has no tool role; a tool
  list the template writes into its system turn is exported as that turn's text). Prompt assistant
  turns (the acknowledgement) are written with `"loss": false`, policy turns with `true`.
A message whose content contains the template's markup text cannot be told apart from the markup
on export; import is unaffected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models.chat import ChatFraming, FramingError, Role
from agentgym_jax.rollout.trajectory import Trajectory

FROM_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def read_file(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Items of a JSON-list file (AgentTraj-L) or a JSON-lines file (AgentGym inference output)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(item, dict) for item in items):
        raise ValueError(f"{path}: every item must be a JSON object with 'item_id' and 'conversations'")
    return items


def write_file(path: str | os.PathLike, items: Iterable[Mapping[str, Any]]) -> None:
    """Writes items as one JSON list, as AgentTraj-L is published."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(list(items), f, ensure_ascii=False, indent=1)
        f.write("\n")


def parse_item_id(item_id: Any) -> tuple[str, int]:
    """`"textcraft_12"` -> `("textcraft", 12)` (AgentGym reads the task id after the last `_`)."""
    env, sep, task = item_id.rpartition("_") if isinstance(item_id, str) else ("", "", "")
    if not (env and sep and task.isdigit()):
        raise ValueError(f"item_id must look like '<env>_<task id>', got {item_id!r}")
    return env, int(task)


def _messages(item: Mapping[str, Any]) -> tuple[list[dict[str, str]], list[bool]]:
    """Chat messages of an item and, per assistant message, whether it is trained on."""
    where = f"item {item.get('item_id')!r}"
    conversations = item.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise ValueError(f"{where} has no conversations (an AgentEval task list?); SFT needs them")
    messages, trained = [], []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, Mapping) or turn.get("from") not in FROM_ROLES or not isinstance(turn.get("value"), str):
            raise ValueError(
                f"{where}, turn {i}: need {{'from': one of {sorted(FROM_ROLES)}, 'value': str, 'loss': ...}}, got {turn!r}"
            )
        loss = turn.get("loss")
        if loss not in (True, False, None):
            raise ValueError(f"{where}, turn {i}: 'loss' must be true, false or null, got {loss!r}")
        if turn["from"] != "gpt" and loss:
            raise ValueError(f"{where}, turn {i}: a {turn['from']!r} turn marked loss=true; only gpt turns are trained on")
        messages.append({"role": FROM_ROLES[turn["from"]], "content": turn["value"]})
        if turn["from"] == "gpt":
            trained.append(loss is not False)
    return messages, trained


def import_item(item: Mapping[str, Any], framing: ChatFraming, group_id: int = 0) -> Trajectory:
    """One AgentGym item -> a trajectory for SFT (`loss_mask` on trained gpt turns; log-probs 0).

    `turn_spans` are the trained gpt turns. Items without `success`/`reward` are demonstrations
    (AgentTraj holds successful trajectories): status success, reward 1.
    """
    env, task_id = parse_item_id(item.get("item_id"))
    messages, trained = _messages(item)
    try:
        framed = framing.encode(messages)
    except FramingError as e:
        raise ValueError(f"item {item['item_id']!r}: {e}") from e
    runs, start = [], None  # [start, end) of each assistant message's tokens, in order
    for i, role in enumerate((*framed.roles, None)):
        if role is Role.ASSISTANT and start is None:
            start = i
        elif role is not Role.ASSISTANT and start is not None:
            runs.append((start, i))
            start = None
    if len(runs) != len(trained):  # every assistant turn holds at least its end-of-turn token
        raise AssertionError(f"{len(runs)} assistant token runs for {len(trained)} gpt turns")
    spans = [span for span, keep in zip(runs, trained) if keep]
    loss_mask = [0] * len(framed)
    for s, e in spans:
        loss_mask[s:e] = [1] * (e - s)
    success = bool(item.get("success", True))
    return Trajectory(
        task_id=task_id,
        env=env,
        group_id=group_id,
        token_ids=list(framed.ids),
        loss_mask=loss_mask,
        logprobs=[0.0] * len(framed),
        turn_spans=spans,
        turn_rewards=[0.0] * len(spans),
        reward=float(item.get("reward", 1.0)),
        status=EpisodeStatus.SUCCESS if success else EpisodeStatus.FAILURE,
        text=_decode(framing, framed.ids),
    )


def import_file(path: str | os.PathLike, framing: ChatFraming) -> list[Trajectory]:
    """All items of an AgentGym file as SFT trajectories (group id = position in the file)."""
    return [import_item(item, framing, group_id=i) for i, item in enumerate(read_file(path))]


def _decode(framing: ChatFraming, ids: Sequence[int]) -> str:
    return framing.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _turn(role: str, content: str, loss: bool | None) -> dict[str, Any]:
    return {"from": {"user": "human", "assistant": "gpt", "system": "system"}[role], "loss": loss, "value": content}


def _split_user_run(text: str, framing: ChatFraming, where: str) -> list[dict[str, Any]]:
    """`user (user_end assistant assistant_end user)* user_end` -> turns (assistants not trained)."""
    p = framing.parts
    user_end = p.user_suffix + p.generation_header
    assistant_end = p.end_of_turn + p.after_end_of_turn + p.user_header
    if not text.endswith(user_end):
        raise ValueError(f"{where}: text does not end with the generation header {user_end!r}: {text[-80:]!r}")
    rest, turns = text[: -len(user_end)], []
    while True:
        user, sep, rest = rest.partition(user_end)
        turns.append(_turn("user", user, None))
        if not sep:
            return turns
        assistant, sep, rest = rest.partition(assistant_end)
        if not sep:
            raise ValueError(f"{where}: an assistant turn without the template's end {assistant_end!r}")
        turns.append(_turn("assistant", assistant, False))


def _split_prompt(text: str, framing: ChatFraming) -> list[dict[str, Any]]:
    """The prompt text (`head [system] user ... generation header`) -> turns."""
    p = framing.parts
    if p.head_without_system is not None and text.startswith(p.head_without_system):
        return _split_user_run(text[len(p.head_without_system) :], framing, "prompt")
    if p.head_with_system is not None and text.startswith(p.head_with_system):
        system, sep, rest = text[len(p.head_with_system) :].partition(p.system_to_user)
        if sep:
            return [_turn("system", system, None), *_split_user_run(rest, framing, "prompt")]
    raise ValueError(f"the prompt does not start with the chat template's head: {text[:80]!r}")


def _split_tool_results(text: str, framing: ChatFraming, where: str) -> list[dict[str, Any]]:
    """`tool_header result (tool_separator result)* tool_suffix generation_header` -> one human
    turn (AgentGym's format has no tool role; several results are joined by newlines)."""
    t, end = framing.tool_parts, framing.tool_parts.tool_suffix + framing.parts.generation_header
    if not text.endswith(end):
        raise ValueError(f"{where}: tool results do not end with {end!r}: {text[-80:]!r}")
    return [_turn("user", "\n".join(text[len(t.tool_header) : -len(end)].split(t.tool_separator)), None)]


def _split_between_turns(text: str, framing: ChatFraming, closed: bool, where: str) -> list[dict[str, Any]]:
    """Text after a policy turn -> the human turns it holds (none for a bare end of turn)."""
    p = framing.parts
    if not closed and text.startswith(p.end_of_turn):  # the turn was cut; the template closed it
        text = text[len(p.end_of_turn) :]
    if text in ("", p.after_end_of_turn):
        return []
    if framing.tool_parts and text.startswith(p.after_end_of_turn + framing.tool_parts.tool_header):
        return _split_tool_results(text[len(p.after_end_of_turn) :], framing, where)
    head = p.after_end_of_turn + p.user_header
    if not text.startswith(head):
        raise ValueError(f"{where}: expected the template's {head!r}, got {text[:80]!r}")
    return _split_user_run(text[len(head) :], framing, where)


def export_trajectory(trajectory: Trajectory, framing: ChatFraming) -> dict[str, Any]:
    """A trajectory -> an AgentGym item (with `reward`, `success` and our `status`)."""
    t, eot = trajectory, set(framing.end_of_turn_ids)
    turns: list[dict[str, Any]] = []
    if t.token_ids:
        first = t.turn_spans[0][0] if t.turn_spans else len(t.token_ids)
        turns += _split_prompt(_decode(framing, t.token_ids[:first]), framing)
    for i, (start, end) in enumerate(t.turn_spans):
        ids = t.token_ids[start:end]
        closed = bool(ids) and ids[-1] in eot
        turns.append(_turn("assistant", _decode(framing, ids[:-1] if closed else ids), True))
        after = t.turn_spans[i + 1][0] if i + 1 < len(t.turn_spans) else len(t.token_ids)
        text = _decode(framing, t.token_ids[end:after])
        turns += _split_between_turns(text, framing, closed, f"after turn {i} of {t.env}_{t.task_id}")
    return {
        "item_id": f"{t.env}_{t.task_id}",
        "conversations": turns,
        "reward": t.reward,
        "success": int(t.success),
        "status": t.status.value,
    }


def export_file(path: str | os.PathLike, trajectories: Iterable[Trajectory], framing: ChatFraming) -> None:
    write_file(path, (export_trajectory(t, framing) for t in trajectories))
