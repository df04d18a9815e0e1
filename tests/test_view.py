"""The trajectory viewer (`agentgym_jax/view/`).

Failure patterns on hand-built episodes (the invalid-action streak against a brute force over
every order of the turns); the index and the episode view over real runs, made by the project's
own eval runner on `room` (the oracle, and a random 1-layer model sampled at temperature 1);
the JSON API of a real `python -m agentgym_jax.view` process over those runs and a synthetic run
of 100k episodes; and the page in a real headless Chromium: it lists, filters, pages the 100k
run without fetching it, opens an episode, replays it, shows its masked tokens (checked on a
screenshot) and log-probs on hover, and compares the same task across two runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from agentgym_jax import progress
from agentgym_jax.envs.protocol import EpisodeStatus
from agentgym_jax.eval import runner
from agentgym_jax.models import decoder, hf_checkpoint
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rollout.trajectory import Trajectory, read_jsonl
from agentgym_jax.view import patterns as P
from agentgym_jax.view.episode import episode_view
from agentgym_jax.view.index import Filter, FilterError, RunIndex, run_files
from agentgym_jax.view.tokens import TokenText, find_tokenizer
from configs import eval as eval_config

REPO = pathlib.Path(__file__).resolve().parents[1]
BIG = 100_000  # episodes of the synthetic run
RUNS = ("oracle", "model", "big", "few", "alone")  # the viewer's runs 0..4
EOT = 2  # the synthetic run's end-of-turn id

_spec = importlib.util.spec_from_file_location("bench_view_index", REPO / "bench" / "view_index.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def episode(turns: list[list[int]], *, status=EpisodeStatus.FAILURE, invalid=0, stepped=None) -> Trajectory:
    """A hand-built record: a 2-id prompt, then each turn's ids followed by one environment id."""
    ids, spans = [5, 6], []
    for turn in turns:
        spans.append((len(ids), len(ids) + len(turn)))
        ids += turn + [9]
    mask = [0] * len(ids)
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    stepped = len(turns) if stepped is None else stepped
    return Trajectory(task_id=0, env="room", group_id=0, token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids),
                      turn_spans=spans, turn_rewards=[0.0] * stepped, reward=0.0, status=status, invalid_actions=invalid)


# ---- failure patterns (pure functions) ------------------------------------------------------


def test_repeated_action_is_the_longest_run_of_identical_turns():
    a, b = [11, 12, EOT], [13, EOT]
    assert P.longest_repeat(episode([])) == 0
    assert P.longest_repeat(episode([a, b, a])) == 1
    assert P.longest_repeat(episode([a, a, b, a, a, a, b])) == 3
    assert P.longest_repeat(episode([a, a + [7]])) == 1  # a longer turn is another action
    assert "repeated_action" in P.patterns(episode([b, a, a, a]), {EOT})
    assert "repeated_action" not in P.patterns(episode([a, a, b, a, a]), {EOT})


def test_the_invalid_streak_is_the_longest_run_every_order_of_the_turns_forces():
    for n in range(0, 8):
        for k in range(0, n + 1):
            # brute force: over every set of k invalid turns among n, the shortest longest run
            forced = min(
                (max((len(list(g)) for v, g in itertools.groupby(i in chosen for i in range(n)) if v), default=0)
                 for chosen in map(set, itertools.combinations(range(n), k))),
            )
            assert P.shortest_invalid_streak(episode([[3, EOT]] * n, invalid=k)) == forced, (n, k)
    # a last turn never stepped has no verdict: 2 invalid of 2 stepped turns force a run of 2
    assert P.shortest_invalid_streak(episode([[3, EOT]] * 3, invalid=2, stepped=2)) == 2
    assert "invalid_streak" in P.patterns(episode([[3, EOT]] * 3, invalid=3), {EOT})
    assert "invalid_streak" not in P.patterns(episode([[3, EOT]] * 5, invalid=3), {EOT})  # could be 2 + 1
    assert "invalid_streak" in P.patterns(episode([[3, EOT]], invalid=1, status=EpisodeStatus.INVALID_ACTION_LIMIT), {EOT})


def test_statuses_and_turns_cut_by_the_token_limit():
    cut = episode([[3, EOT], [4, 4, 4]], status=EpisodeStatus.MAX_TURNS)
    assert P.truncated_turns(cut, {EOT}) == 1
    assert P.patterns(cut, {EOT}) == ["max_turns", "truncated_turn"]
    assert P.patterns(cut, None) == ["max_turns"]  # no tokenizer: cut turns are not looked for
    assert P.patterns(episode([[3, EOT]], status=EpisodeStatus.TOKEN_BUDGET), {EOT}) == ["token_budget"]
    assert P.patterns(episode([[3, EOT]], status=EpisodeStatus.SUCCESS), {EOT}) == []
    assert P.flag_bits(["max_turns", "truncated_turn"]) == 0b10010


# ---- real runs, made by the eval runner -----------------------------------------------------


