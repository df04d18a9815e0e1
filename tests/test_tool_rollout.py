"""Function calling in the rollout engine (`RolloutConfig.tool_calls`) against real Academia servers.

A scripted sampler (tests/test_rollout.py) writes Qwen3 replies with `<tool_call>` blocks: the
oracle's solution (played in-process, independent of the server), plus reasoning, a malformed
call and a call made only in thought. The reference for the token ids is Qwen3's own
`apply_chat_template(..., tools=...)` of the conversation the server answered.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import pytest

from agentgym_jax.aio import run_sync
from agentgym_jax.envs.pool import EnvPool
from agentgym_jax.job import play as job_play
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.envs.protocol.tool_calls import format_agentgym, parse_tool_call
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout import agentgym_format
from agentgym_jax.rollout.demonstrations import play_oracle_episodes
from agentgym_jax.rollout.engine import RolloutConfig, RolloutEngine
from agentgym_jax.rollout.transcript import prompt_messages
from environments.registry import get_environment
from tests.servers import start_server
from tests.test_rollout import ScriptedSampler

TASK = 5  # Academia: "Does the paper ... cite the paper ...?", solved in three calls
CONFIG = RolloutConfig(max_tokens_per_turn=256, max_response_length=100_000, tool_calls=True)


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    return tokenizer, ChatFraming(tokenizer)


@pytest.fixture(scope="module")
def academia_url():
    with start_server("academia") as url:
        yield url


def oracle_calls(task: int) -> list[str]:
    """The oracle's `<tool_call>` replies for a task, played in-process."""
    env = get_environment("academia")()
    env.reset(task)
    replies, done = [], False
    while not done:
        replies.append(env.named_oracle_action("tool_call"))
        done = env.step(replies[-1]).done
    return replies


