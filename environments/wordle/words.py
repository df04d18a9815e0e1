"""Wordle word lists, built from the installed `english-words` package.

The package ships two dictionaries and no frequency list: `web2` (Webster's 2nd, 1934) and
`gcide` (GNU Collaborative International Dictionary of English). Both are full of rare words,
so "common" is approximated by agreement: the answers are the five-letter words in both
(web2's own lower-case entries, so no proper nouns); a guess may be any five-letter word in
either. Sorted tuples, so indices mean the same words in every process.
"""

from __future__ import annotations

import functools

LENGTH = 5


def _five_letter(words: set[str]) -> set[str]:
    return {w for w in words if len(w) == LENGTH and w.isascii() and w.isalpha() and w.islower()}


@functools.lru_cache(maxsize=None)
def _dictionaries() -> tuple[set[str], set[str]]:
    """(web2 lower-case entries, gcide lower-cased alphabetic entries), five-letter words only."""
    from english_words import get_english_words_set

    web2 = _five_letter(get_english_words_set(["web2"]))
    gcide = _five_letter(get_english_words_set(["gcide"], alpha=True, lower=True))
    return web2, gcide


@functools.lru_cache(maxsize=None)
def answer_words() -> tuple[str, ...]:
    """Hidden words: in both dictionaries; sorted."""
    web2, gcide = _dictionaries()
    return tuple(sorted(web2 & gcide))


@functools.lru_cache(maxsize=None)
def allowed_words() -> tuple[str, ...]:
    """Valid guesses: in either dictionary; sorted (a superset of the answers)."""
    web2, gcide = _dictionaries()
    return tuple(sorted(web2 | gcide))
