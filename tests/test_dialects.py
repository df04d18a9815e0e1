"""Dialect adapters against our servers (AgentGym-compatible mode) and against in-test servers
that speak AgentGym's own wire format (HTTP 200 with `{"error"}` strings, bare ids, `score`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import urllib.request
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentgym_jax.envs.client import EnvServerError
from agentgym_jax.envs.dialects import DIALECTS, DialectClient, dialect_client_factory, get_dialect
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus
from tests.servers import request_json, start_server


@pytest.fixture(scope="module")
def ours():
    with LocalServers(["maze", "textcraft", "babyai", "wordle"]) as servers:
        yield servers.urls


@pytest.mark.parametrize("env", ["maze", "textcraft", "babyai", "wordle"])
def test_dialect_plays_the_same_episode_as_the_native_protocol(ours, env):
    """Through AgentGym's paths and field names our server must give the identical transcript."""

    async def play(**pool_kwargs):
        async with EnvPool(ours[env], **pool_kwargs) as pool:
            task = (await pool.tasks()).splits["test"][0]
            return await pool.run_episode(task, pool.oracle_policy)

    native = asyncio.run(play())
    spoken = asyncio.run(play(client_factory=dialect_client_factory(env)))
    assert native.status is EpisodeStatus.SUCCESS and spoken.status is EpisodeStatus.SUCCESS
    assert spoken.first_observation == native.first_observation and spoken.turns == native.turns


def test_maze_dialect_uses_the_prefix_and_game_field(ours):
    async def main():
        async with aiohttp.ClientSession() as http:
            client = DialectClient(ours["maze"], http, dialect="maze")
            session = await client.create()
            observation = await client.reset(session, 7)
            actions = await client.available_actions(session)
            # the same reset in our field names on the unprefixed path gives the same observation
            plain = await client.request("POST", "/reset", body={"id": session, "data_idx": 7})
            return observation, actions, plain["observation"], await client.health()

    observation, actions, plain, health = asyncio.run(main())
    assert observation == plain and "move up" in actions and health["env"] == "maze"


# --- a server that speaks AgentGym's wire format -------------------------------------------------


class AgentGymLike:
    """AgentGym's TextCraft / BabyAI wire format over a toy game: task k is solved by `solve k`.

    Bodies are checked like AgentGym's pydantic models (`id: int`, `action: str`, `data_idx: int`);
    failures come back as HTTP 200 `{"error": ...}`, as in their env wrappers.
    """

    def __init__(self, flavour: str):
        self.flavour = flavour
        self.sessions: dict[int, dict[str, Any]] = {}
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.get("/", lambda r: web.json_response(f"This is environment {self.flavour}.")),
            web.post("/create", self.create), web.post("/reset", self.reset), web.post("/step", self.step),
            web.get("/observation", self.observation), web.post("/close", self.close),
        ])
        return app

    async def _body(self, request: web.Request, **schema: type) -> dict[str, Any]:
        body = await request.json() if request.can_read_body else {}
        self.requests.append((request.path, body))
        for key, kind in schema.items():
            if not isinstance(body.get(key), kind):
                raise web.HTTPUnprocessableEntity(text=f'{{"detail": "field {key} must be {kind.__name__}"}}',
                                                  content_type="application/json")
        return body

    def _check(self, idx: int) -> dict[str, Any] | None:
        session = self.sessions.get(idx)
        if session is None:
            raise LookupError(f"The id {idx} is not valid.")
        if session["done"] and self.flavour == "BabyAI":
            raise LookupError(f"The task with environment {idx} has finished.")
        return session

    async def create(self, request: web.Request) -> web.Response:
        await self._body(request)
        idx = len(self.sessions)
        self.sessions[idx] = {"task": 0, "done": False, "observation": "", "score": 0.0}
        answer = {"id": idx}
        if self.flavour == "TextCraft":
            answer.update(observation="Crafting commands: ...", done=False, reward=0)
        return web.json_response(answer)

    async def reset(self, request: web.Request) -> web.Response:
        body = await self._body(request, id=int, data_idx=int)
        session = self.sessions.get(body["id"])
        if session is None:
            return web.json_response({"error": f"The id {body['id']} is not valid."})
        session.update(task=body["data_idx"], done=False, score=0.0, observation=f"Goal: solve {body['data_idx']}")
        return web.json_response({"id": body["id"], "observation": session["observation"], "done": False,
                                  "reward": 0, "score": 0, "deleted": False})

    async def step(self, request: web.Request) -> web.Response:
        body = await self._body(request, id=int, action=str)
        try:
            session = self._check(body["id"])
        except LookupError as e:
            return web.json_response({"error": str(e)})
        solved = body["action"] == f"solve {session['task']}"
        session.update(done=solved, observation="Crafted!" if solved else "Could not do that.")
        answer = {"observation": session["observation"], "reward": 1 if solved else 0, "done": solved}
        if self.flavour == "BabyAI":  # their client reads `score` as the reward; `reward` is something else
            # solved at step 5 of max_steps 40: score = 1 - 0.9 * 5 / 40, "The task is completed."
            session["score"] = 1 - 0.9 * 5 / 40 if solved else 0.0
            answer.update(reward=0.25 if solved else 0.0, score=session["score"])
            if solved:
                answer["observation"] += "\n The task is completed."
        return web.json_response(answer)

    async def observation(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.query)))
        session = self.sessions.get(int(request.query["id"]))
        if session is None:
            return web.json_response({"error": f"The id {request.query['id']} is not valid."})
        return web.json_response(session["observation"])  # a bare JSON string, as TextCraft does

    async def close(self, request: web.Request) -> web.Response:
        body = await self._body(request, id=int)
        return web.json_response(self.sessions.pop(body["id"], None) is not None)


