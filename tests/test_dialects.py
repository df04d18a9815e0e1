"""Dialect adapters against our servers (AgentGym-compatible mode) and against in-test servers
that speak AgentGym's own wire format (HTTP 200 with `{"error"}` strings, bare ids, `score`)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agentgym_jax.envs.client import EnvServerError
from agentgym_jax.envs.dialects import DIALECTS, DialectClient, dialect_client_factory, get_dialect
from agentgym_jax.envs.launcher import LocalServers
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.envs.protocol import EpisodeStatus


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
            session["score"] = 1.0 if solved else 0.0
            answer.update(reward=0.25 if solved else 0.0, score=session["score"])
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
    assert (hit.reward, hit.done, hit.info["success"]) == (1.0, True, True)  # BabyAI: `score`, not `reward`
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
