"""The OpenAI-compatible gateway (`mode=gateway`) as a real process, with a real Academia server.

The policy is a random small decoder saved as a Hugging Face folder with a tokenizer trained on
Academia's text; the gateway runs it through `python -m agentgym_jax.launch
--config=configs/gateway.py` with two sampler rows. An agent written with the `openai` package
alone (`tests/gateway_agent.py`, run with `python -I`, so nothing of this repository is
importable to it) plays three episodes of one task round-robin, so the gateway must give rows
up and rebuild them; the recorded trajectories must be what the agent was told, token for
token, and train one GRPO step whose loss mask covers exactly the sampled ids.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import optax
import pytest

from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models import hf_checkpoint
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.batch import bucket
from agentgym_jax.rollout.rl_batch import BatchFilter, training_batch
from agentgym_jax.rollout.trajectory import read_jsonl
from agentgym_jax.train import steps
from agentgym_jax.train.state import TrainState
from environments.registry import get_environment
from tests.servers import REPO, start_server
from tests.test_rollout import random_params
from tests.updates import update as make_update

TOKEN = "gateway-secret"
TASK = 5


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """(Hugging Face folder, model config, params) of a random small decoder."""
    root = tmp_path_factory.mktemp("policy")
    instruction = get_environment("academia").task_info().instruction
    tokenizer_dir = bt.build_tokenizer(root / "tokenizer", [instruction], vocab_size=1024)
    config = ModelConfig.small(vocab_size=len(load_tokenizer(tokenizer_dir)))
    params = jax.tree.map(jax.numpy.asarray, random_params(config, 0.15))  # peaked logits: replies of varied lengths
    hf_checkpoint.save_pretrained(params, config, root / "hf", tokenizer_dir=tokenizer_dir)
    return root / "hf", config, params


@pytest.fixture(scope="module")
def academia_url():
    with start_server("academia") as url:
        yield url


@pytest.fixture(scope="module")
def gateway(policy, tmp_path_factory):
    """(base URL, out_dir, output lines, process) of a gateway process serving the policy with two sampler rows and at
    most four requests in flight."""
    out_dir = tmp_path_factory.mktemp("gateway")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/gateway.py", f"--config.policy=hf:{policy[0]}",
           "--config.port=0", f"--config.auth_token={TOKEN}", f"--config.out_dir={out_dir}",
           "--config.max_conversations=2", "--config.max_queue=4", "--config.rollout.max_tokens_per_turn=12",
           "--config.rollout.max_cache_len=2048", "--config.warmup_tokens=32", "--config.write_unrewarded=True",
           "--config.rollout.decode_chunk=4"]
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, ready = [], threading.Event()

    def drain():
        for line in process.stdout:
            output.append(line)
            if line.startswith("serving the gateway on "):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        ready.wait(180)
        serving = [line for line in output if line.startswith("serving the gateway on ")]
        assert process.poll() is None and serving, "".join(output)
        yield serving[0].split(" on ", 1)[1].strip(), out_dir, output, process
    finally:
        process.terminate()
        process.wait(20)


def post(url: str, body, token: str = TOKEN, raw: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_an_openai_agent_plays_through_the_gateway_and_its_trajectories_train_a_grpo_step(
        gateway, academia_url, policy):
    base_url, out_dir, _, _ = gateway
    done = subprocess.run(
        [sys.executable, "-I", "tests/gateway_agent.py", f"--base_url={base_url}", f"--api_key={TOKEN}",
         f"--env_url={academia_url}", f"--task={TASK}", "--episodes=3", "--horizon=3", "--max_tokens=12"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["conversation_id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert len(reports) == 3
    with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health") as answer:
        health = json.loads(answer.read())
    assert health["recorded"] == 3 and health["conversations"] == 0
    assert health["rebuilt_rows"] >= 2  # three conversations round-robin on two rows

    trajectories = list(read_jsonl(str(out_dir / "trajectories.jsonl")))
    assert len(trajectories) == 3
    for t in trajectories:
        report = next(r for r in reports.values() if r["sample_idx"] == t.sample_idx)
        # Token for token what the agent was told: appended ids, then sampled ids, turn by turn.
        expected_ids, expected_mask, expected_logprobs = [], [], []
        for turn in report["turns"]:
            expected_ids += turn["prompt_token_ids"] + turn["completion_token_ids"]
            expected_mask += [0] * len(turn["prompt_token_ids"]) + [1] * len(turn["completion_token_ids"])
            expected_logprobs += [0.0] * len(turn["prompt_token_ids"]) + turn["completion_logprobs"]
        assert t.token_ids == expected_ids and t.loss_mask == expected_mask
        np.testing.assert_allclose(t.logprobs, expected_logprobs, rtol=0, atol=0)
        assert t.num_turns == len(report["turns"]) and t.reward == pytest.approx(report["reward"])
        assert (t.task_id, t.group_id, t.env) == (TASK, TASK, "academia")
    rewards = [t.reward for t in trajectories]
    assert max(rewards) > min(rewards)  # the token cost sets the group's members apart

    _, model, params = policy
    batch, counts = training_batch(trajectories, BatchFilter(), seq_len=bucket(max(len(t.token_ids) for t in trajectories)),
                                   batch_size=4)
    assert counts["trained_episodes"] == 3
    mask = np.asarray(batch.loss_mask)
    for row, t in enumerate(trajectories):  # the loss mask covers exactly the sampled ids
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        assert np.flatnonzero(mask[row]).tolist() == sampled
    fns = steps.make_step_fns(make_update(model, advantage="grpo"))
    state = TrainState.create(params, optax.sgd(0.1), jax.random.key(0))
    rl_batch, metrics = fns.prepare(state.params, state.params, batch)
    assert float(metrics["policy_tokens"]) == mask.sum()
    assert float(metrics["advantage_abs_mean"]) > 0
    before = jax.tree.map(np.array, state.params)  # the update donates the state
    after, update = fns.rl_update(state, rl_batch)  # one on-policy update: its own pass scores the rollouts
    assert float(update["logprob_gap"]) < 1e-5  # the sampler's log-probs are the trainer's: rebuilt rows too
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), after.params, before)
    assert max(jax.tree.leaves(moved)) > 0 and np.isfinite(float(update["loss"]))


def test_bad_requests_get_openai_errors_and_the_gateway_goes_on(gateway):
    base_url, _, _, _ = gateway
    chat = f"{base_url}/chat/completions"
    good = {"model": "policy", "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2}
    for body, token, raw, status, words in [
        (good, "wrong", None, 401, "bearer token"),
        ({**good, "model": "gpt-4"}, TOKEN, None, 404, "is not served here"),
        (good, TOKEN, b"{not json", 400, "not JSON"),
        ({**good, "temperature": 0.2}, TOKEN, None, 400, "samples with temperature=1.0"),
        ({**good, "n": 2}, TOKEN, None, 400, "one choice per request"),
        ({**good, "messages": [{"role": "wizard", "content": "x"}]}, TOKEN, None, 400, "role 'wizard'"),
        ({**good, "messages": [{"role": "assistant", "content": "x"}]}, TOKEN, None, 400, "cannot be framed"),
        ({**good, "conversation_id": "conv-999"}, TOKEN, None, 404, "closed .* or unknown"),
    ]:
        got, answer = post(chat, body, token, raw)
        assert got == status and re.search(words, answer["error"]["message"]), (body, answer)
    assert post(f"{base_url}/conversations/conv-999/reward", {"reward": 1.0})[0] == 404
    status, answer = post(chat, good)
    assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"
    conversation = answer["agentgym"]["conversation_id"]
    assert post(f"{base_url}/conversations/{conversation}/reward", {"reward": "high"})[0] == 400
    assert post(f"{base_url}/conversations/{conversation}/reward", {"reward": 1, "status": "won"})[0] == 400
    # Sent back changed, a named conversation is refused; unnamed, the request starts a new one.
    changed = {**good, "messages": good["messages"] + [{"role": "assistant", "content": "not what it said"},
                                                        {"role": "user", "content": "Go on."}]}
    status, answer = post(chat, {**changed, "conversation_id": conversation})
    assert status == 409 and "message 1 differs" in answer["error"]["message"]
    status, answer = post(chat, changed)
    assert status == 200 and answer["agentgym"]["conversation_id"] != conversation


def test_the_viewer_reads_a_gateway_run_on_its_own(gateway, policy):
    """The gateway leaves `run.json` and `tokenizer/` beside its trajectories: the viewer opened on
    its out_dir with no flag decodes a recorded conversation, every token as text."""
    from agentgym_jax.view.__main__ import open_runs
    from agentgym_jax.view.episode import episode_view

    base_url, out_dir, _, _ = gateway
    spec = json.loads((out_dir / "run.json").read_text())
    assert spec["mode"] == "gateway" and spec["policy"] == f"hf:{policy[0]}" and spec["temperature"] == 1.0
    good = {"model": "policy", "messages": [{"role": "user", "content": "Which venue?"}], "max_tokens": 3}
    status, answer = post(f"{base_url}/chat/completions", good)
    conversation = answer["agentgym"]["conversation_id"]
    assert post(f"{base_url}/conversations/{conversation}/reward", {"reward": 1.0, "success": True, "task_id": 808})[0] == 200
    (run,) = open_runs([str(out_dir)])  # no --tokenizer
    assert run.text is not None and run.tokenizer == str(out_dir / "tokenizer")
    row = next(r for r in range(len(run.index)) if run.index.read(r).task_id == 808)
    record, view = run.index.read(row), episode_view(run.index.read(row), run.text)
    pieces = view["prompt"]["text"] + [x for turn in view["turns"] for seg in ("policy", "observation") for x in turn[seg]["text"]]
    assert "".join(pieces) == load_tokenizer(policy[0]).decode(record.token_ids) and "Which venue?" in "".join(pieces)


def test_a_conversation_continues_on_its_cache_and_streams(gateway, policy):
    base_url, _, _, _ = gateway
    tokenizer = load_tokenizer(policy[0])
    client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
    messages = [{"role": "user", "content": "Which paper cites which?"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    report = first.model_extra["agentgym"]
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Observation: none."}]
    chunks = list(client.chat.completions.create(model="policy", messages=messages, max_tokens=3, stream=True))
    final = chunks[-1].model_extra["agentgym"]
    assert final["conversation_id"] == report["conversation_id"] and final["turn"] == 1
    # Only the new ids were appended: the cut turn's end-of-turn token, then the user turn.
    text = tokenizer.decode(final["prompt_token_ids"])
    assert text == "<|im_end|>\n<|im_start|>user\nObservation: none.<|im_end|>\n<|im_start|>assistant\n"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tokenizer.decode(final["completion_token_ids"], skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_foreign_tool_calls_are_prompt_and_concurrent_conversations_are_answered(gateway, policy):
    """An assistant message the gateway did not write is framed as the template writes it (this
    ChatML template drops tool calls, so they become `<tool_call>` blocks); four requests at once
    on two rows are all answered, and of twelve at once those past four in flight get a 429."""
    base_url, _, _, _ = gateway
    tokenizer = load_tokenizer(policy[0])
    call = {"id": "c1", "type": "function", "function": {"name": "loadPaperNet", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Load the net."}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "PaperNet is loaded."}]
    status, answer = post(f"{base_url}/chat/completions", {"model": "policy", "messages": messages, "max_tokens": 2})
    assert status == 200
    prompt = tokenizer.decode(answer["agentgym"]["prompt_token_ids"])
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "loadPaperNet", "arguments": {}}\n</tool_call><|im_end|>\n' \
           '<|im_start|>tool\nPaperNet is loaded.<|im_end|>\n<|im_start|>assistant\n' in prompt
    bodies = [{"model": "policy", "messages": [{"role": "user", "content": f"Question {k}."}], "max_tokens": 4}
              for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: post(f"{base_url}/chat/completions", b), bodies))
    assert [s for s, _ in answers] == [200] * 4
    assert len({a["agentgym"]["conversation_id"] for _, a in answers}) == 4
    burst = [{**body, "max_tokens": 12} for body in bodies * 3]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda b: post(f"{base_url}/chat/completions", b), burst))
    refused = [a for s, a in answers if s == 429]
    assert refused and len(refused) <= 12 - 4 and all(s in (200, 429) for s, _ in answers)
    assert refused[0]["error"]["type"] == "rate_limit_error"
    assert post(f"{base_url}/chat/completions", bodies[0])[0] == 200


@pytest.mark.parametrize("text, names, content, calls, reasoning", [
    ('I will look.\n<tool_call>\n{"name": "loadPaperNet", "arguments": {}}\n</tool_call>', {"loadPaperNet"},
     "I will look.", [("loadPaperNet", {})], None),
    ('<think>\nThe net first.\n</think>\n\n{"name": "paperNodeCheck", "parameters": {"node": "A"}}', {"paperNodeCheck"},
     '{"name": "paperNodeCheck", "parameters": {"node": "A"}}', [("paperNodeCheck", {"node": "A"})], "The net first."),
    ("Thought: done.\nfinish", {"loadPaperNet", "finish"}, "Thought: done.\nfinish", [("finish", {})], None),
    ("Hello there.\nGoodbye", {"loadPaperNet"}, "Hello there.\nGoodbye", [], None),  # a last word is no call
    ('<tool_call>\n{"name": "loadPaperNet", "arguments": {}}\n</tool_call>', set(), None, [], None),  # tool_choice none
])
def test_replies_become_openai_messages(text, names, content, calls, reasoning):
    from agentgym_jax.gateway import openai_format as oa

    message = oa.reply_message(text, names, 3, 1)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    expected_content = content if calls or content is not None else text
    assert got == calls and message["content"] == expected_content
    assert message.get("reasoning_content") == reasoning
    assert all(c["id"] == f"call_3_1_{i}" for i, c in enumerate(message.get("tool_calls", [])))
    # Sent back as the openai package sends it, the message is recognised as the one answered.
    echoed = {"role": "assistant", "content": message["content"], "tool_calls": message.get("tool_calls")}
    assert oa.message_key(oa.normalize_message(echoed, 0)) == oa.message_key(oa.normalize_message(message, 0))


def test_a_new_user_s_requests_are_answered_as_openai_clients_expect(gateway, policy):
    """Warm-up with progress and compile lines, readiness on /health; OpenAI's conformance points;
    a body over the limit refused before it is read while /health stays quick; tools written into
    the system turn where the template writes no tool list; the end-of-turn id outside the
    message's log-probs."""
    base_url, _, output, _ = gateway
    root = base_url.removesuffix("/v1")
    deadline = time.time() + 120
    while (health := _health(root))[0] == 503:  # warming up: the shapes of first turns compile
        assert health[1]["status"] == "warming_up" and time.time() < deadline
        time.sleep(0.5)
    assert health == (200, {**health[1], "status": "ok", "policy_version": 0})
    log = "".join(output)
    assert "gateway warm-up" in log and re.search(r"compiled jit\([^)]*\) for the warm-up fill of 1 row", log)
    chat = f"{base_url}/chat/completions"
    good = {"model": "policy", "messages": [{"role": "user", "content": "Hello."}], "max_tokens": 2}
    for body, status, words in [
        ({k: v for k, v in good.items() if k != "model"}, 400, "model is required"),
        ({**good, "top_logprobs": 2, "logprobs": True}, 400, "top_logprobs=2 is not supported"),
        ({**good, "response_format": {"type": "json_object"}}, 400, "response_format=.* is not supported"),
    ]:
        got, answer = post(chat, body)
        assert got == status and re.search(words, answer["error"]["message"]), (body, answer)
    assert post(chat, {**good, "top_logprobs": 0, "response_format": {"type": "text"}})[0] == 200

    big = json.dumps({**good, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(post, chat, None, TOKEN, big)
        start = time.time()
        assert _health(root)[0] == 200 and time.time() - start < 5
        status, answer = refused.result()
    assert status == 413 and "at most 4194304" in answer["error"]["message"]

    tokenizer = load_tokenizer(policy[0])
    tool = {"type": "function", "function": {"name": "loadPaperNet", "description": "Load the paper net.",
                                             "parameters": {"type": "object", "properties": {}}}}
    client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
    answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Go."}], tools=[tool])
    prompt = tokenizer.decode(answer.model_extra["agentgym"]["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and json.dumps(tool) in prompt  # ChatML writes no tool list
    for k in range(400):  # until a reply ends on its own (its last sampled id is the end-of-turn token;
        # about one reply in 50 of this policy does, and a reply costs milliseconds)
        answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"Go {k}."}],
                                                logprobs=True)
        if answer.choices[0].finish_reason == "stop":
            break
    extension = answer.model_extra["agentgym"]
    assert answer.choices[0].finish_reason == "stop" and extension["completion_token_ids"][-1] == \
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [t.logprob for t in answer.choices[0].logprobs.content] == extension["completion_logprobs"][:-1]
    assert "".join(t.token for t in answer.choices[0].logprobs.content) == answer.choices[0].message.content


def _health(root: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{root}/health", timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_at_ctrl_c_open_conversations_are_counted_and_written_unrewarded(gateway):
    """The module's last test: it stops the gateway. Conversations left open (here, the earlier
    tests' unrewarded ones) are counted in the log and, with write_unrewarded, written apart."""
    base_url, out_dir, output, process = gateway
    _, health = _health(base_url.removesuffix("/v1"))
    assert health["conversations"] > 0
    process.send_signal(signal.SIGINT)
    process.wait(60)
    counted = re.search(r"(\d+) open conversations were never rewarded: written to", "".join(output))
    unrewarded = list(read_jsonl(str(out_dir / "unrewarded.jsonl")))
    assert counted and int(counted[1]) == len(unrewarded)
    assert 0 < len(unrewarded) <= health["conversations"]  # those with a sampled turn
    assert {t.status.value for t in unrewarded} == {"infra_error"} and all(sum(t.loss_mask) for t in unrewarded)