@contextlib.asynccontextmanager
async def agentgym_like(flavour: str):
    fake = AgentGymLike(flavour)
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("dialect, flavour", [("textcraft", "TextCraft"), ("babyai", "BabyAI")])
def test_adapter_speaks_agentgym_wire_format(dialect, flavour):
    async def main():
        async with agentgym_like(flavour) as (fake, url), aiohttp.ClientSession() as http:
            client = DialectClient(url, http, dialect=dialect)
            session = await client.create()
            first = await client.reset(session, 3)
            miss = await client.step(session, "solve 4")
            hit = await client.step(session, "solve 3")
            observed = await client.observation(session)
            with pytest.raises(EnvServerError) as unknown:
                await client.step(session + 100, "solve 3")
            finished = None
            if flavour == "BabyAI":
                with pytest.raises(EnvServerError) as finished:
                    await client.step(session, "solve 3")
            health = await client.health()
            await client.close(session)
            return fake, session, first, miss, hit, observed, unknown.value, finished, health

    fake, session, first, miss, hit, observed, unknown, finished, health = asyncio.run(main())
    assert first == "Goal: solve 3" and observed == "Crafted!"
    assert (miss.reward, miss.done, miss.info["success"]) == (0.0, False, False)
    # BabyAI: the reward is `score` (not `reward`), below 1 for a solved episode, and a success
    solved_reward = 0.8875 if flavour == "BabyAI" else 1.0
    assert (hit.reward, hit.done, hit.info["success"]) == (solved_reward, True, True)
    assert unknown.status == 404 and "is not valid" in unknown.message  # a 200 answer, typed as the error it is
    if finished is not None:
        assert finished.value.status == 409 and "has finished" in finished.value.message
    assert health["greeting"] == f"This is environment {flavour}."
    bodies = dict((path, body) for path, body in fake.requests if path in ("/reset", "/close"))
    assert bodies["/reset"] == {"id": session, "data_idx": 3} and bodies["/close"] == {"id": session}
    assert fake.sessions == {}


def test_pool_over_an_agentgym_server_ends_lost_sessions_with_infra_error():
    async def main():
        async with agentgym_like("TextCraft") as (fake, url):
            async with EnvPool(url, client_factory=dialect_client_factory("textcraft"), max_retries=1) as pool:

                async def solver(slot: int, observation: str) -> str:
                    return observation.removeprefix("Goal: ")

                won = await pool.run_episode(5, solver)
                await pool.reset(0, 2)
                fake.sessions.clear()  # the server forgot every session (their servers restart without notice)
                lost = await pool.step(0, "solve 2")
                again = await pool.reset(0, 2)  # a reset opens a new session
                return won, lost, again

    won, lost, again = asyncio.run(asyncio.wait_for(main(), 20))
    assert won.status is EpisodeStatus.SUCCESS and len(won.turns) == 1 and won.reward == 1.0
    assert lost.status is EpisodeStatus.INFRA_ERROR and "is not valid" in lost.error
    assert again.status is None and again.observation == "Goal: solve 2"


def test_every_dialect_is_documented_and_unknown_names_fail():
    from tests.servers import REPO

    table = (REPO / "docs" / "dialects.md").read_text()
    for name, dialect in DIALECTS.items():
        assert f"| {name} |" in table and f"`{dialect.reset_field}`" in table
    with pytest.raises(KeyError, match="valid: .*textcraft"):
        get_dialect("minecraft")


