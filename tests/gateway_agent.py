"""An agent written with the `openai` package alone (the standard library talks to the environment):
it plays a tool environment's task through an OpenAI-compatible server and rewards each episode.

    python -I tests/gateway_agent.py --base_url=http://127.0.0.1:8000/v1 --api_key=secret \
        --env_url=http://127.0.0.1:9000 --task=5 --episodes=3 --horizon=3

Episodes are played round-robin, one turn each in turn, so that more conversations are open
than the gateway has sampler rows. Even episodes pass the gateway's `conversation_id` back; odd
ones only send the conversation's messages back. The reward is the environment's score less a
cost per token of the conversation. Prints one JSON line per episode: its conversation id,
reward and, per turn, what the answer's `agentgym` field reported. The system prompt is the
agent's own: the tools go in `tools=`, so the environment's instruction (AgentGym's text format
for the same calls) is not sent.
"""

import argparse
import json
import urllib.request

import openai

SYSTEM = "Answer the question with the tools you are given; call finish with the answer."


def call(url: str, body: dict | None = None, token: str = "") -> dict:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


class Episode:
    def __init__(self, args, number: int):
        self.args, self.number = args, number
        self.session = call(f"{args.env_url}/create", {})["id"]
        reset = call(f"{args.env_url}/reset", {"id": self.session, "data_idx": args.task})
        self.tools = reset["tools"]
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": reset["observation"]}]
        self.conversation_id, self.turns, self.score, self.done, self.tokens = None, [], 0.0, False, 0

    def turn(self, client: openai.OpenAI) -> None:
        extra = {"conversation_id": self.conversation_id} if self.conversation_id and self.number % 2 == 0 else {}
        completion = client.chat.completions.create(model=self.args.model, messages=self.messages, tools=self.tools,
                                                    max_tokens=self.args.max_tokens, extra_body=extra)
        report = completion.model_extra["agentgym"]
        self.conversation_id, self.tokens = report["conversation_id"], completion.usage.total_tokens
        self.turns.append(report)
        message = completion.choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        calls = message.tool_calls or []
        if calls:
            action = f"Action: {calls[0].function.name} with Action Input: {calls[0].function.arguments}"
        else:
            action = message.content or ""
        step = call(f"{self.args.env_url}/step", {"id": self.session, "action": action})
        self.score += step["reward"]
        if calls:  # one call per turn is run; the others are answered as not run
            self.messages += [{"role": "tool", "tool_call_id": c.id, "content": step["observation"] if i == 0 else
                               "Error: one tool call per turn; this one was not run."} for i, c in enumerate(calls)]
        else:
            self.messages.append({"role": "user", "content": step["observation"]})
        self.done = step["done"] or len(self.turns) == self.args.horizon

    def reward(self) -> dict:
        reward = self.score - 1e-4 * self.tokens
        call(f"{self.args.base_url}/conversations/{self.conversation_id}/reward",
             {"reward": reward, "success": self.score >= 1.0, "task_id": self.args.task, "group_id": self.args.task,
              "sample_idx": self.number, "env": "academia"}, self.args.api_key)
        return {"conversation_id": self.conversation_id, "reward": reward, "sample_idx": self.number, "turns": self.turns}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("base_url", "api_key", "env_url"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--model", default="policy")
    for name, default in (("task", 0), ("episodes", 3), ("horizon", 3), ("max_tokens", 12)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    episodes = [Episode(args, k) for k in range(args.episodes)]
    while not all(e.done for e in episodes):
        for episode in episodes:
            if not episode.done:
                episode.turn(client)
    for episode in episodes:
        print(json.dumps(episode.reward()), flush=True)


if __name__ == "__main__":
    main()
