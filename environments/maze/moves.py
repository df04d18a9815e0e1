r"""What a Maze policy's moves do, replayed on the environment: where success alone says nothing.

    python -m environments.maze.moves --tokenizer=runs/maze_cpu/tokenizer runs/eval/trajectories.jsonl
    python -m environments.maze.moves --oracle=local --split=test --max_moves=16    # the reference

Each policy turn of each Maze episode is decoded with the policy's tokenizer, parsed as the server
parses it (`MazeEnv.parse_action`) and stepped on a fresh `MazeEnv` of the same task, so the
counts come from the environment's own rules, not from reading its observation text. A move is
`into_wall` (a valid move that left the agent where it was), `closer` (the shortest-path distance
to the goal fell), `revisit` (it ended on a square the episode had already stood on) or
`invalid` (not one of the four moves). Each turn is also compared with the `local` oracle's move
from the same square: `local_forced` where the walls and the last move leave at most one way on
(no reading of the positions needed), `local_choice` where two or more are open and only the
goal's side decides; `goal_named` is the share of turns whose thought names that side as the
`local_thought` oracle does (`layouts.goal_direction`). Rates are over all policy turns of the
file(s); RL trajectory files give one line per policy version (RL step), evaluation files one line.
A server-side tool: it reads the trajectory files as JSON lines and decodes with the tokenizer
folder's `tokenizer.json`, importing nothing of the library (architecture rule on servers).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import tokenizers
from absl import app, flags

from environments.maze import layouts
from environments.maze.env import MazeEnv

_TOKENIZER = flags.DEFINE_string("tokenizer", "", "the policy's tokenizer folder (<RL workdir>/tokenizer)")
_ORACLE = flags.DEFINE_enum("oracle", "", ["", "shortest", "local"], "instead of files: an oracle's moves on --split")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "test"], "the oracle's tasks")
_MAX_MOVES = flags.DEFINE_integer("max_moves", 16, "the oracle's horizon (the CPU recipe's final one: 16)")


@dataclasses.dataclass
class MoveCounts:
    episodes: int = 0
    moves: int = 0
    into_wall: int = 0
    closer: int = 0
    revisit: int = 0
    invalid: int = 0
    success: int = 0
    forced: int = 0  # turns with at most one open move besides straight back
    forced_local: int = 0  # ... on which the move was the local oracle's
    choice: int = 0  # turns with two or more: the goal's side decides
    choice_local: int = 0
    goal_named: int = 0  # turns whose response states `layouts.goal_direction` of the square

    def add(self, other: MoveCounts) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def rates(self) -> dict[str, float]:
        """Per-move rates, and success per episode."""
        per_move = {k: getattr(self, k) / max(self.moves, 1) for k in ("into_wall", "closer", "revisit", "invalid", "goal_named")}
        return {"episodes": self.episodes, "moves": self.moves, **per_move, "success": self.success / max(self.episodes, 1),
                "local_forced": self.forced_local / max(self.forced, 1), "local_choice": self.choice_local / max(self.choice, 1)}


def replay(env: MazeEnv, responses: Sequence[str]) -> MoveCounts:
    """Steps an episode's policy responses on `env`, just started on its task; stops where the episode ended."""
    distance = layouts.distances_to(env.layout, env.goal)
    counts = MoveCounts(episodes=1)
    visited = {env.position}
    for response in responses:
        action = MazeEnv.parse_action(response)
        before = env.position
        local = layouts.local_move(env.layout, before, env.goal, env.last_move)
        if len(layouts.ways_on(env.layout, before, env.last_move)) <= 1:
            counts.forced += 1
            counts.forced_local += action == local
        else:
            counts.choice += 1
            counts.choice_local += action == local
        counts.goal_named += layouts.goal_direction(before, env.goal) in response
        result = env.step(action or "")
        counts.moves += 1
        if action not in layouts.MOVES:
            counts.invalid += 1
        elif env.position == before:
            counts.into_wall += 1
        else:
            counts.closer += distance[env.position] < distance[before]
            counts.revisit += env.position in visited
        visited.add(env.position)
        if result.done:
            break
    counts.success = int(env.verify())
    return counts


def read_records(path: str | pathlib.Path) -> Iterator[dict[str, Any]]:
    """The trajectory records of a JSONL file (the library's `Trajectory.to_json` lines)."""
    with open(path) as f:
        yield from (json.loads(line) for line in f if line.strip())


def decoder(tokenizer_dir: str | pathlib.Path) -> Callable[[list[int]], str]:
    """Token ids -> text with the folder's `tokenizer.json`, special tokens left out (as the policy's
    Hugging Face tokenizer decodes them)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(pathlib.Path(tokenizer_dir) / "tokenizer.json"))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def count_moves(records: Iterable[Mapping[str, Any]], decode: Callable[[list[int]], str]) -> dict[int, MoveCounts]:
    """Policy version -> the summed counts of its Maze episodes (other environments are skipped)."""
    by_version: dict[int, MoveCounts] = collections.defaultdict(MoveCounts)
    for record in records:
        if record["env"] != "maze":
            continue
        responses = [decode(record["token_ids"][start:end]) for start, end in record["turn_spans"]]
        env = MazeEnv()
        env.reset(record["task_id"])
        by_version[record["policy_version"]].add(replay(env, responses))
    return dict(sorted(by_version.items()))


def oracle_moves(oracle: str, task_ids: Iterable[int], max_moves: int) -> MoveCounts:
    """The counts of an oracle ("shortest" or "local") playing each task for at most `max_moves`."""
    total = MoveCounts()
    for task_id in task_ids:
        player = MazeEnv()
        player.reset(task_id)
        responses = []
        for _ in range(max_moves):
            action = player.oracle_action() if oracle == "shortest" else player.named_oracle_action(oracle)
            responses.append(f"Action: {action}")
            if player.step(action).done:
                break
        env = MazeEnv()
        env.reset(task_id)
        total.add(replay(env, responses))
    return total


def _line(name: str, counts: MoveCounts) -> str:
    rates = counts.rates()
    return (f"{name} episodes={rates['episodes']} moves={rates['moves']} "
            + " ".join(f"{k}={rates[k]:.3f}" for k in ("into_wall", "closer", "revisit", "invalid", "success",
                                                     "local_forced", "local_choice", "goal_named")))


def main(argv: Sequence[str]) -> None:
    if _ORACLE.value:
        task_ids = MazeEnv.task_info().splits[_SPLIT.value]
        print(_line(f"oracle={_ORACLE.value} split={_SPLIT.value} max_moves={_MAX_MOVES.value}",
                    oracle_moves(_ORACLE.value, task_ids, _MAX_MOVES.value)))
        return
    if len(argv) < 2 or not _TOKENIZER.value:
        raise app.UsageError("give --tokenizer and one or more trajectories.jsonl files (or --oracle)")
    decode = decoder(_TOKENIZER.value)
    for path in argv[1:]:
        for version, counts in count_moves(read_records(path), decode).items():
            print(_line(f"{path} policy_version={version}", counts))


if __name__ == "__main__":
    app.run(main)
