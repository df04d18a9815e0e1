"""build_tokenizer: deterministic folders, loadable by AutoTokenizer, lossless on environment text."""

import json

import pytest

from agentgym_jax.models import build_tokenizer as bt
from agentgym_jax.models.tokenizer import load_tokenizer
from tests.servers import request_json, start_server

TEXTS = [
    "You are in the middle of a room. Looking quickly around you, you see a cabinet 1 and a drawer 2.\n",
    "Thought: I need an oak log first.\nAction: get 1 oak log\nObservation: Got 1 oak log\n",
    "Your position is (2, 3). The goal is at (5, 1). Action: move down\n",
] * 10
ENV_TEXT = (
    "Crafting commands:\ncraft 4 oak planks using 1 oak log\n  craft 1 stick using 2 oak planks  \n"
    "Goal: craft wooden pickaxe. Observation: You see a red ball 1 — café ☕ 日本語 \t\n\n"
)


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_same_texts_give_the_same_files(tmp_path, template):
    first = files(bt.build_tokenizer(tmp_path / "a", TEXTS, vocab_size=512, template=template))
    second = files(bt.build_tokenizer(tmp_path / "b", TEXTS, vocab_size=512, template=template))
    assert set(first) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert first == second
    other = files(bt.build_tokenizer(tmp_path / "c", TEXTS[:1] * 10, vocab_size=512, template=template))
    assert other["tokenizer.json"] != first["tokenizer.json"]  # the texts matter


@pytest.mark.parametrize(
    "template, specials, eos",
    [
        ("chatml", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>"),
        ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    ],
)
def test_folder_loads_with_template_and_special_tokens(tmp_path, template, specials, eos):
    folder = bt.build_tokenizer(tmp_path, TEXTS, vocab_size=512, template=template)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.is_fast and len(tokenizer) <= 512
    for token in specials:  # each special token is one id, never split by BPE
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.eos_token == eos
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == bt.TEMPLATES[template].chat_template == tokenizer.chat_template
    assert json.loads((folder / "special_tokens_map.json").read_text())["eos_token"] == eos
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.endswith({"chatml": "<|im_start|>assistant\n", "llama3": "<|end_header_id|>\n\n"}[template])


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_environment_text_round_trips_and_is_compressed(tmp_path, template):
    tokenizer = load_tokenizer(bt.build_tokenizer(tmp_path, TEXTS, vocab_size=768, template=template))
    ids = tokenizer.encode(ENV_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == ENV_TEXT  # unseen characters fall back to bytes
    assert len(ids) < len(ENV_TEXT.encode()) / 2  # the action grammar is learned, not spelled out
    assert len(tokenizer.encode("Action: craft", add_special_tokens=False)) <= 3


def test_llama3_prepends_bos_only_when_asked(tmp_path):
    tokenizer = load_tokenizer(bt.build_tokenizer(tmp_path, TEXTS, vocab_size=512, template="llama3"))
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert tokenizer.encode("look")[0] == bos
    assert bos not in tokenizer.encode("look", add_special_tokens=False)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown template 'gpt'.*chatml, gemma, llama3"):
        bt.train_tokenizer(TEXTS, 512, "gpt")
    with pytest.raises(ValueError, match="below 259"):
        bt.train_tokenizer(TEXTS, 100, "chatml")
    with pytest.raises(SystemExit, match="text file not found"):
        bt.main([f"--out={tmp_path / 'x'}", f"--text_file={tmp_path / 'missing.txt'}"])


def test_cli_trains_on_text_files(tmp_path):
    transcripts = tmp_path / "transcripts.txt"
    transcripts.write_text("Action: go through zebra portal 7\n" * 50)
    out = bt.main([f"--out={tmp_path / 'tok'}", "--vocab_size=600", f"--text_file={transcripts}"])
    tokenizer = load_tokenizer(out)
    # Words seen only in the transcript file became single tokens.
    assert len(tokenizer.encode(" zebra portal", add_special_tokens=False)) == 2


def test_cli_reads_instructions_from_a_running_server_and_names_one_that_does_not_answer(tmp_path):
    """The library never imports a server: the command line asks the server for its instruction."""
    with start_server("maze") as url:
        instruction = request_json(url, "GET", "/tasks")[1]["instruction"]
        lean, rich = (load_tokenizer(bt.main([f"--out={tmp_path / name}", "--vocab_size=600", *urls]))
                      for name, urls in (("lean", []), ("rich", [f"--env_url={url}"])))
    assert len(rich.encode(instruction, add_special_tokens=False)) < 0.8 * len(lean.encode(instruction, add_special_tokens=False))
    with pytest.raises(SystemExit, match="no task info from http://127.0.0.1:9/tasks"):
        bt.main([f"--out={tmp_path / 'x'}", "--env_url=http://127.0.0.1:9"])
