"""AgentGym conversation files: import for SFT (loss on trained gpt turns only), export, round trips.

Tokenizers are built here by `build_tokenizer` (ChatML and Llama-3.1 templates); the AgentGym sample
follows AgentTraj-L's published layout (instruction, an "Ok." with loss false, then turns).
"""

import json

import pytest

from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.chat import ChatFraming
from agentgym_jax.models.tokenizer import load_tokenizer
from agentgym_jax.rollout.trajectory import Trajectory
from agentgym_jax.rollout import agentgym_format as agf

INSTRUCTION = "You are given a few useful crafting recipes to craft items in Minecraft.\nCrafting commands: craft <item>"
SAMPLE = {
    "item_id": "textcraft_12",
    "conversations": [
        {"from": "human", "loss": None, "value": INSTRUCTION},
        {"from": "gpt", "loss": False, "value": "Ok."},
        {"from": "human", "loss": None, "value": "Crafting commands:\ncraft 1 stick using 2 oak planks\nGoal: craft stick."},
        {"from": "gpt", "loss": True, "value": "Thought: I need planks.\nAction: get 1 oak log"},
        {"from": "human", "loss": None, "value": "Got 1 oak log"},
        {"from": "gpt", "loss": None, "value": "Action: craft 4 oak planks using 1 oak log"},  # null: trained
        {"from": "human", "loss": None, "value": "Crafted 4 minecraft:oak_planks"},
        {"from": "gpt", "loss": True, "value": "Action: craft 1 stick using 2 oak planks"},
    ],
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def framing(request, tmp_path_factory):
    folder = bt.build_tokenizer(tmp_path_factory.mktemp(request.param), [INSTRUCTION] * 5, 500, request.param)
    return ChatFraming(load_tokenizer(folder))


def as_chat(conversations):
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in conversations]


def masked_runs(trajectory):
    runs, current = [], []
    for token, m in zip(trajectory.token_ids, trajectory.loss_mask):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def test_import_frames_like_the_template_and_trains_only_gpt_turns(framing, request):
    tokenizer = framing.tokenizer
    t = agf.import_item(SAMPLE, framing, group_id=3)
    assert (t.env, t.task_id, t.group_id, t.status, t.reward) == ("textcraft", 12, 3, EpisodeStatus.SUCCESS, 1.0)
    reference = tokenizer.apply_chat_template(as_chat(SAMPLE["conversations"]), tokenize=True, return_dict=False)
    assert t.token_ids == list(reference)
    eot = END_OF_TURN[request.node.callspec.params["framing"]]
    trained = [turn["value"] for turn in SAMPLE["conversations"][3:] if turn["from"] == "gpt"]
    assert [tokenizer.decode(run, skip_special_tokens=False) for run in masked_runs(t)] == [v + eot for v in trained]
    assert [t.token_ids[s:e] for s, e in t.turn_spans] == masked_runs(t)
    assert sum(t.loss_mask) < len(t.token_ids) and t.num_turns == 3


