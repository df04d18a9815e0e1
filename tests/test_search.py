"""The search environment: answer scoring, the verified questions, the AgentGym SearchQA format
through a real server (also via our `searchqa` dialect), the oracle on every test id, a
deterministic cached build, session caps. The shared endpoint/bad-input/determinism tests run
it too (`tests/test_environments.py`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import aiohttp
import pytest

from agentgym_jax.envs.dialects import DialectClient, dialect_client_factory
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from environments.search import corpus
from environments.search.env import (MAX_TURNS, NOTHING_FOUND, SearchEnv, exact_match, f1_score, first_tag, last_answer,
                                     normalize_answer)
from tests.servers import REPO, request_json, start_server


@pytest.fixture(scope="module")
def url():
    with start_server("search", timeout_s=600) as base:
        yield base


@pytest.fixture(scope="module")
def tasks(url):
    return request_json(url, "GET", "/tasks")[1]


def test_answer_normalisation_exact_match_and_f1():
    assert normalize_answer("  The  Euro! ") == "euro"
    assert normalize_answer("an Apple, a pear") == "apple pear"
    assert normalize_answer("7,153,309") == "7153309"
    assert exact_match("the euro", ("Euro",)) and exact_match("+33", ("33",))
    assert not exact_match("euros", ("Euro",))
    assert f1_score("Andorra la Vella", ("Andorra la Vella",)) == 1.0
    # prediction "vella city" vs gold "andorra la vella": 1 common token, P = 1/2, R = 1/3, F1 = 0.4
    assert f1_score("Vella city", ("Andorra la Vella",)) == pytest.approx(0.4)
    assert f1_score("Paris", ("Lyon", "Paris")) == 1.0 and f1_score("Rome", ("Paris",)) == 0.0


def test_tags_are_read_as_the_regexes_read_them_in_linear_time():
    """`first_tag` / `last_answer` against the lazy regexes they replace (quadratic on `<search>`
    repeated: 96 KB of it held a server 24 s), over random soups of tags, then on 1 MB."""
    tag = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
    answer = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
    pieces = ["<search>", "</search>", "<answer>", "</answer>", "<", ">", "/", "search", "answer", "a b", "\n"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        match = tag.search(text)
        assert first_tag(text) == (match.groups() if match else None), text
        if match and match[1] == "answer":
            assert last_answer(text) == answer.findall(text)[-1], text
    for text in ["<search>" * 125_000, "<answer>x</answer>" + "<answer>" * 125_000]:
        start = time.monotonic()
        first_tag(text), last_answer(text)
        assert time.monotonic() - start < 0.5


def test_questions_are_verified_against_the_index_and_need_one_to_three_hops():
    loaded = corpus.load()
    hops = {q.hops for q in loaded.questions}
    assert hops == {1, 2, 3} and {q.template for q in loaded.questions} == set(corpus.TEMPLATES)
    queries = [query for q in loaded.questions for query, _ in q.plan]
    found = iter(corpus.search_many(loaded.retriever, queries))
    for q in loaded.questions:
        assert q.hops == corpus.TEMPLATES[q.template]
        for _, doc in q.plan:
            assert doc in next(found), q  # every planned search finds its document in the top k
        assert q.answers[0] in loaded.documents[q.plan[-1][1]].text, q
        if q.hops > 1:  # the first document alone does not answer it
            assert q.answers[0] not in loaded.documents[q.plan[0][1]].text, q
    lyon = next(q for q in loaded.questions if q.template == "city_capital")
    first, second = (loaded.documents[doc] for _, doc in lyon.plan)
    assert "is a city in" in first.text and second.title in first.text  # the city names its country
    assert f"Its capital is {lyon.answers[0]}." in second.text


def test_search_answers_in_agentgym_searchqa_layout(url, tasks):
    task = next(i for i in tasks["splits"]["test"] if tasks["metadata"]["hops"][i] == 2)
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    status, reset = request_json(url, "POST", "/reset", {"id": session, "data_idx": task})
    assert status == 200 and reset["observation"].startswith("Question: ")
    oracle = request_json(url, "GET", f"/oracle_action?id={session}")[1]["action"]
    query = re.fullmatch(r"<search>(.*)</search>", oracle).group(1)
    reply = f"<think>I should look this up.</think>\n<search> {query} </search>"
    _, result = request_json(url, "POST", "/step", {"id": session, "action": reply})
    body = re.fullmatch(r"<information>(.*)</information>", result["observation"], re.DOTALL).group(1)
    lines = body.split("\n")
    assert len(lines) == corpus.TOP_K and all(line.startswith(f"Doc {i + 1}(Title: ") for i, line in enumerate(lines))
    assert result["reward"] == 0 and not result["done"] and result["info"]["searches"] == 1
    # two tags in one turn: the first decides (as AgentGym's server reads it)
    _, both = request_json(url, "POST", "/step", {"id": session, "action": "<search>Andorra</search> <answer>x</answer>"})
    assert both["observation"].startswith("<information>") and not both["done"]
    _, wrong = request_json(url, "POST", "/step", {"id": session, "action": "<answer>Atlantis</answer>"})
    assert wrong["done"] and wrong["reward"] == 0 and wrong["info"]["success"] is False
    assert wrong["info"]["em"] == 0 and wrong["info"]["f1"] == 0 and "incorrect" in wrong["observation"]
    assert request_json(url, "POST", "/step", {"id": session, "action": "<answer>x</answer>"})[0] == 409
    request_json(url, "POST", "/close", {"id": session})


def test_the_last_answer_block_counts_and_f1_is_reported(url, tasks):
    task = tasks["splits"]["test"][0]
    _, created = request_json(url, "POST", "/create", {})
    session = created["id"]
    request_json(url, "POST", "/reset", {"id": session, "data_idx": task})
    gold = SearchEnv()
    gold.reset(task)
    answer = gold.question.answers[0]
    text = f"<answer>wrong guess</answer> on second thought <answer> the {answer.upper()}. </answer>"
    _, result = request_json(url, "POST", "/step", {"id": session, "action": text})
    assert result["done"] and result["reward"] == 1.0 and result["info"]["success"] and result["info"]["f1"] == 1.0
    request_json(url, "POST", "/close", {"id": session})


def test_invalid_turns_and_the_turn_limit():
    env = SearchEnv()
    env.reset(0)
    for turn in range(1, MAX_TURNS + 1):
        result = env.step("I think the answer is Paris." if turn % 2 else "<search>   </search>")
        assert result.info["invalid_action"] and result.reward == 0
        assert result.done == (turn == MAX_TURNS)
    assert "used all" in result.observation and not env.verify()


def test_queries_without_indexed_words_and_huge_queries_are_ordinary_turns():
    env = SearchEnv()
    env.reset(0)
    for query in ("the of and", "???", "zzqqxx", "東京"):  # stopwords, punctuation, unknown words
        result = env.step(f"<search>{query}</search>")
        assert result.observation == f"<information>{NOTHING_FOUND}</information>", query
        assert not result.info["invalid_action"] and not result.done
    env.turns = 0
    huge = env.step("<search>" + "Lyon " * 50_000 + "</search>")  # cut at MAX_QUERY_CHARS
    assert huge.observation.startswith("<information>Doc 1(Title: Lyon)")


def test_oracle_solves_every_test_id():
    loaded = corpus.load()
    test_ids = SearchEnv.task_info().splits["test"]
    solved = 0
    for task in test_ids:
        env = SearchEnv()
        env.reset(task)
        for _ in range(MAX_TURNS):
            result = env.step(env.oracle_action())
            if result.done:
                break
        solved += bool(result.info["success"]) and env.searches == [q for q, _ in loaded.questions[task].plan]
    assert solved / len(test_ids) >= 0.99 and len(test_ids) > 200


def test_searchqa_dialect_plays_against_our_server(url, tasks):
    """Our client in AgentGym SearchQA's dialect (`env_idx`, `{"env_idx", "id"}` at /reset)."""
    test_ids = [i for i in tasks["splits"]["test"] if tasks["metadata"]["hops"][i] == 3][:4]

    async def main():
        async with EnvPool(url, client_factory=dialect_client_factory("searchqa")) as pool:
            episodes = [await pool.run_episode(task, pool.oracle_policy) for task in test_ids]
        async with aiohttp.ClientSession() as http:
            client = DialectClient(url, http, dialect="searchqa")
            session = await client.create()
            first = await client.reset(session, test_ids[0])
            await client.close(session)
        return episodes, first

    episodes, first = asyncio.run(main())
    assert all(e.status is EpisodeStatus.SUCCESS and len(e.turns) == 4 for e in episodes)  # 3 searches + answer
    assert first == SearchEnv().reset(test_ids[0])


def test_session_cap():
    with start_server("search", max_sessions=2, timeout_s=600) as capped:  # may build the corpus first
        ids = [request_json(capped, "POST", "/create", {})[1]["id"] for _ in range(2)]
        status, body = request_json(capped, "POST", "/create", {})
        assert status == 503 and "session cap 2" in body["error"]
        request_json(capped, "POST", "/close", {"id": ids[0]})
        assert request_json(capped, "POST", "/create", {})[0] == 200


def _digest(folder: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a full rebuild: 30-70 s on 2 loaded cores
def test_build_is_deterministic_across_processes(tmp_path):
    """A fresh build in another process (another hash seed) writes the same files as the cache."""
    cached = _digest(corpus.ensure_built())
    script = "import sys, pathlib; from environments.search import corpus; corpus.ensure_built(pathlib.Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "2", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, cwd=REPO, timeout=300)
    fresh = _digest(tmp_path / corpus.CORPUS_VERSION)
    assert fresh == cached and {"corpus.jsonl", "questions.json"} <= set(fresh)
