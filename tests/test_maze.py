"""Maze rules: walls block moves, observations, the episode limit, the BFS oracle, the generator."""

from __future__ import annotations

import pytest

from environments.maze import env as maze
from environments.maze import layouts
from environments.maze.env import MazeEnv

# Two routes from S=(1,1) to G=(1,7): heading right first dead-ends at the wall in column 6
# (18 moves around); the shortest route goes down, along row 5 and up: 4 + 6 + 4 = 14 moves.
TWO_ROUTES = (
    "#########",
    "#.....#.#",
    "#.###.#.#",
    "#.#...#.#",
    "#.#.###.#",
    "#.......#",
    "#########",
)


def test_walls_block_moves_and_are_described():
    env = MazeEnv()
    first = env.start(TWO_ROUTES, (1, 1), (1, 7))
    assert first == ("The goal is at position 1, 7. Your current position is at position 1, 1. "
                     "There are walls to your left, above you.")
    for blocked in ("move up", "move left"):
        result = env.step(blocked)
        assert env.position == (1, 1) and result.reward == 0.0 and not result.done
        assert result.info["invalid_action"] is False  # a legal move into a wall, not a bad action
        assert "current position is at position 1, 1." in result.observation
    result = env.step("move down")
    assert env.position == (2, 1)
    assert result.observation.endswith("There are walls to your right, to your left.")
    env.step("move down")  # (3, 1)
    env.step("move down")  # (4, 1)
    assert env.step("move down").observation.endswith("There are walls to your left, below you.")  # (5, 1)
    env.start(TWO_ROUTES, (5, 3), (1, 7))
    assert env.observation().endswith("There is a wall below you.")
    env.start(TWO_ROUTES, (3, 4), (1, 7))
    assert env.observation().endswith("There are walls above you, below you.")


def test_oracle_takes_the_shortest_route_not_the_greedy_one():
    env = MazeEnv()
    env.start(TWO_ROUTES, (1, 1), (1, 7))
    moves = []
    while not env.verify():
        moves.append(env.oracle_action())
        result = env.step(moves[-1])
    assert len(moves) == 14 and moves[0] == "move down"
    assert result.done and result.reward == 1.0 and result.observation == "Success"
    assert result.info["success"] is True and result.info["score"] == 1.0


def _relaxed_distances(layout: layouts.Layout, goal: layouts.Position) -> dict[layouts.Position, int]:
    """Shortest distances by repeated relaxation until nothing changes (no queue, unlike BFS)."""
    cells = layouts.open_cells(layout)
    dist = {c: (0 if c == goal else 10**9) for c in cells}
    changed = True
    while changed:
        changed = False
        for x, y in cells:
            for nxt in ((x - 1, y), (x + 1, y), (x, y - 1), (x, y + 1)):
                if nxt in dist and dist[nxt] + 1 < dist[(x, y)]:
                    dist[(x, y)], changed = dist[nxt] + 1, True
    return {c: d for c, d in dist.items() if d < 10**9}


@pytest.mark.parametrize("task_id", [0, 37, 123, 299])
def test_oracle_path_length_equals_shortest_distance(task_id):
    layout_idx, start, goal = maze.task(task_id)
    layout = layouts.maze_layout(layout_idx)
    shortest = _relaxed_distances(layout, goal)[start]
    env = MazeEnv()
    env.reset(task_id)
    steps = 0
    while not env.verify():
        result = env.step(env.oracle_action())
        steps += 1
    assert steps == shortest and result.reward == 1.0


def test_episode_ends_after_max_steps_without_success():
    env = MazeEnv()
    env.start(TWO_ROUTES, (1, 1), (1, 7))
    for turn in range(1, maze.MAX_STEPS + 1):
        result = env.step("move up" if turn % 2 else "jump")  # wall bumps and invalid actions
        assert result.done == (turn == maze.MAX_STEPS)
        assert result.info["invalid_action"] == (turn % 2 == 0)
    assert result.reward == 0.0 and not result.info["success"] and "used all" in result.observation


def test_parse_action_reads_model_text():
    assert MazeEnv.parse_action("Thought:\nThe goal is below.\n\nAction:\nMove Down.") == "move down"
    assert MazeEnv.parse_action("Action: right") == "move right"
    assert MazeEnv.parse_action("move left") == "move left"
    assert MazeEnv.parse_action("Action: jump over the wall") == "jump over the wall"
    assert MazeEnv.parse_action("Thought: no idea\nAction:   ") is None
    env = MazeEnv()
    env.reset(0)
    result = env.step("jump over the wall")
    assert result.info["invalid_action"] is True and result.reward == 0.0 and "Invalid action" in result.observation


def test_generator_is_deterministic_connected_and_varied():
    assert layouts.generate_layout(5) == layouts.generate_layout(5)
    mazes = [layouts.maze_layout(i) for i in range(maze.NUM_LAYOUTS)]
    assert len(set(mazes)) == maze.NUM_LAYOUTS
    for layout in mazes:
        assert set(layout[0]) == set(layout[-1]) == {"#"}
        assert all(row[0] == row[-1] == "#" for row in layout)
        cells = layouts.open_cells(layout)
        assert len(_relaxed_distances(layout, cells[0])) == len(cells)  # every open cell reachable


