"""The Wordle oracle: keep the answers consistent with all feedback, then split them best.

Each turn the candidates are the answer words that would have produced every feedback seen so
far. The guess is the answer word that minimizes the expected number of candidates left (the
sum of squared feedback-class sizes); a candidate wins ties (it may be right), then the
alphabetically first word. With one or two candidates left it guesses a candidate.

Guessing only candidates ("hard mode") solved 98.1-98.3% of this 4758-word answer list in six
guesses (trap sets such as `_ight` eat the guesses); allowing probe words solves all of them.
The opening guess is the same for every task, so it is a constant (checked by a slow test).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from environments.wordle.feedback import consistent, encode, feedback_codes
from environments.wordle.words import answer_words

NUM_CODES = 3**5
OPENING = "raise"  # == opening_guess() for english-words 2.0.2; tests recompute it
_CHUNK = 512  # guesses per feedback block: [512, n] uint8 blocks keep memory small


@functools.lru_cache(maxsize=None)
def _answers() -> np.ndarray:
    return encode(answer_words())  # [n, 5]


def candidates(history: Sequence[tuple[str, str]]) -> np.ndarray:
    """Indices into `answer_words()` consistent with every (guess, feedback) pair."""
    return np.flatnonzero(consistent(history, _answers()))


def _expected_left(candidate_ids: np.ndarray) -> np.ndarray:
    """[n_answers] sum over feedback classes of class size squared, if each answer is guessed."""
    answers = _answers()
    targets = answers[candidate_ids]
    scores = []
    for start in range(0, len(answers), _CHUNK):
        codes = feedback_codes(answers[start : start + _CHUNK], targets).astype(np.int64)  # [c, k]
        rows = np.arange(len(codes))[:, None] * NUM_CODES  # one bincount row per guess
        counts = np.bincount((codes + rows).ravel(), minlength=len(codes) * NUM_CODES)
        scores.append((counts.reshape(len(codes), NUM_CODES) ** 2).sum(axis=1))  # [c]
    return np.concatenate(scores)


def _best(candidate_ids: np.ndarray) -> str:
    words = answer_words()
    if len(candidate_ids) <= 2:
        return words[candidate_ids[0]]
    score = 2 * _expected_left(candidate_ids)
    score[candidate_ids] -= 1  # a candidate may win outright: it beats an equal probe
    return words[int(np.argmin(score))]  # argmin: first, i.e. alphabetical, on ties


def opening_guess() -> str:
    """The best first guess, computed from scratch (about ten seconds; `OPENING` caches it)."""
    return _best(np.arange(len(answer_words())))


@functools.lru_cache(maxsize=4096)
def next_guess(history: tuple[tuple[str, str], ...]) -> str:
    """The oracle's guess after `history` ((guess, feedback "b y g g b"), ...).

    Cached: games that share their first feedbacks share the (costly) early decisions.
    """
    if not history:
        return OPENING
    left = candidates(history)
    if len(left) == 0:
        raise ValueError("no answer word is consistent with the feedback so far")
    return _best(left)
