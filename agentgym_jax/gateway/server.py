"""`mode=gateway`: an OpenAI-compatible chat-completions server over the JAX sampler that records
every conversation token-exact as a trajectory, for training agents written against the OpenAI API.

    python -m agentgym_jax.launch --config=configs/gateway.py --config.policy=pretrained:smollm2-135m-instruct

Endpoints (all but `/health` need `Authorization: Bearer <auth_token>` when one is set; the
openai package sends its `api_key` so):
- `POST /v1/chat/completions`: OpenAI's request (`messages`, `tools`, `max_tokens`, `stream`);
  the answer's extension field `agentgym` holds `conversation_id`, the turn, the ids appended
  before it and the sampled ids with their log-probs. Pass `conversation_id` back (the openai
  package: `extra_body={"conversation_id": ...}`) or send the conversation's messages back
  unchanged; either continues the conversation on its KV cache (`batcher.py`,
  `conversations.py`).
- `POST /v1/conversations/<id>/reward {"reward", "success" | "status", "task_id", "group_id",
  "env"}`: closes the conversation and appends its trajectory to `<out_dir>/trajectories.jsonl`
  (loss_mask 1 exactly on the sampled ids; the reward on the last one; `group_id` makes GRPO
  groups). A conversation idle for `idle_timeout_s` is dropped unrecorded.
- `GET /v1/models`, `GET /health`.

It binds 127.0.0.1 unless told otherwise; `max_conversations` conversations sample at once (one
sampler row each) and at most `max_queue` requests wait, beyond which it answers 429. Sampling
settings are the gateway's (a request may repeat its temperature, not change it): the recorded
log-probs are the policy's at the temperature the trainer will score it at.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging as py_logging
import math
import pathlib
import signal
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from aiohttp import web

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.gateway import openai_format as oa
from agentgym_jax.gateway.batcher import Batcher, ContextTooLong
from agentgym_jax.gateway.conversations import Conversation, ConversationTable
from agentgym_jax.job import setup
from agentgym_jax.models.chat import ChatFraming, FramingError
from agentgym_jax.rollout.engine import RolloutConfig
from agentgym_jax.rollout.trajectory import write_jsonl
from agentgym_jax.rollout.transcript import Transcript
from agentgym_jax.sampling.sampler import Sampler

TRAJECTORIES_NAME = "trajectories.jsonl"
RUN_KEYS = ("policy", "checkpoint_step", "policy_version", "model_name", "temperature", "seed")  # run.json


class Gateway:
    """The server's state: the batcher over the sampler, the open conversations, the record file."""

    def __init__(
        self,
        sampler: Sampler,
        framing: ChatFraming,
        params: Any,
        out_dir: str | pathlib.Path,
        *,
        model_name: str = "policy",
        max_conversations: int = 8,
        decode_chunk: int = 16,
        max_tokens_per_turn: int = 512,
        max_queue: int = 256,
        auth_token: str = "",
        idle_timeout_s: float = 900.0,
        seed: int = 0,
        policy_version: int = 0,
    ):
        self.framing, self.model_name, self.auth_token = framing, model_name, auth_token
        self.max_tokens_per_turn = min(max_tokens_per_turn, sampler.config.max_new_tokens)
        self.max_queue, self.idle_timeout_s, self.policy_version = max_queue, idle_timeout_s, policy_version
        self.sampling = {"temperature": sampler.config.temperature, "top_p": sampler.config.top_p}
        self.batcher = Batcher(sampler, params, max_conversations, decode_chunk, jax.random.key(seed))
        self.table = ConversationTable()
        self.path = pathlib.Path(out_dir) / TRAJECTORIES_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.in_flight = self.recorded = 0
        self._tasks: list[asyncio.Task] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._authorize], client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/conversations/{id}/reward", self.reward)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start_tasks)
        app.on_cleanup.append(self._stop_tasks)
        return app

    # ---- endpoints ----

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        chat = oa.read_request(await _json_body(request), self.model_name, self.sampling)
        if self.in_flight >= self.max_queue:
            raise oa.GatewayError(429, f"{self.in_flight} requests are in flight (max_queue); retry later", "rate_limit_error")
        conversation, new = self.table.match(chat)
        messages = [oa.framing_message(self.framing, m) for m in new]
        try:
            if conversation is None:
                prompt = self.framing.prompt_ids(messages, tools=chat.tools or None)
                conversation = self.table.new(Transcript(self.framing, prompt), chat.tools_key)
                appended = prompt.ids
            else:
                appended = conversation.transcript.add_observation(ids=conversation.transcript.answer_ids(messages))
        except FramingError as e:
            raise oa.GatewayError(400, f"the conversation cannot be framed: {e}") from None
        conversation.keys += [oa.message_key(m) for m in new]
        body = await self._sample(conversation, appended, chat)
        if not chat.stream:
            return web.json_response(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in oa.stream_events(body):
            await response.write(event)
        await response.write_eof()
        return response

    async def reward(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise oa.GatewayError(400, "the body must be a JSON object")
        reward = body.get("reward")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise oa.GatewayError(400, f"reward must be a finite number, got {reward!r}")
        status = _status(body)
        fields = {}
        for name in ("task_id", "group_id", "sample_idx"):
            value = body.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise oa.GatewayError(400, f"{name} must be an integer, got {value!r}")
            fields[name] = value
        env = body.get("env", "gateway")
        if not isinstance(env, str):
            raise oa.GatewayError(400, f"env must be a string, got {env!r}")
        conversation = self.table.close(request.match_info["id"])
        self.batcher.release(conversation)
        turns = conversation.transcript.num_turns
        trajectory = conversation.transcript.to_trajectory(
            task_id=conversation.number if fields["task_id"] is None else fields["task_id"],
            env=env,
            group_id=conversation.number if fields["group_id"] is None else fields["group_id"],
            turn_rewards=[0.0] * (turns - 1) + [float(reward)],  # on the last sampled token
            status=status,
            sample_idx=fields["sample_idx"] or 0,
            policy_version=self.policy_version,
        )
        await asyncio.to_thread(write_jsonl, str(self.path), [trajectory])
        self.recorded += 1
        return web.json_response({"conversation_id": conversation.id, "recorded": True, "turns": turns,
                                  "tokens": len(trajectory.token_ids), "status": status.value})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "agentgym_jax"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, "conversations": len(self.table.open),
                                  "recorded": self.recorded, "expired": self.table.expired, "in_flight": self.in_flight,
                                  "sampling_rows": self.batcher.busy_rows, "rebuilt_rows": self.batcher.rebuilds})

    # ---- internals ----

    async def _sample(self, conversation: Conversation, appended: tuple[int, ...], chat: oa.ChatRequest) -> dict[str, Any]:
        """Samples the conversation's next turn and writes the answer (the conversation is dropped
        if it no longer fits in a row)."""
        turn, context = conversation.transcript.num_turns, len(conversation.token_ids)
        limit = min(chat.max_tokens or self.max_tokens_per_turn, self.max_tokens_per_turn)
        conversation.busy = True
        self.in_flight += 1
        try:
            sampled = await self.batcher.sample(conversation, appended, limit, turn)
        except ContextTooLong as e:
            self.table.open.pop(conversation.id, None)
            raise oa.GatewayError(400, f"{e}; conversation {conversation.id!r} is closed",
                                  code="context_length_exceeded") from None
        finally:
            conversation.busy, conversation.last_used = False, time.monotonic()
            self.in_flight -= 1
        conversation.transcript.add_policy_turn(sampled.ids, sampled.logprobs)
        tokenizer = self.framing.tokenizer
        text = tokenizer.decode(sampled.ids, skip_special_tokens=True)
        message = oa.reply_message(text, chat.tool_names, conversation.number, turn)
        conversation.keys.append(oa.message_key(oa.normalize_message(message, -1)))
        token_logprobs = None
        if chat.logprobs:
            token_logprobs = [{"token": tokenizer.decode([int(t)]), "logprob": float(lp), "top_logprobs": [],
                               "bytes": list(tokenizer.decode([int(t)]).encode())}
                              for t, lp in zip(sampled.ids, sampled.logprobs)]
        return oa.completion(
            self.model_name, message, oa.finish_reason(message, sampled.stop), conversation_id=conversation.id,
            turn=turn, prompt_ids=appended, completion_ids=sampled.ids, completion_logprobs=sampled.logprobs,
            context_tokens=context, token_logprobs=token_logprobs,
        )

    async def _expire(self) -> None:
        """Drops conversations idle for `idle_timeout_s` (unrecorded), and frees their rows."""
        while True:
            await asyncio.sleep(max(min(self.idle_timeout_s / 4, 30.0), 0.05))
            for conversation in self.table.idle_since(time.monotonic() - self.idle_timeout_s):
                self.batcher.release(conversation)
                logging.info("conversation %s expired after %.0f s idle (not recorded)", conversation.id, self.idle_timeout_s)

    async def _start_tasks(self, app: web.Application) -> None:
        self._tasks = [asyncio.create_task(self.batcher.run()), asyncio.create_task(self._expire())]

    async def _stop_tasks(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except oa.GatewayError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown path, wrong method: aiohttp's status, our body
            return web.json_response(oa.GatewayError(e.status, e.reason).body(), status=e.status)
        except Exception as e:  # noqa: BLE001: a bug answers 500 and the server goes on
            logging.exception("gateway request failed")
            return web.json_response(oa.GatewayError(500, f"{type(e).__name__}: {e}", "server_error").body(), status=500)

    @web.middleware
    async def _authorize(self, request: web.Request, handler) -> web.StreamResponse:
        if self.auth_token and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.auth_token}".encode()):
                raise oa.GatewayError(401, "missing or wrong bearer token (Authorization: Bearer <auth_token>)",
                                      "authentication_error", "invalid_api_key")
        return await handler(request)


