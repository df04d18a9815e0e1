"""Movie (AgentGym's tool environment) on the IMDb film table of R's ggplot2movies.

AgentGym's Movie calls The Movie Database's web API; here the tools answer from the 58,788 films
of R's `ggplot2movies` data (IMDb, 2005: title, year, length, budget, average user rating, votes,
MPAA rating, genre flags), shipped offline by `pydataset`. The film ids are the table's row
numbers. AgentGym's person tools (cast, crew, birthplaces) have no packaged counterpart and are
left out rather than invented; `get_top_movies` (the most-voted films of a year) takes their place
as the second kind of lookup. Questions are about films with at least `KNOWN_VOTES` votes and
always name the year, as titles repeat.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import random
from typing import Any, Callable, ClassVar, Iterator

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.tools import data
from environments.tools.base import (
    Result, Step, Tool, ToolEnvironment, ToolTask, arg, failure)

GENRES = ("Action", "Animation", "Comedy", "Drama", "Documentary", "Romance", "Short")
KNOWN_VOTES = 5000  # questions ask about films this many IMDb users rated
SEARCH_RESULTS = 10
TOP_MOVIES = 10
PER_TEMPLATE = 30
TASKS_VERSION = "movie-v1"


@dataclasses.dataclass(frozen=True)
class Film:
    id: str
    title: str
    year: int
    length: int
    budget: int | None
    rating: float
    votes: int
    mpaa: str
    genres: tuple[str, ...]

    def details(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "year": self.year, "length_minutes": self.length,
                "budget_usd": self.budget, "rating": self.rating, "votes": self.votes,
                "mpaa": self.mpaa or None, "genres": list(self.genres)}

    def label(self) -> str:
        return f"'{self.title}' ({self.year})"


@functools.lru_cache(maxsize=None)
def films() -> dict[str, Film]:
    table = {}
    for row in data.pydataset_csv("ggplot2", "movies"):
        film = Film(id=row[""], title=row["title"], year=int(row["year"]), length=int(row["length"]),
                    budget=None if row["budget"] == "NA" else int(float(row["budget"])), rating=float(row["rating"]),
                    votes=int(row["votes"]), mpaa=row["mpaa"], genres=tuple(g for g in GENRES if row[g] == "1"))
        table[film.id] = film
    return table


@functools.lru_cache(maxsize=None)
def known_films() -> tuple[Film, ...]:
    """Films questions may ask about: much rated, the only one of their title in their year, and
    found by a search for their exact title."""
    same_year = collections.Counter((f.title.casefold(), f.year) for f in films().values())
    same_title = collections.Counter(f.title.casefold() for f in films().values())
    return tuple(f for f in films().values() if f.votes >= KNOWN_VOTES and same_year[(f.title.casefold(), f.year)] == 1
                 and same_title[f.title.casefold()] <= SEARCH_RESULTS)


def top_movies(year: int, genre: str | None) -> list[Film]:
    chosen = [f for f in films().values() if f.year == year and (genre is None or genre in f.genres)]
    return sorted(chosen, key=lambda f: (-f.votes, f.title, f.id))[:TOP_MOVIES]


MOVIE_ID = dict([arg("movie_id", "string", "The ID of the movie.")])
TOOLS = (
    Tool("get_search_movie", "Search for a movie by its title.",
         dict([arg("movie_name", "string", "The name of the movie to search for.")]), ("movie_name",),
         f"Up to {SEARCH_RESULTS} movies: their id, title and year (exact title matches first)."),
    Tool("get_movie_details", "Get the details of a movie.", MOVIE_ID, ("movie_id",),
         "The title, year, length in minutes, budget in US dollars (null when unknown), average IMDb user "
         "rating (1-10), number of votes, MPAA rating and genres of the movie."),
    Tool("get_top_movies", "List the movies of a year that the most IMDb users rated, optionally of one genre.",
         dict([arg("year", "integer", "The release year."),
               arg("genre", "string", "A genre to keep (optional).", enum=list(GENRES))]), ("year",),
         f"Up to {TOP_MOVIES} movies (id, title, votes, rating), the most votes first."),
)
EXAMPLE = (
    "Goal: How long is the movie 'Heat' (1995) in minutes?\n"
    "Thought: I need the movie's id first.\n\nAction: get_search_movie with Action Input: {\"movie_name\": \"Heat\"}\n"
    "Observation: {\"results\": [{\"id\": \"22460\", \"title\": \"Heat\", \"year\": 1995}, {\"id\": \"22458\", "
    "\"title\": \"Heat\", \"year\": 1972}, {\"id\": \"22459\", \"title\": \"Heat\", \"year\": 1986}, ...]}\n"
    "Thought: The 1995 film has id 22460.\n\nAction: get_movie_details with Action Input: {\"movie_id\": \"22460\"}\n"
    "Observation: {\"id\": \"22460\", \"title\": \"Heat\", \"year\": 1995, \"length_minutes\": 188, ...}\n"
    "Thought: It is 188 minutes long.\n\nAction: finish with Action Input: {\"answer\": 188}\nObservation: 188\n"
)
INTRO = "You can use actions to help people solve problems about movies (IMDb data of 2005)."
RULES = "Look movies up with get_search_movie before asking for their details; do not guess ids."


# ---- tasks ----

TaskMaker = Callable[[random.Random], Iterator[ToolTask]]
TEMPLATES: dict[str, TaskMaker] = {}


def template(fn: TaskMaker) -> TaskMaker:
    TEMPLATES[fn.__name__] = fn
    return fn


def _lookup(film: Film) -> list[Step]:
    return [Step(ToolCall("get_search_movie", {"movie_name": film.title}), frozenset({f"movie:{film.id}"})),
            Step(ToolCall("get_movie_details", {"movie_id": film.id}), frozenset({f"details:{film.id}"}))]


def _one_film(name: str, goal: Callable[[Film], str], answer: Callable[[Film], Any],
              keep: Callable[[Film], bool] = lambda f: True) -> TaskMaker:
    def make(rng: random.Random) -> Iterator[ToolTask]:
        pool = [f for f in known_films() if keep(f)]
        for film in rng.sample(pool, PER_TEMPLATE):
            yield ToolTask(goal(film), answer(film), tuple(_lookup(film)), name)
    make.__name__ = name
    return template(make)


_one_film("movie_rating", lambda f: f"What is the average IMDb user rating of the movie {f.label()}? Please answer "
          "with a number.", lambda f: f.rating)
_one_film("movie_length", lambda f: f"How many minutes long is the movie {f.label()}? Please answer with a number.",
          lambda f: f.length)
_one_film("movie_budget", lambda f: f"What was the budget of the movie {f.label()} in US dollars? Please answer with "
          "a number.", lambda f: f.budget, keep=lambda f: f.budget is not None)
_one_film("movie_genres", lambda f: f"Which genres is the movie {f.label()} listed under? Please answer in the form "
          "of a list ['genre1', 'genre2', ...].", lambda f: list(f.genres), keep=lambda f: bool(f.genres))
_one_film("movie_mpaa", lambda f: f"What MPAA rating did the movie {f.label()} receive? Please answer with the rating "
          "as a string.", lambda f: f.mpaa, keep=lambda f: bool(f.mpaa))


def _pairs(rng: random.Random, differ: Callable[[Film, Film], bool]) -> Iterator[tuple[Film, Film]]:
    pool, made = list(known_films()), 0
    while made < PER_TEMPLATE:
        a, b = rng.sample(pool, 2)
        if differ(a, b) and a.title.casefold() != b.title.casefold():
            made += 1
            yield a, b


@template
def higher_rating(rng: random.Random) -> Iterator[ToolTask]:
    for a, b in _pairs(rng, lambda a, b: a.rating != b.rating):
        yield ToolTask(f"{a.label()} versus {b.label()}: which has the higher average IMDb rating? Please answer with "
                       "the film's title as a string.", max(a, b, key=lambda f: f.rating).title,
                       tuple(_lookup(a) + _lookup(b)), "higher_rating")


@template
def more_votes(rng: random.Random) -> Iterator[ToolTask]:
    for a, b in _pairs(rng, lambda a, b: a.votes != b.votes):
        yield ToolTask(f"Which of {a.label()} and {b.label()} was rated by more IMDb users? Please answer with the "
                       "film's title as a string.", max(a, b, key=lambda f: f.votes).title,
                       tuple(_lookup(a) + _lookup(b)), "more_votes")


@template
def length_difference(rng: random.Random) -> Iterator[ToolTask]:
    for a, b in _pairs(rng, lambda a, b: a.length > b.length):
        yield ToolTask(f"How many minutes longer is {a.label()} than {b.label()}? Please answer with a number.",
                       a.length - b.length, tuple(_lookup(a) + _lookup(b)), "length_difference")


@template
def top_movie_of_year(rng: random.Random) -> Iterator[ToolTask]:
    choices = [(year, genre) for year in range(1970, 2005) for genre in (None,) + GENRES[:4]]
    made = 0
    for year, genre in rng.sample(choices, len(choices)):
        top = top_movies(year, genre)
        if len(top) < 2 or top[0].votes == top[1].votes or top[0].votes < KNOWN_VOTES:
            continue
        arguments = {"year": year} if genre is None else {"year": year, "genre": genre}
        kind = "movie" if genre is None else f"{genre} movie"
        plan = (Step(ToolCall("get_top_movies", arguments), frozenset({f"top:{year}:{genre or ''}"})),)
        yield ToolTask(f"Which {kind} released in {year} was rated by the most IMDb users? Please answer with the "
                       "film's title as a string.", top[0].title, plan, "top_movie_of_year")
        made += 1
        if made == PER_TEMPLATE:
            return


@template
def rating_of_top_movie(rng: random.Random) -> Iterator[ToolTask]:
    years, made = rng.sample(range(1960, 2005), 45), 0
    for year in years:
        top = top_movies(year, "Comedy")
        if len(top) < 2 or top[0].votes == top[1].votes or top[0].votes < KNOWN_VOTES:
            continue
        film = top[0]
        plan = (Step(ToolCall("get_top_movies", {"year": year, "genre": "Comedy"}), frozenset({f"top:{year}:Comedy"})),
                Step(ToolCall("get_movie_details", {"movie_id": film.id}), frozenset({f"details:{film.id}"})))
        yield ToolTask(f"What is the average IMDb rating of the comedy from {year} that the most IMDb users rated? "
                       "Please answer with a number.", film.rating, plan, "rating_of_top_movie")
        made += 1
        if made == PER_TEMPLATE:
            return


@functools.lru_cache(maxsize=None)
def movie_tasks() -> tuple[ToolTask, ...]:
    tasks = [t for name, make in TEMPLATES.items() for t in make(random.Random(f"{TASKS_VERSION}:{name}"))]
    random.Random(TASKS_VERSION).shuffle(tasks)
    return tuple(tasks)


class MovieEnv(ToolEnvironment):
    """Questions about films answered from the IMDb table; stateless tools."""

    name: ClassVar[str] = "movie"
    intro: ClassVar[str] = INTRO
    rules: ClassVar[str] = RULES
    example: ClassVar[str] = EXAMPLE
    tools: ClassVar[tuple[Tool, ...]] = TOOLS

    @classmethod
    def all_tasks(cls) -> tuple[ToolTask, ...]:
        return movie_tasks()

    def tool_get_search_movie(self, movie_name: str) -> Result:
        key = " ".join(movie_name.split()).casefold()
        if not key:
            return failure("Error: the movie name is empty.")
        exact, starts, contains = [], [], []
        for film in films().values():
            title = film.title.casefold()
            if title == key:
                exact.append(film)
            elif title.startswith(key):
                starts.append(film)
            elif key in title:
                contains.append(film)
        by_votes = lambda f: (-f.votes, f.year, f.id)  # noqa: E731
        found = (sorted(exact, key=by_votes) + sorted(starts, key=by_votes) + sorted(contains, key=by_votes))[:SEARCH_RESULTS]
        if not found:
            return failure(f"Error: no movie titled like {movie_name!r} was found.")
        return Result({"results": [{"id": f.id, "title": f.title, "year": f.year} for f in found]},
                      frozenset(f"movie:{f.id}" for f in found))

    def tool_get_movie_details(self, movie_id: str) -> Result:
        film = films().get(movie_id.strip())
        if film is None:
            return failure(f"Error: there is no movie with id {movie_id!r}; find ids with get_search_movie.")
        return Result(film.details(), frozenset({f"details:{film.id}"}))

    def tool_get_top_movies(self, year: int, genre: str | None = None) -> Result:
        top = top_movies(year, genre)
        if not top:
            return failure(f"Error: no {genre + ' ' if genre else ''}movies from {year} in the data (1893-2005).")
        return Result({"results": [{"id": f.id, "title": f.title, "votes": f.votes, "rating": f.rating} for f in top]},
                      frozenset({f"top:{year}:{genre or ''}"}))
