"""Wordle: find a hidden five-letter word in six guesses from per-letter feedback.

LMRL-Gym's format, as AgentGym serves it (under `/wordle`): a guess is written as spaced
letters ("s h i r e"; "shire" is accepted too) and answered with feedback such as "b y g g b".
Reward: 1 for the guess that solves the word, 0 for every other step (AgentGym's shifted
LMRL-Gym reward). The episode ends on the solving guess or after six valid guesses. A guess
that is not a known five-letter word is an invalid action: "invalid word ...", reward 0, and it
does NOT use up a guess.

Task id -> answer: `answer_words()` in a fixed shuffled order (`random.Random(0)`), so early
ids are not all "a..." words; every tenth id is in the test split.
"""

from __future__ import annotations

import functools
import random
import re
from typing import ClassVar

import numpy as np

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment, every_kth_held_out, parse_thought_action
from environments.wordle import solver
from environments.wordle.feedback import consistent, encode, feedback
from environments.wordle.words import LENGTH, allowed_words, answer_words

MAX_GUESSES = 6
TEST_EVERY = 10  # task ids divisible by this form the test split
SHOWN_CANDIDATES = 20  # how many consistent words `available_actions` lists

INSTRUCTION = (
    "Let's play Wordle. A five-letter English word is hidden; find it in at most 6 guesses. "
    'Write a guess as its letters separated by spaces, e.g. "s h i r e". After each guess I '
    "answer with one letter per position:\n"
    '"g": this letter is in the word, at this position.\n'
    '"y": this letter is in the word, but at another position.\n'
    '"b": this letter is not in the word (or not as many times as you used it).\n'
    'For example, "b y g g b" means: letter 1 absent, letter 2 elsewhere, letters 3 and 4 '
    "right, letter 5 absent. A guess must be a real five-letter English word; otherwise I say "
    '"invalid word" and the guess does not count. Use every answer to narrow down the word.\n'
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour guess, e.g. s h i r e"
)


@functools.lru_cache(maxsize=None)
def _task_answers() -> tuple[str, ...]:
    """Task id -> answer word: the sorted answers in a fixed shuffled order."""
    words = list(answer_words())
    random.Random(0).shuffle(words)
    return tuple(words)


@functools.lru_cache(maxsize=None)
def _allowed() -> frozenset[str]:
    return frozenset(allowed_words())


@functools.lru_cache(maxsize=None)
def _encoded_allowed() -> np.ndarray:
    return encode(allowed_words())  # [n_allowed, 5]


def _to_word(action: str) -> str:
    """"S h i r e." -> "shire": lower-case letters only."""
    return re.sub(r"[^a-z]+", "", action.lower())


def _spaced(word: str) -> str:
    return " ".join(word)


class WordleEnv(Environment):
    """One Wordle game."""

    name: ClassVar[str] = "wordle"
    instruction: ClassVar[str] = INSTRUCTION
    route_prefixes: ClassVar[tuple[str, ...]] = ("/wordle",)  # AgentGym's LMRL-Gym server
    extra_queries: ClassVar[tuple[str, ...]] = ("filtered_vocab",)
    blocking: ClassVar[bool] = True  # the oracle's numpy work can take a tenth of a second

    def __init__(self) -> None:
        self.answer: str | None = None
        self.history: list[tuple[str, str]] = []  # [(guess, feedback)], valid guesses only
        self._observation = ""

    @classmethod
    def task_info(cls) -> TaskInfo:
        ids = range(len(_task_answers()))
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(ids), TEST_EVERY),
            num_tasks=len(ids),
            has_oracle=cls.has_oracle,
            metadata={"max_guesses": MAX_GUESSES, "num_allowed_words": len(allowed_words())},
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        action = parse_thought_action(text)
        if action is None:
            return None
        return _to_word(action) or None

    def reset(self, data_idx: int) -> str:
        answers = _task_answers()
        if not 0 <= data_idx < len(answers):
            raise ValueError(f"Wordle task id {data_idx} out of range [0, {len(answers)})")
        self.answer = answers[data_idx]
        self.history = []
        self._observation = f"Let's start Wordle! Guess the hidden {LENGTH}-letter word; you have {MAX_GUESSES} guesses."
        return self._observation

    def step(self, action: str) -> StepResult:
        word = _to_word(action)
        if word not in _allowed():
            self._observation = f"invalid word: {action.strip()!r} is not a {LENGTH}-letter word in the vocabulary; this does not use a guess"
            return self.result(self._observation, 0.0, False, invalid=True, guesses_left=self.guesses_left)
        marks = feedback(word, self.answer)
        self.history.append((word, marks))
        solved = word == self.answer
        done = solved or self.guesses_left == 0
        self._observation = marks
        return self.result(marks, 1.0 if solved else 0.0, done, invalid=False, guesses_left=self.guesses_left)

    @property
    def guesses_left(self) -> int:
        return MAX_GUESSES - len(self.history)

    def observation(self) -> str:
        return self._observation

    def filtered_vocab(self) -> list[str]:
        """Allowed words consistent with all feedback so far (AgentGym's `GET /wordle/filtered_vocab`)."""
        words = allowed_words()
        return [words[i] for i in np.flatnonzero(consistent(self.history, _encoded_allowed()))]

    def available_actions(self) -> list[str]:
        """The first `SHOWN_CANDIDATES` answer words consistent with the feedback, spaced."""
        words = answer_words()
        return [_spaced(words[i]) for i in solver.candidates(self.history)[:SHOWN_CANDIDATES]]

    def verify(self) -> bool:
        return self.answer is not None and any(g == self.answer for g, _ in self.history)

    def oracle_action(self) -> str:
        return _spaced(solver.next_guess(tuple(self.history)))
