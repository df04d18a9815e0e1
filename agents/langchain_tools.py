"""The same tool-environment agent as `agents/openai_tools.py`, written with LangChain's
`langchain-openai` client instead: a user's LangChain agent trains unchanged but for its
`base_url` (and the `api_key` the job hands each episode).

    python -m agentgym_jax.launch --config=configs/agent_movie.py --config.env.agent=agents.langchain_tools:play
"""

import json
import urllib.request

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI


def _call(url: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def play(task: int, base_url: str, api_key: str, env_url: str, horizon: int, model: str = "policy", **kwargs) -> dict:
    instruction = _call(f"{env_url}/tasks")["instruction"]
    session = _call(f"{env_url}/create", {})["id"]
    try:
        reset = _call(f"{env_url}/reset", {"id": session, "data_idx": task})
        tools = _call(f"{env_url}/tools?id={session}")["tools"]
        llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0).bind_tools(tools)
        messages = [HumanMessage(f"{instruction}\n\n{reset['observation']}")]
        reward, status = 0.0, "max_turns"
        for _ in range(horizon):
            reply = llm.invoke(messages)
            messages.append(reply)
            calls = reply.tool_calls
            if len(calls) == 1:
                action = f"Action: {calls[0]['name']} with Action Input: {json.dumps(calls[0]['args'])}"
            else:
                action = reply.content if isinstance(reply.content, str) else ""
            step = _call(f"{env_url}/step", {"id": session, "action": action})
            reward += step["reward"]
            if step["done"]:
                status = "success" if step["info"].get("success") else "failure"
                break
            messages.append(ToolMessage(step["observation"], tool_call_id=calls[0]["id"] if calls else "none"))
        return {"reward": reward, "status": status}
    finally:
        _call(f"{env_url}/close", {"id": session})