def _status(body: dict[str, Any]) -> EpisodeStatus:
    if body.get("status") is not None:
        try:
            return EpisodeStatus(body["status"])
        except ValueError:
            valid = ", ".join(s.value for s in EpisodeStatus)
            raise oa.GatewayError(400, f"status {body['status']!r} is not one of {valid}") from None
    success = body.get("success", False)
    if not isinstance(success, bool):
        raise oa.GatewayError(400, f"success must be true or false, got {success!r}")
    return EpisodeStatus.SUCCESS if success else EpisodeStatus.FAILURE


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.text())
    except ValueError as e:
        raise oa.GatewayError(400, f"the body is not JSON ({e})") from None


async def serve(gateway: Gateway, host: str, port: int) -> None:
    """Serves until SIGINT / SIGTERM; prints `serving the gateway on <url>` once it listens."""
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"serving the gateway on http://{host}:{bound}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def write_run_files(config: ml_collections.ConfigDict, framing: ChatFraming, out_dir: pathlib.Path) -> None:
    """`run.json` (the policy served and how) and `tokenizer/` (its tokenizer) beside the
    trajectories, so the viewer reads a gateway run on its own (docs/viewer.md)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    framing.tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    (out_dir / "run.json").write_text(json.dumps({"mode": "gateway", **{k: config[k] for k in RUN_KEYS}}, indent=2))


def run(config: ml_collections.ConfigDict) -> None:
    """`mode=gateway`: the policy `config.policy` names, served until Ctrl-C."""
    py_logging.getLogger("aiohttp.access").setLevel(py_logging.WARNING)
    config, framing, model, params = setup.load_policy(config)
    write_run_files(config, framing, pathlib.Path(config.out_dir))
    r = config.rollout
    rollout = RolloutConfig(max_tokens_per_turn=r.max_tokens_per_turn, temperature=config.temperature,
                            top_k=r.top_k, top_p=r.top_p)
    sampler = setup.make_sampler(config, model, framing, rollout)
    gateway = Gateway(
        sampler, framing, params, config.out_dir,
        model_name=config.model_name, max_conversations=config.max_conversations, decode_chunk=r.decode_chunk,
        max_tokens_per_turn=r.max_tokens_per_turn, max_queue=config.max_queue, auth_token=config.auth_token,
        idle_timeout_s=config.idle_timeout_s, seed=config.seed, policy_version=config.policy_version,
    )
    for deviation in framing.deviations:
        logging.info("chat template: %s: %s", deviation.kind, deviation.detail)
    asyncio.run(serve(gateway, config.host, config.port))
