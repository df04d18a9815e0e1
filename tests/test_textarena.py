"""TextArena adapter: move parsing, the solvers against independent references, task mapping,
scripted moves for the oracle-less games, per-episode randomness, and the oracle over a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import collections
import itertools

import pytest

from environments.textarena import games, solvers
from environments.textarena import env as textarena_env
from environments.textarena.env import TextArenaEnv
from tests.servers import request_json, start_server
from tests.test_environments import _run_oracle


def _task_of(name: str, seed: int) -> int:
    index = next(i for i, g in enumerate(games.GAMES) if g.name == name)
    return index * games.TASKS_PER_GAME + seed


@pytest.fixture(scope="module")
def url():
    with start_server("textarena") as served:
        yield served


@pytest.mark.parametrize("text, move", [
    ("Thought: binary search.\nAction: [10]", "[10]"),
    ("Thought: try.\nAction: guess [4 1 2 3] now", "[4 1 2 3]"),
    ("Action: up", "[up]"),
    ("Action: 'A C'.", "[A C]"),
    ("Thought: x\nAction:   3  4   7 ", "[3 4 7]"),
    ("Thought: nothing to say\nAction:", None),
])
def test_parser_maps_the_action_to_a_bracketed_move(text, move):
    assert TextArenaEnv.parse_action(text) == move


@pytest.mark.parametrize("game, move, canonical", [
    ("GuessTheNumber", "[guess 50]", "[50]"),
    ("Mastermind", "[code: 4, 1, 2, 3]", "[4 1 2 3]"),
    ("TowerOfHanoi", "[move A to C]", "[A C]"),
    ("FrozenLake", "[go Down]", "[Down]"),
    ("Sudoku", "[row 3 col 4 digit 7]", "[3 4 7]"),
    ("GuessTheNumber", "[xyzzy]", "[xyzzy]"),  # nothing of the game's: left for the game to reject
])
def test_moves_keep_only_the_games_own_words(game, move, canonical):
    assert next(g for g in games.GAMES if g.name == game).canonical(move) == canonical


def test_wordy_moves_are_played():
    env = TextArenaEnv()
    env.reset(_task_of("GuessTheNumber", 0))
    result = env.step(TextArenaEnv.parse_action("Thought: start in the middle.\nAction: guess 10"))
    assert result.info["invalid_action"] is False and "The target number is" in result.observation


def test_mastermind_feedback_matches_hand_counted_pegs():
    assert solvers.mastermind_feedback((1, 2, 3, 4), (1, 3, 2, 5)) == (1, 2)
    assert solvers.mastermind_feedback((1, 1, 2, 2), (2, 2, 1, 1)) == (0, 4)
    assert solvers.mastermind_feedback((1, 1, 2, 2), (1, 2, 3, 3)) == (1, 1)
    assert solvers.mastermind_feedback((6, 5, 4, 3), (6, 5, 4, 3)) == (4, 0)


def test_sudoku_solver_agrees_with_the_engines_stored_solution():
    for seed in range(3):
        env = TextArenaEnv()
        env.reset(_task_of("Sudoku", seed))
        board = env.engine.state.game_state["board"]
        row, col, digit = solvers.sudoku(board)
        assert board[row - 1][col - 1] == 0
        assert env.engine.full_grid[row - 1][col - 1] == digit  # the generator's own full grid


def test_hanoi_oracle_is_optimal_and_recovers_from_a_detour():
    env = TextArenaEnv()
    env.reset(_task_of("TowerOfHanoi", 0))
    moves = 0
    while not env.engine.state.done:
        assert env.step(env.oracle_action()).info["invalid_action"] is False
        moves += 1
    assert env.verify() and moves == 2**3 - 1  # the classic minimum for 3 disks
    env.reset(_task_of("TowerOfHanoi", 0))
    env.step("[A B]")  # not the optimal first move
    for _ in range(20):
        if env.step(env.oracle_action()).done:
            break
    assert env.verify()


def test_guess_the_number_oracle_needs_at_most_log2_guesses():
    for seed in range(20):
        env = TextArenaEnv()
        env.reset(_task_of("GuessTheNumber", seed))
        guesses = 0
        while not env.engine.state.done:
            env.step(env.oracle_action())
            guesses += 1
        assert env.verify() and guesses <= 5  # ceil(log2(20 + 1))


def test_task_ids_map_to_games_and_seeds():
    info = TextArenaEnv.task_info()
    assert info.num_tasks == len(games.GAMES) * games.TASKS_PER_GAME
    assert info.metadata["games"] == [g.name for g in games.GAMES]
    assert set(info.metadata["has_oracle"].values()) == {True, False}
    oracle_ids = set(info.metadata["oracle_task_ids"])
    assert oracle_ids == {i for i in range(info.num_tasks) if info.metadata["has_oracle"][info.metadata["game"][i]]}
    counts = collections.Counter(info.metadata["game"][i] for i in info.splits["test"])
    assert set(counts.values()) == {games.TASKS_PER_GAME // 5}  # every game in the test split, evenly
    env = TextArenaEnv()
    assert "Mastermind" in env.reset(_task_of("Mastermind", 7))
    assert "Tower of Hanoi" in env.reset(_task_of("TowerOfHanoi", 7))
    with pytest.raises(ValueError, match="out of range"):
        env.reset(info.num_tasks)


def test_rejected_moves_are_invalid_and_two_in_a_row_lose():
    env = TextArenaEnv()
    env.reset(_task_of("GuessTheNumber", 3))
    for move in ("[0]", "[10]", "[99]", "[10]"):  # invalid, valid, invalid, invalid (already guessed)
        result = env.step(move)
        assert result.info["invalid_action"] is (move != "[10]" or env.steps == 4)
        assert result.reward == 0 and result.info["success"] is False
    assert "invalid move" in result.observation.lower()
    assert result.done is True  # TextArena's rule: the second rejected move in a row loses
    assert env.steps == 4


def _safe_cell(env) -> str:
    """A hidden cell without a mine (read from the engine's board) in the game's move format."""
    engine = env.engine
    r, c = next((r, c) for r in range(engine.rows) for c in range(engine.cols)
                if not engine.revealed[r][c] and engine.grid[r][c] != -1)
    return f"[{r} {c}]"


def test_minesweeper_scripted_valid_and_invalid_moves():
    env = TextArenaEnv()
    env.reset(_task_of("Minesweeper", 4))
    first = env.step("[2 2]")  # the first reveal is always safe
    assert first.info["invalid_action"] is False and "revealed" in first.observation
    assert "[2 2]" not in env.available_actions()
    assert env.step("[2 2]").info["invalid_action"] is True  # already revealed
    safe = env.step(_safe_cell(env))
    assert safe.info["invalid_action"] is False and safe.done is False
    result = env.step("[9 9]")  # off the 5x5 board
    assert result.info["invalid_action"] is True and result.done is False
    result = env.step("[9 9]")
    assert result.done is True and result.info["success"] is False


def test_2048_scripted_moves():
    directions = ["[up]", "[left]", "[down]", "[right]"]
    probe = TextArenaEnv()
    valid = []
    for move in directions:
        probe.reset(_task_of("2048", 0))
        valid.append(probe.step(move).info["invalid_action"] is False)
    assert any(valid)  # on a board with two tiles some slide moves something
    env = TextArenaEnv()
    env.reset(_task_of("2048", 0))
    before = env.observation()
    result = env.step("[jump]")
    assert result.info["invalid_action"] is True and result.done is False
    result = env.step(directions[valid.index(True)])
    assert result.info["invalid_action"] is False and result.observation != before


def test_episode_ends_after_max_steps(monkeypatch):
    monkeypatch.setattr(textarena_env, "MAX_STEPS", 3)
    env = TextArenaEnv()
    env.reset(_task_of("Sudoku", 0))
    for step, move in enumerate(["[0 0 0]", env.available_actions()[0], "[0 0 0]"], start=1):
        result = env.step(move)  # alternating rejected and accepted moves never end the game itself
        assert result.done is (step == 3) and env.engine.state.done is False


def test_each_episode_keeps_its_own_randomness():
    """2048 spawns tiles from `random`: interleaving other sessions must not change an episode."""
    moves = ["[up]", "[left]", "[down]", "[right]"] * 3
    alone = TextArenaEnv()
    alone.reset(_task_of("2048", 5))
    expected = [alone.step(m).observation for m in moves]
    mixed, other = TextArenaEnv(), TextArenaEnv()
    mixed.reset(_task_of("2048", 5))
    seen = []
    for k, move in enumerate(moves):
        other.reset(_task_of("2048", k))  # reseeds TextArena's global generator
        other.step("[left]")
        seen.append(mixed.step(move).observation)
    assert seen == expected


def test_server_refuses_oracle_for_oracle_less_games_and_keeps_the_session(url):
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    request_json(url, "POST", "/reset", {"id": session, "data_idx": _task_of("Minesweeper", 1)})
    status, body = request_json(url, "GET", f"/oracle_action?id={session}")
    assert status == 501 and "no oracle" in body["error"]
    status, result = request_json(url, "POST", "/step", {"id": session, "action": "Thought: corner.\nAction: 0 0"})
    assert status == 200 and result["info"]["invalid_action"] is False and result["info"]["game"] == "Minesweeper"
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": -1})[0] == 400
    assert request_json(url, "POST", "/reset", {"id": session, "data_idx": games.NUM_TASKS})[0] == 400
    assert request_json(url, "POST", "/step", {"id": session, "action": 7})[0] == 400
    request_json(url, "POST", "/close", {"id": session})


def test_oracle_solves_train_tasks_of_every_oracle_game(url):
    """The shared suite plays the test split; here 10 train ids of each oracle game (60)."""
    _, tasks = request_json(url, "GET", "/tasks")
    train = set(tasks["splits"]["train"])
    by_game = collections.defaultdict(list)
    for i in tasks["metadata"]["oracle_task_ids"]:
        if i in train:
            by_game[tasks["metadata"]["game"][i]].append(i)
    ids = sorted(itertools.chain.from_iterable(v[:10] for v in by_game.values()))
    assert len(ids) >= 50 and len(by_game) == 6
    solved = asyncio.run(_run_oracle(url, ids))
    failed = [i for i, ok in solved.items() if not ok]
    assert not failed, f"oracle failed on {failed}"


def test_sft_demonstrations_come_from_tasks_with_an_oracle_only():
    """The RL job's SFT tasks are drawn from the training tasks `/tasks` lists as having an oracle:
    an oracle-less task's demonstration is an HTTP 501 (`infra_error`), a wasted SFT row."""
    from agentgym_jax.config import ConfigError
    from agentgym_jax.job.play import oracle_train_ids
    from environments.room.env import RoomEnv

    info = TextArenaEnv.task_info()
    ids = oracle_train_ids(info)
    assert ids and set(ids) <= set(info.splits["train"])
    assert all(info.metadata["has_oracle"][info.metadata["game"][i]] for i in ids)
    assert len(ids) < len(info.splits["train"])  # some games have no oracle, and they are left out
    assert oracle_train_ids(RoomEnv.task_info()) == list(RoomEnv.task_info().splits["train"])
    no_oracle = dataclasses.replace(info, metadata={**info.metadata, "oracle_task_ids": []})
    with pytest.raises(ConfigError, match="no training task with an oracle"):
        oracle_train_ids(no_oracle)
