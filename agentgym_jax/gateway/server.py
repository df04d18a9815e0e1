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

At start-up it compiles the shapes of first turns up to `warmup_tokens` (progress and each
compilation logged; `/health` answers 503 `warming_up` until it is done; requests wait). Inside
an RL or evaluation job (`gateway/episodes.py`) the same server runs in-process: each agent
episode gets an API key of its own that its conversations are filed under (`open_episode`,
`close_episode`), and the job swaps the weights in place after every update (`publish`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging as py_logging
import math
import pathlib
import secrets
import signal
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from aiohttp import web

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.gateway import openai_format as oa
from agentgym_jax.gateway.batcher import Batcher, ContextTooLong, warm_up, warmup_lengths
from agentgym_jax.gateway.conversations import Conversation, ConversationTable
from agentgym_jax.job import setup
from agentgym_jax.models.chat import ChatFraming, FramingError
from agentgym_jax.progress import Progress
from agentgym_jax.rollout.engine import RolloutConfig
from agentgym_jax.rollout.stream import PolicyWeights, StreamTimes
from agentgym_jax.rollout.tool_use import tool_prompt
from agentgym_jax.rollout.trajectory import Trajectory, write_jsonl
from agentgym_jax.rollout.transcript import Transcript
from agentgym_jax.sampling.sampler import Sampler, StopReason

TRAJECTORIES_NAME = "trajectories.jsonl"
RUN_KEYS = ("policy", "checkpoint_step", "policy_version", "model_name", "temperature", "seed")  # run.json
UNREWARDED_NAME = "unrewarded.jsonl"  # open conversations written at shutdown (`write_unrewarded`), never trained on
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
EPISODE = web.RequestKey("episode", str)  # the agent episode a request belongs to (its API key)


@dataclasses.dataclass
class EpisodeRecord:
    """An agent episode's conversations as the gateway filed them (`Gateway.close_episode`)."""

    key: str
    conversations: list[Conversation] = dataclasses.field(default_factory=list)  # with a sampled turn, none in flight
    restarts: int = 0  # conversations begun with assistant messages the gateway did not answer (a changed history)
    dropped: int = 0  # conversations left with a request in flight, or without a sampled turn: not recorded


class Gateway:
    """The server's state: the batcher over the sampler, the open conversations, the record file."""

    def __init__(
        self,
        sampler: Sampler,
        framing: ChatFraming,
        weights: Any,
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
        max_body_bytes: int = 4 * 2**20,
        warmup_tokens: int = 0,
        write_unrewarded: bool = False,
        times: StreamTimes | None = None,
        log_requests: bool = True,
    ):
        """`weights`: the params, or a `PolicyWeights` whose newest weights (and version) every
        turn samples with; `warmup_tokens`: first prompts up to this long are compiled at start-up."""
        self.framing, self.model_name, self.auth_token = framing, model_name, auth_token
        self.max_tokens_per_turn = min(max_tokens_per_turn, sampler.config.max_new_tokens)
        self.max_queue, self.idle_timeout_s, self.max_body_bytes = max_queue, idle_timeout_s, max_body_bytes
        self.sampling = {"temperature": sampler.config.temperature, "top_p": sampler.config.top_p}
        if not isinstance(weights, PolicyWeights):
            weights = PolicyWeights(weights, policy_version)
        self.batcher = Batcher(sampler, weights, max_conversations, decode_chunk, jax.random.key(seed), times)
        self.table = ConversationTable()
        self.path = pathlib.Path(out_dir) / TRAJECTORIES_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write_unrewarded, self.log_requests = write_unrewarded, log_requests
        self.in_flight = self.recorded = 0
        self.turns_sampled = self.tokens_sampled = 0  # replies and their ids, since start (progress)
        self.episodes: dict[str, EpisodeRecord] = {}  # open agent episodes by their API key
        self.warmup = warmup_lengths(sampler, warmup_tokens)
        self.warmed = 0 if self.warmup else None  # shapes compiled so far; None when ready
        self._tasks: list[asyncio.Task] = []

    def publish(self, params: Any, version: int) -> None:
        """(any thread) Serve `params` as policy version `version` from the next decode chunk on."""
        self.batcher.publish(params, version)

    def open_episode(self) -> str:
        """A new agent episode: the API key its requests carry (and nothing else accepts)."""
        key = f"episode-{secrets.token_hex(12)}"
        self.episodes[key] = EpisodeRecord(key)
        return key

    def close_episode(self, key: str) -> EpisodeRecord:
        """Ends the episode (its key is refused from now on) and takes its conversations: those
        with a sampled turn and no request in flight, the others dropped and counted."""
        record = self.episodes.pop(key)
        for conversation in self.table.of_episode(key):
            if conversation.busy:  # its turn decodes on: the row goes to another once it is idle
                record.dropped += 1
                continue
            self.batcher.release(conversation)
            if conversation.transcript.num_turns:
                record.conversations.append(conversation)
            else:
                record.dropped += 1
        return record

    def trajectory(self, conversation: Conversation, reward: float, status: EpisodeStatus, *, task_id: int,
                   group_id: int, env: str, **fields: Any) -> Trajectory:
        """The conversation's record: the reward on its last sampled id, each sampled id's version."""
        turns = conversation.transcript.num_turns
        return conversation.transcript.to_trajectory(
            task_id=task_id, env=env, group_id=group_id, turn_rewards=[0.0] * (turns - 1) + [float(reward)],
            status=status, policy_version=min(conversation.versions), token_versions=conversation.token_versions(),
            **fields,
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._authorize], client_max_size=self.max_body_bytes)
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
        self.in_flight += 1  # from here on: framing and tokenizing count, as well as sampling
        try:
            return await self._complete(request, chat)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request, chat: oa.ChatRequest) -> web.StreamResponse:
        episode = request.get(EPISODE)
        conversation, new = self.table.match(chat, episode)
        messages = [oa.framing_message(self.framing, m) for m in new]
        try:  # tokenized off the event loop: a long message must not stall the other clients
            if conversation is None:
                prompt = await asyncio.to_thread(tool_prompt, self.framing, messages, chat.tools or None)
                conversation = self.table.new(Transcript(self.framing, prompt), chat.tools_key, episode)
                appended = prompt.ids
                if episode in self.episodes and any(m["role"] == "assistant" for m in new):
                    self.episodes[episode].restarts += 1
            else:
                ids = await asyncio.to_thread(conversation.transcript.answer_ids, messages)
                appended = conversation.transcript.add_observation(ids=ids)
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
        if request.get(EPISODE) is not None:
            raise oa.GatewayError(400, "this conversation belongs to an agent episode of a job: the job rewards it with "
                                       "what the agent function returns (docs/agents.md)")
        conversation = self.table.close(request.match_info["id"])
        self.batcher.release(conversation)
        trajectory = self.trajectory(
            conversation, reward, status, env=env,
            task_id=conversation.number if fields["task_id"] is None else fields["task_id"],
            group_id=conversation.number if fields["group_id"] is None else fields["group_id"],
            sample_idx=fields["sample_idx"] or 0,
        )
        await asyncio.to_thread(write_jsonl, str(self.path), [trajectory])
        self.recorded += 1
        return web.json_response({"conversation_id": conversation.id, "recorded": True,
                                  "turns": conversation.transcript.num_turns, "tokens": len(trajectory.token_ids),
                                  "status": status.value})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "agentgym_jax"}]})

    async def health(self, request: web.Request) -> web.Response:
        """200 `ok` once ready; 503 `warming_up` (with how many shapes are compiled) before."""
        body = {"status": "ok" if self.warmed is None else "warming_up", "model": self.model_name,
                "policy_version": self.batcher.weights.newest()[0], "conversations": len(self.table.open),
                "recorded": self.recorded, "expired": self.table.expired, "in_flight": self.in_flight,
                "sampling_rows": self.batcher.busy_rows, "rebuilt_rows": self.batcher.rebuilds}
        if self.warmed is not None:
            body["warmup"] = {"done": self.warmed, "total": len(self.warmup) + 1}
        return web.json_response(body, status=200 if self.warmed is None else 503)

    # ---- internals ----

    async def _sample(self, conversation: Conversation, appended: tuple[int, ...], chat: oa.ChatRequest) -> dict[str, Any]:
        """Samples the conversation's next turn and writes the answer (the conversation is dropped
        if it no longer fits in a row)."""
        turn, context = conversation.transcript.num_turns, len(conversation.token_ids)
        limit = min(chat.max_tokens or self.max_tokens_per_turn, self.max_tokens_per_turn)
        conversation.busy = True
        start = time.monotonic()
        try:
            sampled = await self.batcher.sample(conversation, appended, limit, turn)
        except ContextTooLong as e:
            self.table.open.pop(conversation.id, None)
            raise oa.GatewayError(400, f"{e}; conversation {conversation.id!r} is closed",
                                  code="context_length_exceeded") from None
        finally:
            conversation.busy, conversation.last_used = False, time.monotonic()
        conversation.transcript.add_policy_turn(sampled.ids, sampled.logprobs)
        self.turns_sampled, self.tokens_sampled = self.turns_sampled + 1, self.tokens_sampled + len(sampled.ids)
        conversation.versions += sampled.versions.tolist()
        tokenizer = self.framing.tokenizer
        text = tokenizer.decode(sampled.ids, skip_special_tokens=True)
        message = oa.reply_message(text, chat.tool_names, conversation.number, turn)
        conversation.keys.append(oa.message_key(oa.normalize_message(message, -1)))
        token_logprobs = None
        if chat.logprobs:  # the message's tokens: the end-of-turn id the policy sampled is not part of it
            shown = len(sampled.ids) - (sampled.stop is StopReason.END_OF_TURN)
            token_logprobs = [{"token": tokenizer.decode([int(t)]), "logprob": float(lp), "top_logprobs": [],
                               "bytes": list(tokenizer.decode([int(t)]).encode())}
                              for t, lp in zip(sampled.ids[:shown], sampled.logprobs[:shown])]
        if self.log_requests:
            logging.info("%s turn %d: %d ids appended, %d sampled (version %d), %.0f ms", conversation.id, turn,
                         len(appended), len(sampled.ids), int(sampled.versions[-1]), 1000 * (time.monotonic() - start))
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

    async def _warm_up(self, batcher: Batcher) -> None:
        """Compiles the shapes of first turns up to `warmup_tokens` (`batcher.warm_up`), with progress."""
        with Progress("gateway warm-up", len(self.warmup) + 1, "shape") as progress:
            await warm_up(batcher, self.warmup, lambda done: (setattr(self, "warmed", done), progress.set(done)))
        self.warmed = None
        logging.info("the gateway is ready: %d shapes compiled", len(self.warmup) + 1)

    def _log_compile(self, event: str, duration: float, **kwargs: Any) -> None:
        """Logs each compilation the gateway's sampler makes (a new shape: seconds of waiting)."""
        if event == _COMPILE_EVENT and (label := self.batcher.running()):
            logging.info("compiled %s for the %s in %.1f s", kwargs.get("fun_name", "a function"), label, duration)

    async def _start_tasks(self, app: web.Application) -> None:
        jax.monitoring.register_event_duration_secs_listener(self._log_compile)
        warmup = self._warm_up if self.warmed is not None else None
        self._tasks = [asyncio.create_task(self.batcher.run(warmup)), asyncio.create_task(self._expire())]

    async def _stop_tasks(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.batcher.close()
        jax.monitoring.unregister_event_duration_listener(self._log_compile)
        self._report_unrewarded()

    def _report_unrewarded(self) -> None:
        """At shutdown: how many conversations were never rewarded (not recorded), and, with
        `write_unrewarded`, their records (reward 0, `infra_error`) in `unrewarded.jsonl`."""
        left = [c for c in self.table.open.values() if c.episode is None and c.transcript.num_turns]
        if not left:
            return
        path = self.path.parent / UNREWARDED_NAME
        if self.write_unrewarded:
            write_jsonl(str(path), [self.trajectory(c, 0.0, EpisodeStatus.INFRA_ERROR, task_id=c.number, group_id=c.number,
                                                    env="gateway") for c in left])
        logging.warning("%d open conversations were never rewarded: %s", len(left),
                        f"written to {path}" if self.write_unrewarded else "not recorded (write_unrewarded=True keeps them)")

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
        """The bearer token: an open episode's key (the request is filed under it) or `auth_token`;
        a body over `max_body_bytes` is refused (413) before it is read."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise oa.GatewayError(413, f"the body holds {request.content_length} bytes; this gateway takes at most "
                                       f"{self.max_body_bytes} (max_body_bytes)", code="request_too_large")
        header = request.headers.get("Authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        if given in self.episodes:
            request[EPISODE] = given
        elif self.auth_token and request.path != "/health":
            if not hmac.compare_digest(given.encode(), self.auth_token.encode()):
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
    """The body parsed off the event loop (aiohttp refuses one over `client_max_size` with 413)."""
    text = await request.text()
    try:
        return await asyncio.to_thread(json.loads, text)
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
                            top_k=r.top_k, top_p=r.top_p, fill_tokens=r.fill_tokens)
    sampler = setup.make_sampler(config, model, framing, rollout)
    gateway = Gateway(
        sampler, framing, params, config.out_dir,
        model_name=config.model_name, max_conversations=config.max_conversations, decode_chunk=r.decode_chunk,
        max_tokens_per_turn=r.max_tokens_per_turn, max_queue=config.max_queue, auth_token=config.auth_token,
        idle_timeout_s=config.idle_timeout_s, seed=config.seed, policy_version=config.policy_version,
        max_body_bytes=config.max_body_bytes, warmup_tokens=config.warmup_tokens,
        write_unrewarded=config.write_unrewarded,
    )
    for deviation in framing.deviations:
        logging.info("chat template: %s: %s", deviation.kind, deviation.detail)
    asyncio.run(serve(gateway, config.host, config.port))
