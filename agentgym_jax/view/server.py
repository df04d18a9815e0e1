"""The viewer's HTTP side: a JSON API over the runs' indexes and the static page, on 127.0.0.1.

    GET /                       the page (static/index.html, viewer.js, viewer.css)
    GET /api/runs               each run: name, files, episodes, envs, steps, tokenizer, unreadable lines
    GET /api/episodes?run=0&env=&status=&pattern=&step=&task=&reward_min=&reward_max=&offset=0&limit=50
                                one page of the filtered episodes' summaries, and the filtered total
    GET /api/patterns?run=0&... per step of the filtered episodes: episodes, successes, each pattern's count
    GET /api/episode?run=0&id=N one episode's tokens, turns, rewards and status (read from its file)
    GET /api/task?env=room&task=5  the episodes of one task in every run (to compare runs)

A bad request (a missing or unreadable parameter, a run or episode that does not exist) gets a
4xx with `{"error": ...}` naming the valid values; the server keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
from typing import Any

import numpy as np
from aiohttp import web

from agentgym_jax.view.episode import episode_view
from agentgym_jax.view.index import FILTER_KEYS, STATUSES, Filter, FilterError, RunIndex
from agentgym_jax.view.patterns import PATTERNS
from agentgym_jax.view.tokens import TokenText

log = logging.getLogger(__name__)
STATIC = pathlib.Path(__file__).parent / "static"
ENDPOINTS = ("GET /", "GET /api/runs", "GET /api/episodes", "GET /api/patterns", "GET /api/episode", "GET /api/task")
MAX_PAGE = 500


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Run:
    """One run the viewer shows: its episodes' index and how to turn its token ids into text."""

    name: str
    index: RunIndex
    text: TokenText | None
    tokenizer: str  # where the tokenizer came from, or why there is none


def _finite(body: Any) -> Any:
    if isinstance(body, float):
        return body if math.isfinite(body) else None
    if isinstance(body, dict):
        return {k: _finite(v) for k, v in body.items()}
    if isinstance(body, (list, tuple)):
        return [_finite(v) for v in body]
    return body


def json_response(body: Any, status: int = 200) -> web.Response:
    """JSON a browser can parse: NaN and infinities (a log-prob of -inf) are sent as null."""
    try:
        text = json.dumps(body, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(body), allow_nan=False)
    return web.Response(text=text, status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as JSON `{"error"}`; nothing a request sends stops the server."""
    try:
        return await handler(request)
    except RequestError as e:
        return _error(e.status, str(e))
    except FilterError as e:
        return _error(400, str(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if isinstance(e, web.HTTPNotFound):
            return _error(404, f"unknown path {request.path!r}; endpoints: {', '.join(ENDPOINTS)}")
        if isinstance(e, web.HTTPMethodNotAllowed):
            return _error(405, f"{request.method} not allowed on {request.path}; use GET")
        return _error(e.status, e.text or e.reason)
    except Exception as e:  # a bug or an unreadable file: say so and keep serving
        log.exception("viewer request %s failed", request.path_qs)
        return _error(500, f"{type(e).__name__}: {e}")


def _int(request: web.Request, name: str, default: int | None = None, low: int = 0, high: int | None = None) -> int:
    text = request.query.get(name, "").strip()
    if not text:
        if default is None:
            raise RequestError(f"missing parameter {name!r}")
        return default
    try:
        value = int(text)
    except ValueError:
        raise RequestError(f"{name}={text!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        raise RequestError(f"{name}={value} is outside [{low}, {high if high is not None else 'inf'}]")
    return value


def _known(request: web.Request, *keys: str) -> None:
    """Refuses a parameter the endpoint does not read (a typo would otherwise filter nothing)."""
    unknown = sorted(set(request.query) - set(keys))
    if unknown:
        raise RequestError(f"unknown parameter {', '.join(map(repr, unknown))} for {request.path}; valid: {', '.join(keys)}")


def make_app(runs: list[Run]) -> web.Application:
    """The viewer over `runs` (each indexed already)."""
    if not runs:
        raise ValueError("the viewer needs at least one run")

    def run_of(request: web.Request) -> Run:
        number = _int(request, "run", default=0)
        if number >= len(runs):
            raise RequestError(f"run={number}: there are {len(runs)} runs (0..{len(runs) - 1})", 404)
        return runs[number]

    def filtered(request: web.Request) -> tuple[Run, np.ndarray]:
        run = run_of(request)
        return run, run.index.select(Filter.from_query(request.query))

    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def runs_info(request: web.Request) -> web.Response:
        out = []
        for number, run in enumerate(runs):
            index = run.index
            index.refresh()  # a live run's new episodes
            steps = index.columns["step"]
            out.append(dict(
                run=number, name=run.name, files=[str(f) for f in index.files], episodes=len(index),
                envs=sorted(index.envs), steps=[int(steps.min()), int(steps.max())] if len(steps) else None,
                tokenizer=run.tokenizer, decoded=run.text is not None,
                truncation_checked=index.end_of_turn_ids is not None,
                bad_lines=index.num_bad_lines, bad_line_examples=index.bad_lines,
            ))
        return json_response(dict(runs=out, statuses=list(STATUSES), patterns=list(PATTERNS)))

    async def episodes(request: web.Request) -> web.Response:
        _known(request, "run", *FILTER_KEYS, "offset", "limit")
        run, rows = filtered(request)
        offset = _int(request, "offset", default=0)
        limit = _int(request, "limit", default=50, low=1, high=MAX_PAGE)
        return json_response(dict(
            total=len(rows), offset=offset, limit=limit, episodes=run.index.summaries(rows[offset:offset + limit]),
        ))

    async def step_patterns(request: web.Request) -> web.Response:
        _known(request, "run", *FILTER_KEYS)
        run, rows = filtered(request)
        return json_response(run.index.step_counts(rows))

    async def episode(request: web.Request) -> web.Response:
        _known(request, "run", "id")
        run = run_of(request)
        row = _int(request, "id")
        if row >= len(run.index):
            raise RequestError(f"id={row}: run {run.name!r} has {len(run.index)} episodes (0..{len(run.index) - 1})", 404)
        view = episode_view(run.index.read(row), run.text)
        return json_response(dict(run=runs.index(run), id=row, location=run.index.location(row), **view))

    async def task(request: web.Request) -> web.Response:
        _known(request, "env", "task")
        env = request.query.get("env", "").strip()
        if not env:
            raise RequestError("missing parameter 'env'")
        task_id = _int(request, "task")
        return json_response(dict(env=env, task_id=task_id, runs=[
            dict(run=number, name=run.name, episodes=run.index.summaries(run.index.task_rows(env, task_id)))
            for number, run in enumerate(runs)
        ]))

    app = web.Application(middlewares=[_errors])
    app.router.add_get("/", page)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/runs", runs_info)
    app.router.add_get("/api/episodes", episodes)
    app.router.add_get("/api/patterns", step_patterns)
    app.router.add_get("/api/episode", episode)
    app.router.add_get("/api/task", task)
    return app
