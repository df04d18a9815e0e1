"""Room: connected seeded rooms, held-out start/goal pairs, the Maze's rules with a 12-move budget."""

import subprocess
import sys

from environments.maze import layouts
from environments.room import env as room


def test_rooms_are_connected_and_have_the_documented_obstacles():
    for index in range(room.NUM_LAYOUTS):
        layout = room.room_layout(index)
        cells = layouts.open_cells(layout)
        assert len(cells) == room.SIZE * room.SIZE - room.OBSTACLES
        assert len(layouts.distances_to(layout, cells[0])) == len(cells)


def test_test_split_is_held_out_pairs_on_the_training_rooms():
    info = room.RoomEnv.task_info()
    train, test = set(info.splits["train"]), set(info.splits["test"])
    assert not train & test and len(test) >= 64 and train | test == set(range(room.NUM_TASKS))
    assert {info.metadata["layout"][i] for i in test} == {info.metadata["layout"][i] for i in train}
    for task_id in info.splits["test"][:20]:
        layout, start, goal = room.room_task(task_id)
        assert room.MIN_DISTANCE <= layouts.distances_to(layout, goal)[start] <= room.MAX_DISTANCE


def test_the_move_budget_ends_an_episode_as_a_failure():
    env = room.RoomEnv()
    layout = room.room_layout(0)
    env.start(layout, (1, 1), (6, 6))
    results = [env.step("move up") for _ in range(room.MAX_STEPS)]  # into the top wall
    assert env.position == (1, 1)
    assert not any(r.done for r in results[:-1])
    assert results[-1].done and results[-1].reward == 0.0 and not results[-1].info["success"]
    assert f"used all {room.MAX_STEPS} moves" in results[-1].observation


def test_task_ids_mean_the_same_task_in_other_processes():
    code = "from environments.room.env import room_task; print([room_task(i) for i in (0, 77, 399)])"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and str([room.room_task(i) for i in (0, 77, 399)]) in outputs


def test_observations_give_the_goal_relative_to_you_and_the_walls_beside_you():
    env = room.RoomEnv()
    layout = room.room_layout(0)  # row 1 is "#......#": walls above and to the left of (1, 1)
    assert env.start(layout, (1, 1), (3, 4)) == "Goal: 2 down, 3 right. Walls: up, left."
    assert env.step("move right").observation == "Goal: 2 down, 2 right. Walls: up."
    env.start(layout, (3, 4), (3, 2))
    assert env.observation() == "Goal: 2 left. Walls: left."  # (3, 3) is the obstacle in row 3


def test_progress_earns_partial_credit_and_only_success_reaches_one():
    env = room.RoomEnv()
    layout = room.room_layout(0)
    env.start(layout, (1, 1), (3, 4))  # 5 moves apart, no obstacle on the way
    rewards = [env.step(a).reward for a in ("move right", "move up", "move left", "move down")]
    assert rewards == [room.PROGRESS_REWARD, 0.0, -room.PROGRESS_REWARD, room.PROGRESS_REWARD]  # up: a wall
    path = ["move right"] * 3 + ["move down"] * 2
    env.start(layout, (1, 1), (3, 4))
    results = [env.step(a) for a in path]
    assert [r.reward for r in results[:-1]] == [room.PROGRESS_REWARD] * 4
    assert results[-1].info["success"] and sum(r.reward for r in results) == 1.0  # exactly
    # Every oracle episode sums to exactly 1; a failed one stays below.
    for task_id in range(0, room.NUM_TASKS, 7):
        env.reset(task_id)
        total, done = 0.0, False
        while not done:
            result = env.step(env.oracle_action())
            total, done = total + result.reward, result.done
        assert result.info["success"] and total == 1.0
    env.start(layout, (1, 1), (3, 4))
    failed = [env.step("move right") for _ in range(room.MAX_STEPS)]
    assert failed[-1].done and not failed[-1].info["success"] and sum(r.reward for r in failed) < 1.0
