"""Agent programs for the online-RL and agent-evaluation tests: functions `(task, base_url, api_key,
**kwargs)` written with the `openai` package alone (the standard library talks to the room
server), as a user writes them; they import nothing of this repository.

`play` plays a room task over HTTP, the model's reply as the action, and answers the room's
reward; with `record_dir` it also writes what every answer's `agentgym` field reported (the ids
the gateway sampled, their log-probs) to `<record_dir>/<api_key>.json`. The others misbehave
on purpose: `raising`, `hanging`, `lying` (an answer in `LIES`, picked by the task), `restarting`
(sends its history back changed once, which starts a new conversation), and `waits_for_update`
(after its first turn, waits for the gateway to serve newer weights: a swap mid-conversation);
`mixed` plays with the first two episodes of a group and misbehaves with the third (by task id:
raises, lies, or restarts); `sleeps` talks to no one.
"""

import json
import os
import signal
import time
import urllib.request

import openai

LIES = [5.0, "high", {"reward": 0.5, "success": "yes"}, {"reward": float("nan")}, {"score": 1.0}, None]


def _call(url: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _version(base_url: str) -> int:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=60) as answer:
        return json.loads(answer.read())["policy_version"]


def play(task, base_url, api_key, env_url, horizon, model="policy", record_dir="", change_history=False,
         wait_for_update_s=0.0, kill_once_after="", marker="", **kwargs):
    if kill_once_after and os.path.isdir(kill_once_after) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # a thread agent: the job's own process, killed mid-step
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    session = _call(f"{env_url}/create", {})["id"]
    reset = _call(f"{env_url}/reset", {"id": session, "data_idx": task})
    messages = [{"role": "user", "content": reset["observation"]}]
    reward, done, success, reports = 0.0, False, False, []
    version = _version(base_url)
    for turn in range(horizon):
        if turn == 1 and wait_for_update_s:  # hold the conversation open until the weights change
            deadline = time.time() + wait_for_update_s
            while _version(base_url) == version and time.time() < deadline:
                time.sleep(0.05)
        if turn == 1 and change_history:  # the agent rewrites its own first answer: a new conversation
            messages[1] = {"role": "assistant", "content": "Action: move up"}
        completion = client.chat.completions.create(model=model, messages=messages)
        reports.append(completion.model_extra["agentgym"])
        action = completion.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": action})
        step = _call(f"{env_url}/step", {"id": session, "action": action})
        reward += step["reward"]
        messages.append({"role": "user", "content": step["observation"]})
        if step["done"]:
            done, success = True, bool(step["info"].get("success"))
            break
    _call(f"{env_url}/close", {"id": session})
    if record_dir:
        with open(os.path.join(record_dir, f"{api_key}.json"), "w") as f:
            json.dump({"task": task, "turns": reports}, f)
    return {"reward": reward, "success": success, "metadata": {"done": done, "turns": len(reports)}}


def raising(task, base_url, api_key, model="policy", **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello."}])
    raise ValueError("the agent's own bug")


def hanging(task, base_url, api_key, model="policy", **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello."}])
    time.sleep(3600)


def lying(task, base_url, api_key, model="policy", **kwargs):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello."}])
    return LIES[task % len(LIES)]


def restarting(task, base_url, api_key, env_url, horizon, **kwargs):
    return play(task, base_url, api_key, env_url, max(horizon, 2), change_history=True, **kwargs)


def mixed(task, base_url, api_key, sample_idx, **kwargs):
    if sample_idx < 2:
        return play(task, base_url, api_key, **kwargs)
    kwargs.pop("record_dir", None), kwargs.pop("wait_for_update_s", None)
    misbehave = [raising, lambda *a, **k: (lying(*a, **k), "high")[1], restarting][task % 3]
    return misbehave(task, base_url, api_key, **kwargs)


def sleeps(task, base_url, api_key, seconds=0.0, **kwargs):
    time.sleep(seconds)
    return 0.25 if task == 3 else 0.0
