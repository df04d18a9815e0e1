"""environments/maze/moves.py: each policy turn replayed and classified by the environment's rules."""

from __future__ import annotations

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.trajectory import Trajectory, write_jsonl
from environments.maze import env as maze
from environments.maze.env import MazeEnv
from environments.maze.moves import count_moves, decoder, oracle_moves, read_records, replay
from tests.test_maze import TWO_ROUTES


def test_replay_classifies_each_move_by_the_layout():
    env = MazeEnv()
    env.start(TWO_ROUTES, (1, 1), (1, 7))  # shortest route: down 4, right 6, up 4 (14 moves)
    responses = [
        "Action: move up",  # a wall above (1, 1): stays
        "Thought: right is shorter\nAction: move right",  # (1, 2): the shortest path goes down, so farther
        "Action: move left",  # back to (1, 1): closer, and a square already stood on
        "Action: jump",  # invalid
        "Action: move down",  # (2, 1): closer
    ]
    counts = replay(env, responses)
    assert (counts.moves, counts.into_wall, counts.invalid, counts.closer, counts.revisit) == (5, 1, 1, 2, 1)
    assert counts.success == 0 and counts.episodes == 1
    rates = counts.rates()
    assert rates["into_wall"] == 0.2 and rates["closer"] == 0.4 and rates["success"] == 0.0
    # Against the local oracle: at (1, 1) with no last move (turns 1 and 5, after the invalid one),
    # down and right are open, a choice the goal's side decides (right). Turns 2-4 come after a move,
    # whose way back is barred, so one way on is left (forced): right, right, down. Only turn 2 takes it.
    assert (counts.forced, counts.forced_local, counts.choice, counts.choice_local) == (3, 1, 2, 0)
    assert rates["local_forced"] == 1 / 3 and rates["local_choice"] == 0.0 and counts.goal_named == 0


def test_replay_credits_a_thought_that_names_the_goals_side():
    env = MazeEnv()
    env.start(TWO_ROUTES, (1, 1), (1, 7))
    counts = replay(env, ["Thought: The goal is in my row, to my right.\nAction: move right",  # a choice, the oracle's
                          "Thought: The goal is above me, to my right.\nAction: move right"])  # forced; wrong side
    assert (counts.choice, counts.choice_local, counts.forced, counts.forced_local, counts.goal_named) == (1, 1, 1, 1, 1)
    assert counts.rates()["goal_named"] == 0.5


def test_replay_stops_at_the_goal_and_counts_the_success():
    oracle = MazeEnv()
    oracle.start(TWO_ROUTES, (1, 5), (1, 7))  # a wall between: the way round takes 14 moves
    route = []
    while not oracle.verify():
        route.append(oracle.oracle_action())
        oracle.step(route[-1])
    assert len(route) == 14
    env = MazeEnv()
    env.start(TWO_ROUTES, (1, 5), (1, 7))
    counts = replay(env, [f"Action: {m}" for m in route] + ["Action: move down"])  # the extra turn is never played
    assert (counts.moves, counts.closer, counts.into_wall, counts.revisit, counts.success) == (14, 14, 0, 0, 1)


def test_count_moves_groups_by_policy_version_and_skips_other_environments(tmp_path):
    vocab = ["Action: move up", "Action: move down", "hello"]  # token id i decodes to vocab[i]

    def trajectory(env_name: str, version: int, ids: list[int]) -> Trajectory:
        tokens = [2] + ids  # a prompt token, then one policy turn per id
        return Trajectory(task_id=0, env=env_name, group_id=0, token_ids=tokens, loss_mask=[0] + [1] * len(ids),
                          logprobs=[0.0] * len(tokens), turn_spans=[(i + 1, i + 2) for i in range(len(ids))],
                          turn_rewards=[0.0] * len(ids), reward=0.0, status=EpisodeStatus.MAX_TURNS,
                          policy_version=version)

    _, start, _ = maze.task(0)
    layout = maze.layouts.maze_layout(0)
    one_up, two_up = (start[0] - 1, start[1]), (start[0] - 2, start[1])
    # episode [up]: into a wall unless one_up is open; episode [up, up]: the same, then from wherever it stands
    first = not maze.layouts.is_open(layout, one_up)
    second = 2 if first else int(not maze.layouts.is_open(layout, two_up))
    runs = [trajectory("maze", 0, [0]), trajectory("maze", 0, [0, 0]), trajectory("maze", 3, [1]),
            trajectory("room", 3, [0, 0, 0])]
    write_jsonl(str(tmp_path / "runs.jsonl"), runs)  # read back as the library writes them
    by_version = count_moves(read_records(tmp_path / "runs.jsonl"), lambda ids: "".join(vocab[i] for i in ids))
    assert sorted(by_version) == [0, 3]
    assert (by_version[0].episodes, by_version[0].moves, by_version[3].episodes, by_version[3].moves) == (2, 3, 1, 1)
    assert by_version[0].into_wall == int(first) + second


def test_oracle_moves_match_what_the_layouts_allow():
    test_ids = MazeEnv.task_info().splits["test"]
    shortest = oracle_moves("shortest", test_ids, max_moves=16)
    within = 0
    for task_id in test_ids:  # solved within 16 moves iff the shortest path is that short
        layout_idx, start, goal = maze.task(task_id)
        within += maze.layouts.distances_to(maze.layouts.maze_layout(layout_idx), goal)[start] <= 16
    assert shortest.success == within and shortest.closer == shortest.moves and shortest.into_wall == 0
    local = oracle_moves("local", test_ids, max_moves=12)
    assert local.success / len(test_ids) == 0.52 and local.into_wall == 0  # test_maze.py's figure, counted here


def test_the_tool_decodes_a_policy_turn_as_the_library_s_tokenizer_does(tmp_path):
    """moves.py reads tokenizer.json itself (a server-side tool imports nothing of the library)."""
    folder = bt.build_tokenizer(tmp_path, [maze.INSTRUCTION, "Thought: the goal is up.\nAction: move up"], 400)
    framing = ChatFraming(load_tokenizer(folder))
    ids = list(framing.assistant_ids("Thought: the goal is above me, to my left.\nAction: move left").ids)  # + end of turn
    assert decoder(folder)(ids) == framing.tokenizer.decode(ids, skip_special_tokens=True)
    assert decoder(folder)(ids).endswith("Action: move left")