def test_babyai_success_is_done_and_other_dialects_keep_their_threshold():
    """The rule AgentGym's BabyAI server implies (done only when solved) vs TextCraft's reward >= 1."""

    async def main():
        async with agentgym_like("BabyAI") as (_, url), aiohttp.ClientSession() as http:
            babyai = DialectClient(url, http, dialect="babyai")
            session = await babyai.create()
            await babyai.reset(session, 2)
            solved = await babyai.step(session, "solve 2")
            textcraft_rule = DialectClient(url, http, dialect="textcraft")  # same answers, reward >= 1 rule
            again = await textcraft_rule.create()
            await textcraft_rule.reset(again, 2)
            return solved, await textcraft_rule.step(again, "solve 2")

    solved, thresholded = asyncio.run(main())
    assert solved.done and solved.reward == pytest.approx(0.8875) and solved.info["success"] is True
    assert "The task is completed." in solved.observation
    assert thresholded.done and thresholded.info["success"] is False  # 0.25 < 1: the old threshold would fail it


@pytest.mark.parametrize("env", ["maze", "wordle"])
def test_maze_and_wordle_dialects_close_their_sessions(ours, env):
    async def main():
        async with aiohttp.ClientSession() as http:
            client = DialectClient(ours[env], http, dialect=env)
            session = await client.create()
            await client.reset(session, 0)
            before = (await client.health())["sessions"]
            await client.close(session)
            after = (await client.health())["sessions"]
            with pytest.raises(EnvServerError) as gone:
                await client.observation(session)
            return before, after, gone.value.status

    before, after, status = asyncio.run(main())
    assert after == before - 1 and status == 404


def test_close_on_a_server_without_a_close_path():
    """AgentGym's LMRL-Gym server has no /maze/close: its 404 is fine there, not for dialects that have one."""

    async def main():
        async with agentgym_like("TextCraft") as (fake, url), aiohttp.ClientSession() as http:
            await DialectClient(url, http, dialect="maze").close(0)  # /maze/close: 404, ignored
            with pytest.raises(EnvServerError) as missing:
                await DialectClient(url, http, dialect=dataclasses.replace(get_dialect("textcraft"), prefix="/x")).close(0)
            return missing.value.status

    assert asyncio.run(main()) == 404


def test_agentgym_errors_flag_answers_errors_as_200_with_an_error_body():
    with start_server("textcraft", agentgym_errors=True) as url, start_server("textcraft") as plain:
        status, body = request_json(url, "POST", "/step", {"id": 12345, "action": "get 1 stick"})
        assert status == 200 and "unknown session id 12345" in body["error"]  # as AgentGym's servers answer
        assert request_json(plain, "POST", "/step", {"id": 12345, "action": "get 1 stick"})[0] == 404  # the default
        status, created = request_json(url, "POST", "/create", {"commands": "craft 1 x using 1 y", "goal": "x"})
        assert status == 200 and "custom TextCraft tasks" in created["error"]
        assert request_json(url, "GET", "/no_such_path")[0] == 404  # HTTP-level errors keep their status
        with urllib.request.urlopen(urllib.request.Request(
                url + "/reset", data=json.dumps({"id": 999, "data_idx": 0}).encode(),
                headers={"Content-Type": "application/json"})) as answer:
            assert answer.status == 200 and answer.headers["X-Error-Status"] == "404"

        async def through_the_dialect():
            async with aiohttp.ClientSession() as http:
                with pytest.raises(EnvServerError) as unknown:
                    await DialectClient(url, http, dialect="textcraft").step(777, "get 1 stick")
                return unknown.value.status

        assert asyncio.run(through_the_dialect()) == 404  # typed as the error it is


def test_textcraft_create_refuses_a_custom_task_and_accepts_empty_settings():
    with start_server("textcraft") as url:
        status, body = request_json(url, "POST", "/create", {"commands": "craft 1 stick using 2 planks", "goal": "stick"})
        assert status == 400 and "custom TextCraft tasks (commands and goal" in body["error"] and "data_idx" in body["error"]
        status, body = request_json(url, "POST", "/create", {"goal": "stick"})
        assert status == 400 and "(goal at /create" in body["error"]
        status, body = request_json(url, "POST", "/create", {"commands": None, "goal": None, "minecraft_dir": "x"})
        assert status == 200 and isinstance(body["id"], int)  # what AgentGym's client sends by default