class RecordingPool(EnvPool):
    """Keeps what each slot sent and got back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: dict[int, list[tuple[str, str]]] = {}

    async def step(self, slot, action):
        result = await super().step(slot, action)
        self.sent.setdefault(slot, []).append((action, result.observation))
        return result


def scripted(framing: ChatFraming, scripts: list[list[str]]) -> ScriptedSampler:
    sampler = ScriptedSampler(framing, scripts, action_format="{}")
    sampler.config = dataclasses.replace(sampler.config, max_new_tokens=256)
    return sampler


def play(framing, url, scripts, tasks, horizon=10):
    pool = RecordingPool(url)
    with RolloutEngine(scripted(framing, scripts), framing, pool, None, CONFIG) as engine:
        trajectories = engine.run(None, tasks, horizon, jax.random.key(0), policy_version=0)
        return trajectories, pool.sent, engine.task_info


def test_a_tool_episode_is_token_exact_and_sends_the_calls(qwen3, academia_url):
    tokenizer, framing = qwen3
    solution = oracle_calls(TASK)
    replies = ["<think>\nLoad the citation net first.\n</think>\n\n" + solution[0],
               'paperEdgeCheck(node1="unclosed',  # malformed: an invalid action, answered as a tool message
               *solution[1:]]
    (trajectory,), sent, info = play(framing, academia_url, [replies], [TASK])
    assert trajectory.status is EpisodeStatus.SUCCESS and trajectory.reward == pytest.approx(1.0)
    assert trajectory.invalid_actions == 1 and trajectory.num_turns == len(replies)
    # The server got each call in AgentGym's format, and the malformed reply as it was written.
    actions = [action for action, _ in sent[0]]
    assert actions[1] == replies[1]
    assert [a for k, a in enumerate(actions) if k != 1] == [format_agentgym(parse_tool_call(c)) for c in solution]
    assert "Unclosed parenthesis" in sent[0][1][1]
    # Token for token: the context of every turn is the template's rendering of the conversation
    # so far, with the session's tools in the system block, the calls as OpenAI `tool_calls` and the
    # answers as tool messages (control-token text in the instruction stays text, as the framing
    # encodes it: `sanitize_control_tokens=True`).
    goal = get_environment("academia")().reset(TASK)  # the server's /reset (the environment is deterministic)
    messages = prompt_messages(info.instruction, goal, "short")
    for k, (start, end) in enumerate(trajectory.turn_spans):
        template = tokenizer.apply_chat_template(messages, tools=info.metadata["tools"], tokenize=True, return_dict=False,
                                                 add_generation_prompt=True, sanitize_control_tokens=True)
        assert trajectory.token_ids[:start] == list(template), f"context of turn {k}"
        assert trajectory.token_ids[start:end] == tokenizer.encode(replies[k]) + list(framing.end_of_turn_ids)
        messages += [as_openai(replies[k]), {"role": "tool", "content": sent[0][k][1]}]
    assert "<tool_response>\nObservation: PaperNet is loaded." in trajectory.text
    assert sum(trajectory.loss_mask) == sum(end - start for start, end in trajectory.turn_spans)
    # AgentGym's conversation format has no tool role: the results are human turns, and the tool
    # list Qwen3's template writes into its system turn is that turn's text.
    system, *turns = agentgym_format.export_trajectory(trajectory, framing)["conversations"]
    assert system["from"] == "system" and system["value"].startswith("# Tools\n")
    assert [t["from"] for t in turns] == ["human"] + ["gpt", "human"] * (len(replies) - 1) + ["gpt"]
    assert [t["value"] for t in turns[1::2]] == replies
    assert [t["value"] for t in turns[2::2]] == [observation for _, observation in sent[0][:-1]]


def as_openai(reply: str) -> dict:
    """A reply as an OpenAI assistant message: reasoning, content and structured `tool_calls`."""
    reasoning, _, visible = reply.rpartition("</think>\n\n")
    message = {"role": "assistant", "content": visible}
    if reasoning:
        message["reasoning_content"] = reasoning.removeprefix("<think>\n").removesuffix("\n")
    if visible.startswith("<tool_call>"):
        call = parse_tool_call(visible)
        message.update(content="", tool_calls=[{"type": "function", "function": call.to_json()}])
    return message


def test_oracle_demonstrations_are_framed_as_the_rollouts_are(qwen3, academia_url):
    """SFT data and RL episodes of a function-calling job (`rollout.tool_calls`, the demonstrations
    of `job/play.py`) are the same ids for the same calls."""
    _, framing = qwen3
    (played,), _, info = play(framing, academia_url, [oracle_calls(TASK)], [TASK])

    async def oracle():
        async with EnvPool(academia_url) as pool:
            return await play_oracle_episodes(pool, [TASK], oracle="tool_call", action_format="{action}")

    config = ml_collections.ConfigDict(dict(sft=dict(num_tasks=1), rollout=dict(tool_calls=True)))
    (demo,) = job_play.demonstrations(config, framing, info, run_sync(oracle()))
    assert demo.status is EpisodeStatus.SUCCESS
    assert (demo.token_ids, demo.loss_mask, demo.turn_spans) == (played.token_ids, played.loss_mask, played.turn_spans)
    config.rollout.tool_calls = False  # a text job's demonstrations: no tools in the prompt
    (text_demo,) = job_play.demonstrations(config, framing, info, run_sync(oracle()))
    assert len(text_demo.token_ids) < len(demo.token_ids) - 100


def test_a_call_made_only_in_thought_is_not_sent(qwen3, academia_url):
    _, framing = qwen3
    finish = '<tool_call>\n{"name": "finish", "arguments": {"answer": "Yes"}}\n</tool_call>'
    replies = [f"<think>\nI could just answer: {finish}\n</think>\n\n", "loadPaperNet()"]
    (trajectory,), sent, _ = play(framing, academia_url, [replies], [TASK], horizon=2)
    assert [action for action, _ in sent[0]] == ["\n\n", format_agentgym(parse_tool_call("loadPaperNet()"))]
    assert sent[0][0][1].startswith("Invalid action: Empty reply: no tool call.")
    assert trajectory.status is EpisodeStatus.MAX_TURNS and trajectory.invalid_actions == 1


def test_a_perturbed_session_prompts_with_its_own_tools(qwen3):
    """schema_change=1 renames every parameter from the first turn: the session's tools (its
    `/tools?id=`) are in the prompt, and a call by the old names is refused naming the new ones."""
    tokenizer, framing = qwen3
    solution = oracle_calls(TASK)
    with start_server("academia", perturbation="schema_change=1") as url:
        (trajectory,), sent, _ = play(framing, url, [solution[1:2] * 2], [TASK], horizon=2)
    prompt = tokenizer.decode(trajectory.token_ids[: trajectory.turn_spans[0][0]])
    assert '"node1_v2"' in prompt and '"node1"' not in prompt
    assert "node1_v2" in sent[0][0][1] and trajectory.invalid_actions == 2


def test_tool_calls_need_a_template_that_frames_tool_messages(smollm2, academia_url):
    tokenizer = load_tokenizer(smollm2[0])
    refusing = ("{%- for m in messages %}{%- if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{%- endif %}"
                "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    framing = ChatFraming(tokenizer, chat_template=refusing)
    with pytest.raises(ValueError, match="rollout.tool_calls: this chat template cannot frame tool messages"):
        RolloutEngine(scripted(framing, [[]]), framing, EnvPool(academia_url), None, CONFIG)
