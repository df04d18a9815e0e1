"""Wordle feedback on hand-worked repeated-letter cases, the env's rules, the oracle, task ids."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from environments.wordle import solver
from environments.wordle.env import MAX_GUESSES, SHOWN_CANDIDATES, WordleEnv, _task_answers
from environments.wordle.feedback import code_of, encode, feedback, feedback_codes
from environments.wordle.words import allowed_words, answer_words

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Worked by hand: greens first, then yellows left to right while unmatched copies remain.
HAND_WORKED = [
    ("babes", "abbey", "y y g g b"),  # one b green; the other b yellow; a yellow; e green
    ("kebab", "abbey", "b y g y y"),
    ("bobby", "abbey", "y b g b g"),  # three b's in the guess, two in the answer (one green)
    ("geese", "those", "b b b g g"),  # the last e is green, so the other two are absent
    ("eerie", "there", "y b y b g"),
    ("abbey", "abbey", "g g g g g"),
]


@pytest.mark.parametrize("guess, answer, marks", HAND_WORKED)
def test_feedback_hand_worked(guess, answer, marks):
    assert feedback(guess, answer) == marks


def test_vectorized_feedback_matches_the_rule():
    rng = random.Random(0)
    words = allowed_words()
    guesses = [g for g, _, _ in HAND_WORKED] + rng.sample(words, 200)
    answers = [a for _, a, _ in HAND_WORKED] + rng.sample(words, 200)
    codes = feedback_codes(encode(guesses), encode(answers))
    expected = np.array([[code_of(feedback(g, a)) for a in answers] for g in guesses])
    np.testing.assert_array_equal(codes, expected)
    assert code_of("g g g g g") == 242 and code_of("b y b b b") == 3


def test_word_lists():
    answers, allowed = answer_words(), allowed_words()
    for words in (answers, allowed):
        assert list(words) == sorted(set(words))
        assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in words)
    assert set(answers) <= set(allowed) and len(answers) > 2000
    assert {"abbey", "those", "crane"} <= set(answers) and "xyzzy" not in allowed


@pytest.fixture
def abbey() -> WordleEnv:
    env = WordleEnv()
    env.reset(_task_answers().index("abbey"))
    return env


def test_guesses_feedback_and_solve(abbey):
    env = abbey
    r = env.step("k e b a b")
    assert (r.observation, r.reward, r.done, r.info["invalid_action"]) == ("b y g y y", 0.0, False, False)
    assert r.info["guesses_left"] == MAX_GUESSES - 1
    r = env.step("Bobby")  # unspaced and capitalized is accepted too
    assert r.observation == "y b g b g" and not r.done
    r = env.step("a b b e y")
    assert (r.observation, r.reward, r.done, r.info["success"]) == ("g g g g g", 1.0, True, True)
    assert env.verify() and env.score() == 1.0


@pytest.mark.parametrize("guess", ["x y z z y", "abc", "crane slate", "babes", ""])
def test_invalid_guess_does_not_use_a_guess(abbey, guess):
    r = abbey.step(guess)
    assert r.info["invalid_action"] and r.reward == 0.0 and not r.done
    assert r.observation.startswith("invalid word")
    assert r.info["guesses_left"] == MAX_GUESSES and abbey.history == []


def test_six_wrong_guesses_fail(abbey):
    for i, word in enumerate(["crane", "those", "there", "geese", "kebab", "bobby"]):
        r = abbey.step(word)
        assert r.reward == 0.0 and r.done == (i == MAX_GUESSES - 1)
    assert not abbey.verify() and abbey.score() == 0.0 and not r.info["success"]


def test_parse_action():
    text = 'Thought:\nAn "e" is in the word.\n\nAction:\ns h i r e\n'
    assert WordleEnv.parse_action(text) == "shire"
    assert WordleEnv.parse_action("Action: S-H-I-R-E.") == "shire"
    assert WordleEnv.parse_action("Action: 12345") is None


def test_candidates_and_filtered_vocab_follow_feedback(abbey):
    assert abbey.available_actions() == [" ".join(w) for w in answer_words()[:SHOWN_CANDIDATES]]
    abbey.step("kebab")
    shown = [a.replace(" ", "") for a in abbey.available_actions()]
    vocab = abbey.filtered_vocab()
    assert 0 < len(shown) <= SHOWN_CANDIDATES and "abbey" in vocab and len(vocab) < len(allowed_words())
    for word in shown + vocab:
        assert feedback("kebab", word) == "b y g y y"
    everything = [w for w in allowed_words() if feedback("kebab", w) == "b y g y y"]
    assert vocab == everything


def test_task_info_splits():
    info = WordleEnv.task_info()
    train, test = info.splits["train"], info.splits["test"]
    assert train == sorted(train) and test == sorted(test) and not set(train) & set(test)
    assert sorted(train + test) == list(range(info.num_tasks)) and len(test) >= 100
    assert sorted(_task_answers()) == list(answer_words())  # every answer is exactly one task
    with pytest.raises(ValueError, match="out of range"):
        WordleEnv().reset(info.num_tasks)


def _play_oracle(env: WordleEnv) -> bool:
    while True:
        r = env.step(env.oracle_action())
        assert not r.info["invalid_action"]
        if r.done:
            return env.verify()


def test_oracle_solves_the_test_split():
    ids = WordleEnv.task_info().splits["test"][:150]
    env = WordleEnv()
    solved = 0
    for idx in ids:
        env.reset(idx)
        solved += _play_oracle(env)
        assert len(env.history) <= MAX_GUESSES
    rate = solved / len(ids)
    print(f"wordle oracle: {solved}/{len(ids)} test ids solved in {MAX_GUESSES} guesses ({rate:.3f})")
    assert rate >= 0.99


def test_oracle_continues_after_foreign_guesses():
    env = WordleEnv()
    for idx in WordleEnv.task_info().splits["train"][:8]:
        env.reset(idx)
        env.step("jumpy")
        env.step("not a word")
        assert _play_oracle(env), env.answer


@pytest.mark.slow
def test_opening_constant_is_the_computed_best():
    assert solver.opening_guess() == solver.OPENING


def test_task_ids_do_not_depend_on_hash_seed():
    ids = [0, 1, 10, 4000]
    code = (
        "import json; from environments.wordle.env import WordleEnv; e = WordleEnv(); out = []\n"
        f"for i in {ids}:\n    e.reset(i); out.append(e.step('crane').observation + ' ' + e.answer)\n"
        "print(json.dumps(out))"
    )
    outputs = []
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": REPO}
        proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        outputs.append(json.loads(proc.stdout))
    local = []
    for i in ids:
        e = WordleEnv()
        e.reset(i)
        local.append(e.step("crane").observation + " " + e.answer)
    assert outputs[0] == outputs[1] == local