def test_tasks_are_valid_and_splits_hold_out_layouts():
    info = MazeEnv.task_info()
    test_layouts = {maze.task(i)[0] for i in info.splits["test"]}
    train_layouts = {maze.task(i)[0] for i in info.splits["train"]}
    assert not test_layouts & train_layouts
    assert sorted(info.splits["train"] + info.splits["test"]) == list(range(info.num_tasks))
    pairs = set()
    for task_id in range(info.num_tasks):
        layout_idx, start, goal = maze.task(task_id)
        distance = _relaxed_distances(layouts.maze_layout(layout_idx), goal)[start]
        assert maze.MIN_DISTANCE <= distance <= maze.MAX_DISTANCE < maze.MAX_STEPS
        pairs.add((layout_idx, start, goal))
    assert len(pairs) > 0.95 * info.num_tasks  # task ids are (almost all) different tasks


def test_start_rejects_walls_and_unreachable_goals():
    env = MazeEnv()
    with pytest.raises(ValueError, match="open cells"):
        env.start(TWO_ROUTES, (0, 0), (1, 7))
    with pytest.raises(ValueError, match="unreachable"):
        env.start(("#####", "#.#.#", "#####"), (1, 1), (1, 3))


def test_progress_shaping_is_opt_in_potential_based_and_leaves_success_alone():
    plain, shaped = MazeEnv(), MazeEnv()
    shaped.reward_shaping = "progress"
    moves = ["move right", "move left", "move up", "move down"]  # from (1, 1): towards the dead end, back, a wall, the shortest route
    for env in (plain, shaped):
        env.start(TWO_ROUTES, (1, 1), (1, 7))
    assert [plain.step(m).reward for m in moves] == [0.0] * 4
    step = maze.PROGRESS_REWARD
    assert [shaped.step(m).reward for m in moves] == [-step, step, 0.0, step]  # shortest distance 14 -> 15 -> 14 -> 14 -> 13
    # Following the oracle from any start: every step earns one step's credit, the goal the rest of 1, exactly.
    for env in (plain, shaped):
        env.start(TWO_ROUTES, (1, 1), (1, 7))
    for env in (plain, shaped):
        results = []
        while not env.verify():
            results.append(env.step(env.oracle_action()))
        assert results[-1].info["success"] and results[-1].info["score"] == 1.0 and sum(r.reward for r in results) == 1.0
    assert [r.reward for r in results[:-1]] == [step] * 13
    # A failed episode stays below 1 whatever it does: at most (MAX_DISTANCE - 1) steps of progress.
    assert maze.PROGRESS_REWARD * (maze.MAX_DISTANCE - 1) < 1.0


def test_local_oracle_moves_towards_the_goal_on_what_it_sees_and_turns_back_only_at_a_dead_end():
    corridor = ("#######", "#.....#", "#######")
    assert layouts.local_move(corridor, (1, 3), (1, 5), None) == "move right"
    assert layouts.local_move(corridor, (1, 3), (1, 1), "move right") == "move right"  # the goal is behind: no turning back
    assert layouts.local_move(corridor, (1, 5), (1, 1), "move right") == "move left"  # a dead end: back is all there is
    # On TWO_ROUTES the walker heads right towards the goal, dead-ends in column 5 and finds its way
    # down and around: 18 moves where the shortest-path oracle's 14 start downwards.
    env, moves = MazeEnv(), []
    env.start(TWO_ROUTES, (1, 1), (1, 7))
    while not env.verify():
        moves.append(env.named_oracle_action("local"))
        env.step(moves[-1])
    assert moves == ["move right"] * 4 + ["move down"] * 2 + ["move left"] * 2 + ["move down"] * 2 + \
        ["move right"] * 4 + ["move up"] * 4
    env.start(TWO_ROUTES, (1, 1), (1, 7))
    assert env.oracle_action() == "move down"


def test_the_thought_oracle_names_where_the_goal_lies_then_makes_the_local_move():
    """`local_thought` is `local`'s move after a thought naming the goal's row and column side;
    the reply parses back to that move, so its episodes are the local oracle's."""
    assert layouts.goal_direction((5, 7), (3, 9)) == "The goal is above me, to my right."
    assert layouts.goal_direction((3, 9), (5, 7)) == "The goal is below me, to my left."
    assert layouts.goal_direction((3, 7), (3, 1)) == "The goal is in my row, to my left."
    assert layouts.goal_direction((1, 7), (4, 7)) == "The goal is below me, in my column."
    plain, thought = MazeEnv(), MazeEnv()
    for env in (plain, thought):
        env.start(TWO_ROUTES, (1, 1), (1, 7))
    while not plain.verify():
        move, reply = plain.named_oracle_action("local"), thought.named_oracle_action("local_thought")
        assert reply == f"Thought: {layouts.goal_direction(thought.position, thought.goal)}\nAction: {move}"
        assert MazeEnv.parse_action(reply) == move
        plain.step(move), thought.step(MazeEnv.parse_action(reply))
        assert thought.position == plain.position
    assert thought.verify()


def test_local_oracle_solves_about_half_the_test_tasks_within_twelve_moves():
    """The figure `layouts.local_move` and configs/cpu.py quote, replayed on the test layouts."""
    test_ids = MazeEnv.task_info().splits["test"]
    solved = 0
    for task_id in test_ids:
        env = MazeEnv()
        env.reset(task_id)
        for _ in range(12):
            if env.step(env.named_oracle_action("local")).done:
                break
        solved += env.verify()
    assert solved / len(test_ids) == 0.52
