"""Wordle feedback: per letter "g" (right place), "y" (elsewhere in the word), "b" (absent).

Standard rules for repeated letters: greens first; then, left to right, a letter is yellow only
while the answer still has unmatched copies of it. `feedback` is the rule on one pair of words;
`feedback_codes` is the same rule vectorized over word arrays for the solver, as base-3 codes
(digit i = position i; 0 b, 1 y, 2 g).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from environments.wordle.words import LENGTH

_DIGIT = {"b": 0, "y": 1, "g": 2}


def feedback(guess: str, answer: str) -> str:
    """E.g. feedback("babes", "abbey") == "y y g g b"."""
    marks = ["b"] * len(guess)
    unmatched = Counter(a for g, a in zip(guess, answer) if g != a)
    for i, (g, a) in enumerate(zip(guess, answer)):
        if g == a:
            marks[i] = "g"
        elif unmatched[g] > 0:
            marks[i] = "y"
            unmatched[g] -= 1
    return " ".join(marks)


def code_of(marks: str) -> int:
    """"b y g g b" -> its base-3 code."""
    return sum(_DIGIT[m] * 3**i for i, m in enumerate(marks.split()))


def encode(words: Sequence[str]) -> np.ndarray:
    """Words -> [n, LENGTH] uint8 letters."""
    return np.frombuffer("".join(words).encode("ascii"), dtype=np.uint8).reshape(len(words), LENGTH)


def feedback_codes(guesses: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """[g, LENGTH] x [n, LENGTH] letters -> [g, n] uint8 feedback codes.

    The r-th not-green copy of a letter in the guess is yellow iff the answer has more than r
    not-green copies of it: the same as handing out yellows left to right.
    """
    # same[i][j]: [g, n], guess letter i == answer letter j. Position-wise [g, n] planes are
    # much faster in numpy than one [g, n, LENGTH, LENGTH] array reduced over its last axis.
    same = [[guesses[:, i, None] == answers[None, :, j] for j in range(LENGTH)] for i in range(LENGTH)]
    open_ = [~same[j][j] for j in range(LENGTH)]  # answer position j not matched by a green
    codes = np.zeros((len(guesses), len(answers)), np.uint8)
    for i in range(LENGTH):
        copies = sum((same[i][j] & open_[j]).view(np.uint8) for j in range(LENGTH))
        repeats = (guesses[:, k] == guesses[:, i] for k in range(i))  # [g] each
        earlier = sum(((r[:, None] & open_[k]).view(np.uint8) for k, r in enumerate(repeats)), np.uint8(0))
        yellow = open_[i] & (copies > earlier)
        codes += (2 * same[i][i].view(np.uint8) + yellow.view(np.uint8)) * np.uint8(3**i)
    return codes


def consistent(history: Sequence[tuple[str, str]], words: np.ndarray) -> np.ndarray:
    """[n] bool: which of `words` [n, LENGTH] would have given every (guess, feedback) seen."""
    keep = np.ones(len(words), bool)
    if history:
        codes = feedback_codes(encode([g for g, _ in history]), words)  # [h, n]
        wanted = np.array([code_of(f) for _, f in history])[:, None]
        keep = (codes == wanted).all(axis=0)
    return keep