def small_random_model(tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    """A Hugging Face folder with a 1-layer model of random weights and the run's tokenizer."""
    from agentgym_jax.models.tokenizer import load_tokenizer

    model = ModelConfig.small(vocab_size=len(load_tokenizer(tokenizer_dir)), hidden_size=32, intermediate_size=64,
                              num_heads=2, num_kv_heads=1, head_dim=16, num_layers=1)
    shapes = jax.eval_shape(lambda key: decoder.init_params(model, key), jax.random.key(0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda leaf: jax.numpy.asarray(0.05 * rng.standard_normal(leaf.shape), leaf.dtype), shapes)
    hf_checkpoint.save_pretrained(params, model, out, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """`oracle`: the oracle on 6 room test tasks; `model`: a random model on the same tasks, 2
    samples each, horizon 3, 4 tokens a turn (its tokenizer named by run.json's `hf:` policy);
    `big`: a synthetic run of 100k episodes in a lone JSONL file (no tokenizer); `few`: the
    oracle's first 3 episodes, `alone`: one episode of a task no other run has (lone files)."""
    root = tmp_path_factory.mktemp("view_runs")
    config = eval_config.get_config()
    config.envs, config.task_ids, config.horizon, config.out_dir = "room", "6", 12, str(root / "oracle")
    runner.run(config)
    small_random_model(root / "oracle" / "tokenizer", root / "hf")
    config = eval_config.get_config()
    config.envs, config.task_ids, config.horizon, config.out_dir = "room", "6", 3, str(root / "model")
    config.policy, config.group_size, config.temperature = f"hf:{root / 'hf'}", 2, 1.0
    config.rollout.max_tokens_per_turn, config.rollout.max_cache_len = 4, 512
    log = io.StringIO()  # what a log shows while it runs (test_a_short_evaluation_logs_...)
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(log):
        patch.setattr(progress, "INTERVAL_S", 0.0)  # a line at every report: the run is short
        runner.run(config)
    (root / "model.log").write_text(log.getvalue())
    bench.write_synthetic_run(root / "big.jsonl", BIG, turns=3, turn_tokens=2, prompt_tokens=3)
    lines = (root / "oracle" / "trajectories.jsonl").read_text().splitlines(keepends=True)
    (root / "few.jsonl").write_text("".join(lines[:3]))
    (root / "alone.jsonl").write_text(json.dumps({**json.loads(lines[0]), "task_id": 9999}) + "\n")
    return {"oracle": root / "oracle", "model": root / "model", "big": root / "big.jsonl", "model_log": root / "model.log",
            "few": root / "few.jsonl", "alone": root / "alone.jsonl"}


@pytest.fixture(scope="module")
def text(runs) -> TokenText:
    return TokenText.load(runs["oracle"] / "tokenizer")


def records(run: pathlib.Path) -> list[Trajectory]:
    return list(read_jsonl(str(run / "trajectories.jsonl")))


def test_a_short_evaluation_logs_turns_tokens_and_an_eta(runs):
    """The model's evaluation (12 episodes in one batch, which finish together) says in its log
    lines, before any episode has finished, how many turns it played and tokens it decoded and
    when it should end; its last line counts every turn and sampled token of its records."""
    lines = [line for line in runs["model_log"].read_text().splitlines() if line.startswith("room ")]
    counts = [dict(kv.split("=") for kv in line.split(" | ")[-1].split()) for line in lines if "turns=" in line]
    waiting = [line for line in lines if line.startswith("room 0/12 episodes") and "ETA " in line]
    assert waiting and all(int(dict(kv.split("=") for kv in w.split(" | ")[-1].split())["tokens"]) > 0 for w in waiting)
    turns = [int(c["turns"]) for c in counts]
    assert turns == sorted(turns) and 0 < turns[len(turns) // 2] < turns[-1]
    model = records(runs["model"])
    assert lines[-1].startswith("room 12/12 episodes | ") and counts[-1] == {
        "turns": str(sum(t.num_turns for t in model)), "tokens": str(sum(sum(t.loss_mask) for t in model))}


def test_token_pieces_join_to_the_decoded_text(text):
    ids = text.tokenizer("Action: move up. héllo wörld ✓ <|im_end|>")["input_ids"]
    pieces = text.pieces(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text.tokenizer.decode(ids, skip_special_tokens=False)
    assert "é" in pieces and "✓" in pieces  # a character's bytes shown as the character
    assert pieces[:2] == [text.tokenizer.decode([ids[0]]), text.tokenizer.decode([ids[1]])]
    for cut in (ids[:-1], ids[:-13], ids[8:-1]):  # ends, or starts, inside a character
        assert "".join(text.pieces(cut)) == text.tokenizer.decode(cut, skip_special_tokens=False)
    assert text.end_of_turn_ids == {text.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_each_run_finds_its_own_tokenizer(runs, tmp_path, monkeypatch):
    assert find_tokenizer(runs["oracle"])[0] == runs["oracle"] / "tokenizer"  # an oracle eval builds one
    assert find_tokenizer(runs["model"])[0] == runs["model"].parent / "hf"  # run.json: policy hf:<folder>
    rl = tmp_path / "rl"
    shutil.copytree(runs["oracle"] / "tokenizer", rl / "tokenizer")
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "run.json").write_text(json.dumps({"policy": f"checkpoint:{rl}"}))
    assert find_tokenizer(tmp_path / "eval")[0] == rl / "tokenizer"
    (rl / "iter_1").mkdir()
    assert find_tokenizer(rl / "iter_1" / "explored.jsonl")[0] == rl / "tokenizer"  # a file: its folder's parent
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "run.json").write_text(json.dumps({"policy": f"hf:{tmp_path / 'nowhere'}"}))
    folder, why = find_tokenizer(tmp_path / "gone")
    assert folder is None and "whose tokenizer.json is not on this machine" in why
    # named models, looked up where `models/fetch.py` keeps them (nothing is fetched)
    monkeypatch.setenv("AGENTGYM_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    shutil.copytree(runs["oracle"] / "tokenizer", tmp_path / "models" / "smollm2-135m-instruct")
    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc123"
    shutil.copytree(runs["oracle"] / "tokenizer", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    for policy, expected in (("pretrained:smollm2-135m-instruct", tmp_path / "models" / "smollm2-135m-instruct"),
                             ("hf:Org/Tiny", snapshot), ("hf:Org/Absent", None), ("pretrained:unbuilt", None)):
        (tmp_path / "gone" / "run.json").write_text(json.dumps({"policy": policy}))
        assert find_tokenizer(tmp_path / "gone")[0] == expected, policy
    assert find_tokenizer(runs["big"]) == (None, f"no tokenizer/ or run.json in {runs['big'].parent} or {runs['big'].parent.parent}")


def test_the_tokenizer_flag_takes_every_policy_a_job_takes(runs, tmp_path, monkeypatch, capsys):
    """`--tokenizer` as a folder or as any policy a job takes (`pretrained:<name>` as
    `models/fetch.py` keeps it, `hf:<dir>`, `hf:<org>/<name>`, `checkpoint:<dir>`); each decodes
    the run, and a name that is no model is refused in one line naming the known ones."""
    from agentgym_jax.view.__main__ import open_runs

    monkeypatch.setenv("AGENTGYM_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    source = runs["oracle"] / "tokenizer"
    shutil.copytree(source, tmp_path / "models" / "smollm2-135m-instruct")
    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc123"
    shutil.copytree(source, snapshot)
    shutil.copytree(source, tmp_path / "job" / "tokenizer")
    t = records(runs["model"])[0]
    for spec, folder in ((str(source), source), ("pretrained:smollm2-135m-instruct", tmp_path / "models" / "smollm2-135m-instruct"),
                         (f"hf:{source}", source), ("hf:Org/Tiny", snapshot), (f"checkpoint:{tmp_path / 'job'}", tmp_path / "job" / "tokenizer")):
        (run,) = open_runs([str(runs["model"])], spec)
        assert run.text is not None and run.tokenizer.startswith(f"{folder} (--tokenizer"), (spec, run.tokenizer)
        assert "".join(run.text.pieces(t.token_ids)) == t.text
    assert f"tokenizer: {snapshot} (--tokenizer=hf:Org/Tiny)" in capsys.readouterr().out
    for spec, says in (("pretrained:nothing", "--tokenizer=pretrained:nothing: unknown pretrained model 'nothing'; known: smollm2"),
                       ("hf:Org/Absent", "--tokenizer=hf:Org/Absent: hf:Org/Absent is not in the Hugging Face cache")):
        with pytest.raises(ValueError, match=re.escape(says)):
            open_runs([str(runs["model"])], spec)


def test_the_index_holds_what_the_records_say(runs, text):
    for name in ("oracle", "model"):
        expected = records(runs[name])
        index = RunIndex(name, run_files(runs[name]), text.end_of_turn_ids)
        rows = index.select(Filter())
        got = index.summaries(rows)
        assert len(got) == len(expected) == {"oracle": 6, "model": 12}[name]
        for summary, t in zip(got, expected):
            assert (summary["env"], summary["task_id"], summary["sample_idx"], summary["attempt"], summary["step"]) == (
                t.env, t.task_id, t.sample_idx, t.attempt, 0)  # step 0: no update trained on an evaluation's episodes
            assert (summary["status"], summary["reward"], summary["turns"], summary["tokens"], summary["invalid_actions"]) == (
                t.status.value, t.reward, t.num_turns, len(t.token_ids), t.invalid_actions)
            assert index.read(summary["id"]) == t
        tasks = sorted({t.task_id for t in expected})
        assert [s["id"] for s in index.summaries(index.task_rows("room", tasks[1]))] == [
            i for i, t in enumerate(expected) if t.task_id == tasks[1]]
    # what each run is known to hold, independently of the pattern code
    oracle = RunIndex("oracle", run_files(runs["oracle"]), text.end_of_turn_ids)
    assert all(s["status"] == "success" and not {"truncated_turn", "invalid_streak"} & set(s["patterns"])
               for s in oracle.summaries(oracle.select(Filter())))
    model = RunIndex("model", run_files(runs["model"]), text.end_of_turn_ids)
    im_end = text.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for s, t in zip(model.summaries(model.select(Filter())), records(runs["model"])):
        assert s["status"] == "max_turns" and "max_turns" in s["patterns"]  # a random policy never reaches the goal in 3
        cut = any(t.token_ids[end - 1] != im_end for _, end in t.turn_spans)
        assert ("truncated_turn" in s["patterns"]) == cut
        assert ("invalid_streak" in s["patterns"]) == (t.invalid_actions == 3)
    assert len(model.select(Filter(pattern="max_turns", step=(0, 0)))) == 12  # step 0: no update trained on them
    assert len(model.select(Filter(status="success"))) == 0 and len(model.select(Filter(env="maze"))) == 0


def test_the_index_follows_a_live_file(runs, tmp_path):
    lines = (runs["oracle"] / "trajectories.jsonl").read_bytes().splitlines(keepends=True)
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(b"".join(lines[:2]) + lines[2][:40])  # a third record half written
    index = RunIndex("live", [path])
    assert len(index) == 2 and not index.refresh()
    with open(path, "ab") as f:
        f.write(lines[2][40:] + b'{"not": "a record"}\n' + b"".join(lines[3:]))
    assert index.refresh() and len(index) == 6 and index.num_bad_lines == 1
    assert index.bad_lines[0].startswith(f"{path}:4: TypeError")
    assert [index.read(r).task_id for r in range(6)] == [json.loads(line)["task_id"] for line in lines]
    assert index.location(2) == f"{path}:3" and index.location(3) == f"{path}:5"
    replaced = tmp_path / "new.jsonl"  # a resumed run rewrites the file (a new inode) with fewer records
    replaced.write_bytes(lines[5])
    os.replace(replaced, path)
    assert index.refresh() and len(index) == 1 and index.read(0).task_id == json.loads(lines[5])["task_id"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no trajectories.jsonl"):
        run_files(tmp_path / "empty")
    with pytest.raises(FilterError, match="want an integer or a range"):
        Filter.from_query({"step": "3-5"})
    with pytest.raises(FilterError, match="not an episode status; valid: success, failure"):
        Filter.from_query({"status": "won"})
    assert Filter.from_query({"task": "3:5", "reward_min": "0.5", "env": " "}) == Filter(task=(3, 5), reward_min=0.5)


def test_the_episode_view_is_the_record_token_for_token(runs, text):
    for name in ("oracle", "model"):
        for t in records(runs[name])[:3]:
            view = episode_view(t, text)
            segments = [view["prompt"]] + [seg for turn in view["turns"] for seg in (turn["policy"], turn["observation"])]
            assert sum((s["ids"] for s in segments), []) == t.token_ids
            assert sum((s["mask"] for s in segments), []) == t.loss_mask
            assert sum((s["logprob"] for s in segments), []) == t.logprobs
            assert [s["start"] for s in segments] == list(itertools.accumulate([0] + [len(s["ids"]) for s in segments[:-1]]))
            assert "".join(sum((s["text"] for s in segments), [])) == t.text  # the rollout's own decoding
            assert [turn["policy"]["start"] for turn in view["turns"]] == [s for s, _ in t.turn_spans]
            assert all(set(turn["policy"]["mask"]) == {1} for turn in view["turns"])
            assert [turn["reward"] for turn in view["turns"]][: len(t.turn_rewards)] == t.turn_rewards
            assert view["text"] is None and view["status"] == t.status.value
    bare = episode_view(records(runs["model"])[0], None)  # no tokenizer: ids, and the record's text
    assert bare["prompt"]["text"] is None and bare["text"] == records(runs["model"])[0].text


# ---- the server, a real process -------------------------------------------------------------


@pytest.fixture(scope="module")
def viewer(runs):
    """`python -m agentgym_jax.view <oracle> <model> <big.jsonl> <few.jsonl> <alone.jsonl> --port=0`; yields its URL."""
    cmd = [sys.executable, "-m", "agentgym_jax.view", *(str(runs[name]) for name in RUNS), "--port=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("serving viewer on "):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        ready.wait(180)
        line = next((line for line in output if line.startswith("serving viewer on ")), None)
        assert line is not None, "".join(output)[-3000:]
        assert f"indexed {runs['big']}: {BIG} episodes from 1 file(s)" in "".join(output)
        yield line.split(" on ", 1)[1].strip()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def get(url: str, method: str = "GET") -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def big_rows(**where) -> list[int]:
    """The synthetic run's episodes with the fields `where` asks for, from the generator's rules."""
    rules = dict(
        status=lambda i: bench.STATUSES[i % 7], env=lambda i: ("room", "maze")[i % 2],
        step=lambda i: i * 100 // BIG + 1,  # trained in that RL step (train_step + 1)
        task=lambda i: i % 1000, reward=lambda i: (i % 5) / 4,
        repeated=lambda i: i % 3 == 0, truncated=lambda i: i % 6 == 1,
        invalid_streak=lambda i: i % 4 == 3 or bench.STATUSES[i % 7] == "invalid_action_limit",
    )
    return [i for i in range(BIG) if all(test(rules[key](i)) for key, test in where.items())]


def test_the_api_pages_filters_and_refuses_bad_requests(viewer):
    status, info = get(f"{viewer}/api/runs")
    assert status == 200 and [r["episodes"] for r in info["runs"]] == [6, 12, BIG, 3, 1]
    assert [(r["decoded"], r["truncation_checked"]) for r in info["runs"]] == [(True, True)] * 2 + [(False, False)] * 3
    assert info["runs"][2]["steps"] == [1, 100]  # numbered as metrics.jsonl numbers them

    status, page = get(f"{viewer}/api/episodes?run=2&offset=99990&limit=50")
    assert page["total"] == BIG and [e["id"] for e in page["episodes"]] == list(range(99990, BIG))
    expected = big_rows(status="success".__eq__, step=lambda s: 10 <= s <= 20)
    status, page = get(f"{viewer}/api/episodes?run=2&status=success&step=10:20&limit=500")
    assert page["total"] == len(expected) and [e["id"] for e in page["episodes"]] == expected[:500]
    assert all(e["status"] == "success" and 10 <= e["step"] <= 20 for e in page["episodes"])
    status, page = get(f"{viewer}/api/episodes?run=2&env=maze&task=5:9&reward_min=0.5&offset=10")
    assert page["total"] == len(big_rows(env="maze".__eq__, task=lambda t: 5 <= t <= 9, reward=lambda r: r >= 0.5))

    status, counts = get(f"{viewer}/api/patterns?run=2&step=1:2")
    assert counts["steps"] == [1, 2] and sum(counts["episodes"]) == len(big_rows(step=lambda s: s <= 2))
    for pattern, rule in (("repeated_action", "repeated"), ("invalid_streak", "invalid_streak")):
        per_step = [len(big_rows(step=step.__eq__, **{rule: bool})) for step in (1, 2)]
        assert counts["patterns"][pattern] == per_step, pattern
    assert counts["patterns"]["truncated_turn"] == [0, 0]  # no tokenizer, no end-of-turn id: not looked for
    assert counts["patterns"]["max_turns"] == [len(big_rows(step=s.__eq__, status="max_turns".__eq__)) for s in (1, 2)]

    status, task = get(f"{viewer}/api/task?env=room&task=4")
    assert status == 200 and len(task["runs"]) == 5
    assert [e["sample_idx"] for e in task["runs"][1]["episodes"]] == [0, 1]

    for path, code, says in (
        ("/api/episodes?run=5", 404, "there are 5 runs"),
        ("/api/episodes?run=x", 400, "is not an integer"),
        ("/api/episodes?run=2&limit=0", 400, "outside [1, 500]"),
        ("/api/episodes?run=2&step=3-5", 400, "want an integer or a range"),
        ("/api/patterns?run=2&pattern=loops", 400, "not a failure pattern; valid: repeated_action"),
        ("/api/episode?run=1", 400, "missing parameter 'id'"),
        ("/api/episode?run=1&id=12", 404, "has 12 episodes"),
        ("/api/task?task=4", 400, "missing parameter 'env'"),
        ("/api/episodes?run=2&stauts=success", 400, "unknown parameter 'stauts' for /api/episodes; valid: run, env, status"),
        ("/api/nothing", 404, "unknown path"),
    ):
        status, body = get(viewer + path)
        assert status == code and says in body["error"], (path, status, body)
    status, body = get(f"{viewer}/api/runs", method="POST")
    assert status == 405 and "use GET" in body["error"]
    status, page = get(f"{viewer}/api/episodes?run=0")  # still serving
    assert status == 200 and page["total"] == 6


def test_the_command_line_refuses_what_it_cannot_serve(viewer, runs, tmp_path):
    from agentgym_jax.view.__main__ import main

    port = viewer.rsplit(":", 1)[1]
    for args, says in (
        ([str(tmp_path / "absent")], "is neither a run folder nor a JSONL file"),
        ([str(tmp_path)], "holds no trajectories.jsonl"),
        ([str(runs["oracle"]), str(runs["oracle"])], "a run is given twice"),
        ([str(runs["oracle"]), f"--tokenizer={tmp_path}"], "holds no tokenizer.json"),
        ([str(runs["oracle"]), f"--port={port}"], f"cannot serve on 127.0.0.1:{port}"),  # the fixture's port
    ):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert isinstance(exit_.value.code, str) and exit_.value.code.startswith("error: ") and says in exit_.value.code, args


def test_non_finite_numbers_reach_the_browser_as_null():
    from agentgym_jax.view.server import json_response

    body = {"logprob": [0.0, float("-inf"), -0.5], "reward": float("nan"), "ok": (1, "x")}
    assert json.loads(json_response(body).text) == {"logprob": [0.0, None, -0.5], "reward": None, "ok": [1, "x"]}


# ---- the page, in a real headless Chromium --------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for every page test (the flags MiniWoB's browsers use on this
    machine); each test sizes its window."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from environments.miniwob import browser as miniwob

    options = webdriver.ChromeOptions()
    options.binary_location = miniwob.chromium_path()
    for flag in miniwob.FLAGS:
        if not flag.startswith("--window-size"):
            options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(miniwob.chromedriver_path()))
    try:
        yield driver
    finally:
        driver.quit()


def open_page(d, url: str, width: int, height: int) -> None:
    """The viewer at `url` in a `width` x `height` viewport, its first run listed."""
    d.set_window_size(width, height)
    inner = d.execute_script("return [window.innerWidth, window.innerHeight]")
    d.set_window_size(2 * width - inner[0], 2 * height - inner[1])  # the window's frame, if any, outside the viewport
    d.get(url)
    assert d.execute_script("return window.innerWidth") == width
    wait_for(d, lambda d: listed(d) == "run=0&offset=0")


def listed(d) -> str:
    """The query the episode list shows (set once its rows are in)."""
    return d.find_element("id", "episodes").get_attribute("data-query")


def rows(d) -> list:
    return d.find_elements("css selector", "#episodes tbody tr")


def show_run(d, run: int) -> None:
    from selenium.webdriver.support.ui import Select

    Select(d.find_element("id", "f-run")).select_by_value(str(run))
    wait_for(d, lambda d: listed(d) == f"run={run}&offset=0")


def wait_for(driver, condition, timeout: float = 30.0):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, StaleElementReferenceException)  # the page re-renders as answers come
    return WebDriverWait(driver, timeout, poll_frequency=0.05, ignored_exceptions=ignored).until(lambda d: condition(d))


def pixels_in(png: bytes, rect: dict, scale: float) -> np.ndarray:
    """The screenshot's RGB pixels inside an element's viewport rectangle."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    top, left = math.ceil(rect["top"] * scale), math.ceil(rect["left"] * scale)
    bottom, right = math.floor(rect["bottom"] * scale), math.floor(rect["right"] * scale)
    return image[top:bottom, left:right].reshape(-1, 3)


def test_the_page_lists_filters_opens_replays_and_compares(viewer, browser, runs, text):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model = records(runs["model"])
    oracle = records(runs["oracle"])
    d = browser
    open_page(d, viewer, 1600, 1000)
    assert len(rows(d)) == 6
    assert "[2] " in d.find_element(By.ID, "runs").text and "no tokenizer" in d.find_element(By.ID, "runs").text

    # filter: the random model's run, episodes with a turn cut by the token limit
    Select(d.find_element(By.ID, "f-run")).select_by_value("1")
    wait_for(d, lambda d: listed(d) == "run=1&offset=0")
    assert d.find_element(By.ID, "page-info").text == "1-12 of 12"
    Select(d.find_element(By.ID, "f-pattern")).select_by_value("truncated_turn")
    d.find_element(By.ID, "f-apply").click()
    im_end = text.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = [i for i, t in enumerate(model) if any(t.token_ids[e - 1] != im_end for _, e in t.turn_spans)]
    wait_for(d, lambda d: listed(d) == "run=1&pattern=truncated_turn&offset=0")
    assert d.find_element(By.ID, "page-info").text == f"1-{len(cut)} of {len(cut)}"
    assert [int(r.find_element(By.TAG_NAME, "td").text) for r in rows(d)] == cut
    assert d.find_element(By.ID, "patterns-table").text.splitlines()[1].split()[:2] == ["–", str(len(cut))]  # no RL step

    # open one: every token in its place, the trained ones marked, the log-prob on hover
    number = cut[0]
    t = model[number]
    rows(d)[0].click()
    pane = d.find_element(By.ID, "pane-a")
    wait_for(d, lambda d: f"#{number} " in pane.find_element(By.CLASS_NAME, "ep-head").text)
    spans = pane.find_elements(By.CSS_SELECTOR, ".ep-body .t")
    assert len(spans) == len(t.token_ids)
    assert d.execute_script(
        "return Array.from(arguments[0].querySelectorAll('.ep-body .t')).map(s => s.textContent).join('')", pane) == t.text
    assert [int(s.get_attribute("data-i")) for s in pane.find_elements(By.CSS_SELECTOR, ".ep-body .t.m1")] == [
        i for i, m in enumerate(t.loss_mask) if m]
    pieces = text.pieces(t.token_ids)
    first = next(i for i, m in enumerate(t.loss_mask) if m and pieces[i].strip())  # a sampled token with text
    token = pane.find_element(By.CSS_SELECTOR, f'.ep-body .t[data-i="{first}"]')
    ActionChains(d).move_to_element(token).perform()
    wait_for(d, lambda d: f"token {first} " in d.find_element(By.ID, "tokinfo").text)
    hover = d.find_element(By.ID, "tokinfo").text
    assert f"id {t.token_ids[first]} " in hover and "loss_mask 1 (sampled by the policy)" in hover  # an evaluation
    assert f"logprob {t.logprobs[first]:.4f} (p {math.exp(t.logprobs[first]):.4f})" in hover
    assert t.logprobs[first] < 0  # a real sampler's log-prob, not a placeholder

    # the screenshot shows the episode's text, trained tokens on their colour
    scale = d.execute_script("return window.devicePixelRatio")
    png = d.get_screenshot_as_png()
    box = lambda e: d.execute_script("return arguments[0].getBoundingClientRect().toJSON()", e)  # noqa: E731
    widest = max((i for i, m in enumerate(t.loss_mask) if m), key=lambda i: len(pieces[i].strip()))
    # (viewer.css: trained #bfeec4, trained with p < 0.1 #f9c49a, not trained: the page's white)
    colour = np.array([0xF9, 0xC4, 0x9A] if t.logprobs[widest] < math.log(0.1) else [0xBF, 0xEE, 0xC4])
    near = lambda pixels, c: np.abs(pixels.astype(int) - c).sum(1) <= 6  # noqa: E731
    trained = pixels_in(png, box(pane.find_element(By.CSS_SELECTOR, f'.ep-body .t[data-i="{widest}"]')), scale)
    assert near(trained, colour).mean() > 0.3  # the trained token's background
    assert (trained.sum(1) < 200).any()  # and dark text on it
    prompt = pixels_in(png, box(pane.find_element(By.CSS_SELECTOR, ".seg.prompt .toks")), scale)
    assert (prompt.sum(1) < 600).mean() > 0.03 and (prompt.sum(1) < 300).any()  # the prompt's text
    assert not near(prompt, colour).any() and near(prompt, np.array([255, 255, 255])).mean() > 0.5

    # an evaluation's episode: its policy tokens are the policy's, not trained on
    legend = pane.find_element(By.CLASS_NAME, "legend").text
    assert "sampled by the policy (loss_mask 1)" in legend and "trained" not in legend.replace("no update trained", "")

    # replay turn by turn
    policy_turns = lambda: len(pane.find_elements(By.CSS_SELECTOR, ".seg.policy"))  # noqa: E731
    assert policy_turns() == t.num_turns and f"episode ended: {t.status.value}" in pane.text
    pane.find_element(By.CLASS_NAME, "first").click()
    assert policy_turns() == 0 and f"turn 0 / {t.num_turns}" in pane.text and "episode ended" not in pane.text
    pane.find_element(By.CLASS_NAME, "next-turn").click()
    assert policy_turns() == 1 and f"turn 1 / {t.num_turns}" in pane.text and "turn 1: environment" in pane.text

    # compare: the same task in the oracle's run
    Select(d.find_element(By.ID, "compare-run")).select_by_value("0")
    other = d.find_element(By.ID, "pane-b-episode")
    solved = next(i for i, o in enumerate(oracle) if o.task_id == t.task_id)
    wait_for(d, lambda d: f"#{solved} room task {t.task_id} " in other.text)
    assert "success" in other.find_element(By.CLASS_NAME, "ep-head").text
    assert len(other.find_elements(By.CSS_SELECTOR, ".ep-body .t.m1")) == sum(oracle[solved].loss_mask)
    # no blank line opens an environment's answer: its newline after the policy's end-of-turn token is hidden
    answers = other.find_elements(By.CSS_SELECTOR, ".seg.observation .toks")
    shown = [d.execute_script("return arguments[0].innerText", a) for a in answers]
    assert answers and all(text and not text.startswith("\n") for text in shown), shown
    assert all(a.get_attribute("textContent").startswith("\n<|im_start|>user") for a in answers)  # every token still there

    # the 100k run: pages come from the server, the browser never holds the run
    Select(d.find_element(By.ID, "f-run")).select_by_value("2")
    d.find_element(By.ID, "f-clear").click()
    wait_for(d, lambda d: listed(d) == "run=2&offset=0")
    assert d.find_element(By.ID, "page-info").text == f"1-50 of {BIG}"
    d.find_element(By.ID, "next").click()
    wait_for(d, lambda d: listed(d) == "run=2&offset=50")
    assert d.find_element(By.ID, "page-info").text == f"51-100 of {BIG}"
    page_no = d.find_element(By.ID, "page-no")
    page_no.clear()
    page_no.send_keys("2000\n")
    wait_for(d, lambda d: listed(d) == "run=2&offset=99950")
    assert d.find_element(By.ID, "page-info").text == f"99951-100000 of {BIG}"
    assert len(rows(d)) == 50 and rows(d)[0].find_element(By.TAG_NAME, "td").text == "99950"
    received = d.execute_script(
        "return performance.getEntriesByType('resource').reduce((n, e) => n + e.encodedBodySize, 0)")
    assert received < runs["big"].stat().st_size / 20, received
    assert rows(d)[0].find_elements(By.TAG_NAME, "td")[5].text == "100"  # trained in RL step 100 (train_step 99)
    rows(d)[0].click()
    wait_for(d, lambda d: "#99950 " in pane.text)
    assert pane.find_element(By.CSS_SELECTOR, ".ep-body .t").text.startswith("⟨")  # no tokenizer: the ids
    assert " step 100 " in pane.find_element(By.CLASS_NAME, "ep-head").text
    assert "trained in step 100 (loss_mask 1)" in pane.find_element(By.CLASS_NAME, "legend").text
    assert not d.find_element(By.ID, "error").is_displayed()


LAYOUT = """
const box = (e) => e.getBoundingClientRect();
const list = document.getElementById("list"), patterns = document.getElementById("patterns");
const inList = (e) => box(e).left >= box(list).left - 0.5 && box(e).right <= box(list).right + 0.5 && box(e).width > 0;
const heads = [...document.querySelectorAll("#episodes thead th")];
return {
  list_overflow: list.scrollWidth - list.clientWidth, patterns_overflow: patterns.scrollWidth - patterns.clientWidth,
  visible: {run: inList(document.getElementById("f-run")), id: inList(heads[0]), env: inList(heads[1]),
            first_cells: [...(document.querySelector("#episodes tbody tr") || {children: []}).children].slice(0, 2).every(inList)},
  list: box(list).width, a: box(document.getElementById("pane-a")).width, b: box(document.getElementById("pane-b")).width,
  b_empty: document.getElementById("pane-b").classList.contains("empty"),
};
"""


def test_the_page_fits_1280_and_1920_wide(viewer, browser):
    """At 1280x800 and 1920x1080 the list never scrolls sideways, whatever its rows hold (the
    100k run's longest statuses and patterns), its run, id and env stay in view; a comparison
    pane with no episode keeps a narrow strip, one that shows an episode an equal share."""
    from selenium.webdriver.common.by import By

    d = browser
    for width, height in ((1280, 800), (1920, 1080)):
        open_page(d, viewer, width, height)
        for run in (0, 2):  # the oracle's run, then the 100k run's statuses and patterns
            show_run(d, run)
            layout = d.execute_script(LAYOUT)
            assert layout["list_overflow"] <= 0 and layout["patterns_overflow"] <= 0, (width, run, layout)
            assert all(layout["visible"].values()), (width, run, layout)
            assert layout["b_empty"] and layout["b"] < width / 6 and layout["a"] > 2 * layout["b"], (width, layout)
        show_run(d, 1)
        rows(d)[0].click()  # the model's episode; the oracle's of its task beside it
        wait_for(d, lambda d: d.find_element(By.ID, "pane-b-episode").find_elements(By.CLASS_NAME, "ep-head"))
        layout = d.execute_script(LAYOUT)
        assert layout["list_overflow"] <= 0 and all(layout["visible"].values()), (width, layout)
        assert not layout["b_empty"] and abs(layout["a"] - layout["b"]) <= 2, (width, layout)


def test_the_compare_pane_picks_a_run_with_the_task_and_marks_the_one_shown(viewer, browser, runs):
    """An episode's task compared in the first other run that has it, else in its own run (an RL
    run's other steps), else the pane says that no run has it; the episode shown beside is the
    one marked in the compare list, and a run picked by hand without the task says which have it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    d = browser
    open_page(d, viewer, 1280, 800)
    other = d.find_element(By.ID, "pane-b-episode")
    compare = lambda: Select(d.find_element(By.ID, "compare-run")).first_selected_option.get_attribute("value")  # noqa: E731
    marked = lambda: [b.get_attribute("data-id") for b in d.find_elements(By.CSS_SELECTOR, "#compare-list button.shown")]  # noqa: E731

    show_run(d, 3)  # few.jsonl: the oracle's first 3 episodes; the task is also in runs 0 and 1
    task = records(runs["oracle"])[0].task_id
    rows(d)[0].click()
    wait_for(d, lambda d: f"room task {task} " in other.text)
    assert compare() == "0" and "oracle #0 " in other.find_element(By.CLASS_NAME, "ep-head").text
    assert marked() == ["0"]

    show_run(d, 2)  # the 100k run: maze task 1 is in no other run, in 100 of its own episodes
    rows(d)[1].click()
    wait_for(d, lambda d: compare() == "2" and other.find_elements(By.CLASS_NAME, "ep-head"))
    buttons = d.find_elements(By.CSS_SELECTOR, "#compare-list button")
    assert [int(b.get_attribute("data-id")) for b in buttons] == list(range(1001, BIG, 1000))  # its others
    wait_for(d, lambda d: marked() == ["99001"])  # the same sample's latest
    buttons[0].click()
    wait_for(d, lambda d: "#1001 " in other.text)
    assert marked() == ["1001"] and buttons[0].get_attribute("aria-pressed") == "true"

    show_run(d, 4)  # alone.jsonl: a task no run has another episode of
    rows(d)[0].click()
    wait_for(d, lambda d: "no other episode of this task in any run" in d.find_element(By.ID, "compare-list").text)
    assert other.text == "" and "empty" in d.find_element(By.ID, "pane-b").get_attribute("class")

    show_run(d, 1)
    rows(d)[0].click()
    wait_for(d, lambda d: compare() == "0" and other.find_elements(By.CLASS_NAME, "ep-head"))
    Select(d.find_element(By.ID, "compare-run")).select_by_value("4")  # picked by hand: it lacks the task
    says = f"no other episode of this task in {runs['alone']}; runs that have one: 0: {runs['oracle']}, 1: {runs['model']}"
    wait_for(d, lambda d: says in d.find_element(By.ID, "compare-list").text)


def test_a_filter_that_cannot_be_read_clears_the_list_under_its_error(viewer, browser):
    from selenium.webdriver.common.by import By

    d = browser
    open_page(d, viewer, 1280, 800)
    assert len(rows(d)) == 6
    d.find_element(By.ID, "f-step").send_keys("abc\n")
    error = d.find_element(By.ID, "error")
    wait_for(d, lambda d: error.is_displayed() and "step='abc'" in error.text)
    assert rows(d) == [] and d.find_element(By.ID, "page-info").text == "no episodes listed: the filter cannot be read"
    assert d.find_element(By.ID, "patterns-table").find_elements(By.CSS_SELECTOR, "tbody tr") == []
    d.find_element(By.ID, "f-clear").click()
    wait_for(d, lambda d: len(rows(d)) == 6 and not error.is_displayed())