def policy_trajectory(framing, system, final_observation, cut_last=False):
    """A trajectory built the way the rollout does: prompt, sampled turns, continuations."""
    prompt = ([{"role": "system", "content": "You are a crafter."}] if system else []) + [
        {"role": "user", "content": INSTRUCTION},
        {"role": "assistant", "content": "Ok."},
        {"role": "environment", "content": "Goal: craft stick."},
    ]
    ids = list(framing.prompt_ids(prompt).ids)
    mask, spans = [0] * len(ids), []
    turns = [("Action: get 1 oak log", "Got 1 oak log"), ("Action: craft 1 stick", "Crafted 1 stick")]
    for i, (action, observation) in enumerate(turns):
        sampled = list(framing.assistant_ids(action).ids)
        if cut_last and i == len(turns) - 1:
            sampled = sampled[:-2]  # the token budget cut the turn: no end-of-turn id
        spans.append((len(ids), len(ids) + len(sampled)))
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        if i < len(turns) - 1 or final_observation:
            closing = [] if sampled[-1] in framing.end_of_turn_ids else list(framing.end_of_turn_ids)
            cont = closing + list(framing.continuation_ids(observation).ids)
            ids, mask = ids + cont, mask + [0] * len(cont)
    return Trajectory(task_id=7, env="textcraft", group_id=0, token_ids=ids, loss_mask=mask,
                      logprobs=[0.0] * len(ids), turn_spans=spans, turn_rewards=[0.0, 1.0], reward=1.0,
                      status=EpisodeStatus.SUCCESS)  # fmt: skip


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("final_observation", [False, True])
def test_trajectory_export_then_import_gives_the_same_tokens(framing, system, final_observation, tmp_path):
    t = policy_trajectory(framing, system, final_observation)
    item = agf.export_trajectory(t, framing)
    expected = ([{"from": "system", "loss": None, "value": "You are a crafter."}] if system else []) + [
        {"from": "human", "loss": None, "value": INSTRUCTION},
        {"from": "gpt", "loss": False, "value": "Ok."},
        {"from": "human", "loss": None, "value": "Goal: craft stick."},
        {"from": "gpt", "loss": True, "value": "Action: get 1 oak log"},
        {"from": "human", "loss": None, "value": "Got 1 oak log"},
        {"from": "gpt", "loss": True, "value": "Action: craft 1 stick"},
    ] + ([{"from": "human", "loss": None, "value": "Crafted 1 stick"}] if final_observation else [])
    assert item["conversations"] == expected
    assert (item["item_id"], item["reward"], item["success"], item["status"]) == ("textcraft_7", 1.0, 1, "success")

    agf.export_file(tmp_path / "out.json", [t], framing)
    (back,) = agf.import_file(tmp_path / "out.json", framing)
    # Import renders like apply_chat_template(add_generation_prompt=False): a final observation
    # has no generation header after it, and a final assistant turn is closed with the template's
    # after-end-of-turn ids (ChatML "\n"), where the rollout stops at the end-of-turn id.
    if final_observation:
        header = len(framing.generation_header_ids)
        assert t.token_ids[-header:] == list(framing.generation_header_ids)
        expected_ids, expected_mask = t.token_ids[:-header], t.loss_mask[:-header]
    else:
        tail = list(framing.after_end_of_turn_ids)
        expected_ids, expected_mask = t.token_ids + tail, t.loss_mask + [0] * len(tail)
    assert back.token_ids == expected_ids
    assert back.loss_mask == expected_mask
    assert back.turn_spans == t.turn_spans


def test_export_of_a_turn_cut_by_the_token_budget(framing):
    t = policy_trajectory(framing, system=False, final_observation=True, cut_last=True)
    turns = agf.export_trajectory(t, framing)["conversations"]
    cut = framing.tokenizer.decode(framing.assistant_ids("Action: craft 1 stick").ids[:-2])
    assert turns[-2] == {"from": "gpt", "loss": True, "value": cut}
    assert turns[-1] == {"from": "human", "loss": None, "value": "Crafted 1 stick"}


def test_file_round_trip_json_list_and_jsonl(framing, tmp_path):
    agf.write_file(tmp_path / "traj.json", [SAMPLE])
    (tmp_path / "inference.jsonl").write_text(json.dumps({**SAMPLE, "reward": 0.0, "success": 0}) + "\n")
    imported = agf.import_file(tmp_path / "traj.json", framing)
    agf.export_file(tmp_path / "again.json", imported, framing)
    (again,) = agf.read_file(tmp_path / "again.json")
    normalized = [{**turn, "loss": True} if turn["from"] == "gpt" and turn["loss"] is None else turn
                  for turn in SAMPLE["conversations"]]  # fmt: skip
    assert again["conversations"] == normalized and again["item_id"] == "textcraft_12"
    (failed,) = agf.import_file(tmp_path / "inference.jsonl", framing)
    assert failed.status == EpisodeStatus.FAILURE and failed.reward == 0.0
    assert failed.token_ids == imported[0].token_ids


def with_turn(index, **changes):
    conversations = [dict(turn) for turn in SAMPLE["conversations"]]
    conversations[index].update(changes)
    return {**SAMPLE, "conversations": conversations}


@pytest.mark.parametrize(
    "item, match",
    [
        (with_turn(2, loss=True), "a 'human' turn marked loss=true"),
        (with_turn(3, **{"from": "bot"}), r"turn 3: need \{'from': one of"),
        (with_turn(3, loss="yes"), "'loss' must be true, false or null"),
        (with_turn(1, **{"from": "human"}), "item 'textcraft_12'.*must alternate"),
        ({**SAMPLE, "item_id": "textcraft"}, "item_id must look like"),
        ({**SAMPLE, "item_id": 12}, "item_id must look like"),
        ({"item_id": "webshop_5238", "conversations": None}, "has no conversations"),
    ],
)
def test_bad_items_get_clear_errors(framing, item, match):
    with pytest.raises(ValueError, match=match):
        agf.import_item(item, framing)


def test_bad_files_get_clear_errors(tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="every item must be a JSON object"):
        agf.read_file(tmp_path / "bad.json")
