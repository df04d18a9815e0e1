"""An agent written with the `openai` package alone (the standard library talks to the
environment): it plays one task of a tool environment (Movie, Academia, ...) over HTTP.

    python -m agentgym_jax.launch --config=configs/agent_movie.py   # env.agent=agents.openai_tools:play

Its conversation is the one the rollout engine's function-calling episodes hold
(`rollout.tool_calls=True`): one user message (the environment's instruction, a blank line, the
first observation), the session's tools in `tools=`, each reply's one tool call run on the
server in AgentGym's format (any other reply sent as its text, which the server answers as an
invalid action), and every answer appended as one tool message. So an SFT start made on the
environment's demonstrations serves it, and the two ways of training compare on equal terms.
It answers the sum of the environment's rewards and whether it succeeded; a conversation that
outgrows the gateway's context ends the episode with what it earned (`token_budget`).
"""

import json
import urllib.request

import openai


def _call(url: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def action_of(message) -> str:
    """What the server is sent: the reply's one call in AgentGym's format, else its text."""
    calls = message.tool_calls or []
    if len(calls) == 1:
        return f"Action: {calls[0].function.name} with Action Input: {calls[0].function.arguments}"
    return message.content or ""


def play(task: int, base_url: str, api_key: str, env_url: str, horizon: int, model: str = "policy", **kwargs) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    instruction = _call(f"{env_url}/tasks")["instruction"]
    session = _call(f"{env_url}/create", {})["id"]
    try:
        reset = _call(f"{env_url}/reset", {"id": session, "data_idx": task})
        tools = _call(f"{env_url}/tools?id={session}")["tools"]
        messages = [{"role": "user", "content": f"{instruction}\n\n{reset['observation']}"}]
        reward, status = 0.0, "max_turns"
        for _ in range(horizon):
            try:
                completion = client.chat.completions.create(model=model, messages=messages, tools=tools)
            except openai.BadRequestError as e:
                if getattr(e, "code", None) != "context_length_exceeded":
                    raise
                status = "token_budget"
                break
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            step = _call(f"{env_url}/step", {"id": session, "action": action_of(message)})
            reward += step["reward"]
            if step["done"]:
                status = "success" if step["info"].get("success") else "failure"
                break
            calls = message.tool_calls or []
            messages.append({"role": "tool", "tool_call_id": calls[0].id if calls else "none", "content": step["observation"]})
        return {"reward": reward, "status": status}
    finally:
        _call(f"{env_url}/close", {"id": session})
