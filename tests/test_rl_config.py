"""Every `config.algo` key reaches the update (a field of `Batching`, `RLSpec` or `BatchFilter`, or
a hyper-parameter the chosen estimator or loss declares), settable with `--config.algo.<key>=...`
(the flag parser `launch` uses), and a bad value is a `ConfigError` naming the value and the valid
ones."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from agentgym_jax.config import ConfigError
from agentgym_jax.envs.protocol import TaskInfo
from agentgym_jax.job import play, setup
from agentgym_jax.job import settings as job_settings
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from agentgym_jax.rl.losses import POLICY_LOSSES
from agentgym_jax.rollout.rl_batch import BatchFilter
from agentgym_jax.train import settings
from agentgym_jax.train.steps import Batching, RLSpec
from configs import quickstart

MODEL = ModelConfig.small()
# Keys that do not reach the update itself: the separate critic's folder and learning rate (read
# where its train state is built).
NOT_UPDATE = {"critic_dir", "critic_lr"}
# A valid value other than the default for every key.
OVERRIDES = {
    "advantage": "gae", "advantage_epsilon": 1e-4, "gamma": 0.9, "lam": 0.95, "discount": "turn", "whiten": False, "ppo_epochs": 3,
    "num_minibatches": 4, "num_microbatches": 2, "length_buckets": 3, "length_spacing": "even", "shared_prefix": False, "policy_loss": "gspo", "clip_eps_low": 0.1,
    "clip_eps_high": 0.28, "dual_clip_c": 3.0, "kl_coef": 0.01, "kl_estimator": "k3", "kl_in_reward": True, "entropy_coef": 0.01,
    "vf_coef": 0.25, "clip_eps_value": 0.3, "critic": "separate", "agg_mode": "seq-mean-token-sum-norm", "loss_norm_length": 512,
    "is_correction": "sequence", "is_cap": 3.0, "decoupled_ppo": False, "dynamic_sampling": True, "max_extra_groups": 4,
    "overlong": "penalty", "overlong_buffer": 128, "overlong_penalty": 0.5, "step_weight": 0.5,
    "turn_penalty": 0.015625,
}
# Keys of another estimator than the overrides' (gae): checked with the one that reads them.
OTHER_ESTIMATOR = {"step_weight": "gigpo"}
HPARAM_KEYS = {"epsilon": "advantage_epsilon"}


def parse(*overrides: str):
    """The config `launch` would run for `--config=configs/quickstart.py <overrides>`."""
    argv = ["launch", "--config=configs/quickstart.py", *overrides]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def test_every_algo_key_reaches_the_update_and_every_override_arrives():
    fields = {f.name for cls in (Batching, RLSpec, BatchFilter) for f in dataclasses.fields(cls)}
    hparams = {HPARAM_KEYS.get(h, h) for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES) for e in registry.values()
               for h in e.hparams}
    assert set(parse().algo.keys()) - NOT_UPDATE <= fields | hparams
    assert set(OVERRIDES) == set(parse().algo.keys()) - NOT_UPDATE
    config = parse(*(f"--config.algo.{key}={value}" for key, value in OVERRIDES.items()))
    update, rules = settings.update(config, MODEL, objective="rl"), settings.batch_filter(config)
    read = {**dict(update.rl.advantage_hparams), **dict(update.rl.loss_hparams)}
    for key, value in OVERRIDES.items():
        if key in OTHER_ESTIMATOR:
            other = settings.update(parse(f"--config.algo.advantage={OTHER_ESTIMATOR[key]}", f"--config.algo.{key}={value}"),
                                    MODEL, objective="rl")
            assert dict(other.rl.advantage_hparams)[key] == value, key
            continue
        part = next((p for p in (update.batching, update.rl, rules) if hasattr(p, key)), None)
        name = next((h for h, k in HPARAM_KEYS.items() if k == key), key)
        assert (getattr(part, key) if part is not None else read[name]) == value, key
    assert not rules.grouped and settings.batch_filter(parse("--config.algo.advantage=dr_grpo")).grouped  # the registry's word


def test_zero_means_off_for_optional_values_and_an_estimator_reads_only_what_it_declares():
    update = settings.update(parse(), MODEL, objective="rl")
    assert update.rl.advantage == "grpo" and update.rl.advantage_hparams == ()  # gamma, lam, whiten: GAE's
    assert dict(update.rl.loss_hparams) == {"clip_eps_low": 0.2, "clip_eps_high": 0.2}  # dual_clip_c=0: off
    assert update.batching.loss_norm_length is None and update.rl.decoupled_ppo is False
    gae = settings.update(parse("--config.algo.advantage=gae", "--config.algo.lam=0.9"), MODEL, objective="rl")
    assert dict(gae.rl.advantage_hparams) == {"gamma": 1.0, "lam": 0.9, "discount": "token", "whiten": True}
    gigpo = settings.update(parse("--config.algo.advantage=gigpo", "--config.algo.gamma=0.95"), MODEL, objective="rl")
    assert dict(gigpo.rl.advantage_hparams) == {"gamma": 0.95, "step_weight": 1.0}


@pytest.mark.parametrize("overrides, message", [
    (["--config.algo.advantage=ppo"], "advantage='ppo' is not one of grpo, dr_grpo, rloo, reinforce_plus_plus, gae"),
    (["--config.algo.advantage=gae", "--config.algo.gamma=1.5"], "gamma must be in .0, 1., got 1.5"),
    (["--config.algo.advantage=reinforce_plus_plus", "--config.algo.discount=step"], "unknown discount 'step'; valid: token, turn"),
    (["--config.algo.policy_loss=grpo"], "policy_loss='grpo' is not one of ppo, gspo"),
    (["--config.algo.agg_mode=mean"], "agg_mode='mean' is not one of token-mean"),
    (["--config.algo.agg_mode=seq-mean-token-sum-norm"], "needs loss_norm_length"),
    (["--config.algo.is_correction=tis"], "is_correction='tis' is not one of none, token, sequence"),
    (["--config.algo.dual_clip_c=0.5"], "dual_clip_c must be > 1, got 0.5"),
    (["--config.algo.ppo_epochs=0"], "ppo_epochs must be >= 1, got 0"),
    (["--config.algo.kl_estimator=k4"], "kl_estimator='k4' is not one of k1, k2, k3, low_var_kl"),
    (["--config.algo.decoupled_ppo=True", "--config.algo.is_correction=token"], "decoupled_ppo weights the loss"),
    (["--config.algo.is_cap=0"], "is_cap must be > 0, got 0"),
    (["--config.algo.advantage=rloo", "--config.algo.advantage_epsilon=1e-5"], "advantage_epsilon is not used by rloo"),
    (["--config.algo.advantage_epsilon=-1e-5"], "epsilon must be > 0"),
    (["--config.algo.advantage=rloo", "--config.algo.dual_clip_c=2.0", "--config.algo.policy_loss=gspo"], None),
])
def test_bad_update_values_are_config_errors(overrides, message):
    if message is None:  # a valid combination: dual clip is a hyper-parameter of GSPO's loss too
        assert dict(settings.update(parse(*overrides), MODEL, objective="rl").rl.loss_hparams)["dual_clip_c"] == 2.0
        return
    with pytest.raises(ConfigError, match=message):
        settings.update(parse(*overrides), MODEL, objective="rl")


def test_bad_rollout_values_are_config_errors():
    with pytest.raises(ConfigError, match="fill_tokens must be >= 1, got 0"):
        job_settings.rollout(parse("--config.rollout.fill_tokens=0"))
    assert job_settings.rollout(parse("--config.rollout.fill_tokens=4096")).fill_tokens == 4096


def test_bad_filter_values_are_config_errors():
    with pytest.raises(ConfigError, match="overlong='cut' is not one of off, mask, penalty"):
        settings.batch_filter(parse("--config.algo.overlong=cut"))
    with pytest.raises(ConfigError, match="overlong_penalty must be >= 0, got -1"):
        settings.batch_filter(parse("--config.algo.overlong_penalty=-1.0"))
    with pytest.raises(ConfigError, match="turn_penalty must be >= 0"):
        settings.batch_filter(parse("--config.algo.turn_penalty=-0.01"))


RL_CONFIGS = ["quickstart.py", "textcraft_grpo.py", "babyai_scalinginter.py", "cpu.py:textcraft",
              *(f"{env}_cpu.py" for env in ("maze", "textcraft", "babyai", "wordle", "guess_the_number", "sql", "search", "movie")),
              *(f"{env}_smollm.py" for env in ("textcraft", "babyai", "maze", "wordle")), "quickstart_async.py",
              "smollm.py:textcraft_replay", "smollm.py:babyai_replay"]


@pytest.mark.parametrize("name", RL_CONFIGS)
def test_every_rl_config_builds_its_update_filter_and_schedules(name):
    """What an RL job reads of its config before any model is built is valid in every shipped config."""
    from agentgym_jax.config import load_config_file
    from agentgym_jax.train.settings import horizon_schedule as from_config
    from configs import models

    config = load_config_file(f"configs/{name}")
    assert config.mode == "rl"
    update = settings.update(config, MODEL, objective="rl")
    rules, signal = settings.batch_filter(config), settings.signal(config)
    assert signal.steers(rules) == name.endswith("_replay")  # the pass-rate controls: in the replay recipes only
    schedule = from_config(config.horizon_schedule)
    settings.curriculum(config.curriculum)
    assert schedule.horizon(config.train.steps - 1) <= config.eval.horizon  # held out at least the trained horizon
    assert update.batching.updates_per_step >= 1 and config.rollout.max_cache_len > config.rollout.max_response_length
    assert not config.model.get("preset") or config.model.preset in models.PRESETS


def test_the_cpu_recipe_names_its_environments():
    from configs import cpu

    with pytest.raises(ValueError, match="valid: maze, textcraft, babyai, wordle"):
        cpu.get_config("room")


@pytest.mark.parametrize("env", ["maze", "textcraft", "babyai", "wordle", "movie"])
def test_cpu_recipes_shape_nothing_by_default_and_train_every_stage_equally(env):
    """Issue #15's rules for the recipes: the environment's own reward unless a run opts in, SFT only
    on demonstrations the final horizon holds, and every horizon stage as long as the others."""
    from agentgym_jax.train.settings import horizon_schedule as from_config
    from configs import cpu

    config = cpu.get_config(env)
    assert config.env.reward_shaping == ""
    schedule = from_config(config.horizon_schedule)
    stages = [schedule.stage(step) for step in range(config.train.steps)]
    assert [stages.count(k) for k in range(len(config.horizon_schedule.horizons))] == [config.horizon_schedule.steps_per_stage] * len(config.horizon_schedule.horizons)
    assert config.sft.horizon == config.eval.horizon == config.horizon_schedule.horizons[-1]


@pytest.mark.parametrize("overrides, message", [
    (["--config.env.name=webshop"],
     "config error: the webshop server did not start: unknown environment 'webshop'; valid: "),
    (["--config.env.name=textarena", "--config.env.tasks=game=Chess"], "config error: env.tasks='game=Chess': no textarena task"),
    (["--config.env.name=textcraft", "--config.curriculum.key=depht", "--config.curriculum.max_grades=(1,)"],
     "config error: curriculum.key='depht': the environment's task metadata has no such list; it has: depth"),
    (["--config.rollout.batch_tasks=1", "--config.rollout.group_size=4", "--config.algo.num_microbatches=3"],
     "config error: batch of "),  # 4 rows (8 padded over 8 simulated devices) in 3 micro-batches: before SFT
])
def test_a_config_error_found_once_the_job_is_open_ends_in_one_line(tmp_path, overrides, message):
    """The job has started its servers when it reads the task metadata; the error still ends as
    the launcher's one line (exit 1, no traceback), like a bad key caught before the job."""
    command = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/quickstart.py",
               f"--config.workdir={tmp_path}", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(message), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


OLD_CONFIG = """
from configs import quickstart

def get_config():
    config = quickstart.get_config()
    del config.horizon_schedule
    config.horizon = dict(schedule="fixed", rounds=10)  # as configs were written before the rename
    return config
"""


@pytest.mark.parametrize("old, new", [("horizon.rounds", "horizon_schedule.horizons"), ("horizon.schedule", "horizon_schedule.kind"),
                                      ("sft.max_turns", "sft.horizon")])
def test_an_old_key_is_refused_in_one_line_naming_the_new_one(tmp_path, old, new):
    value = "(1,2)" if old == "horizon.rounds" else "fixed" if old == "horizon.schedule" else "5"
    override = [sys.executable, "-m", "agentgym_jax.launch", "--config=configs/quickstart.py", f"--config.{old}={value}"]
    (tmp_path / "old.py").write_text(OLD_CONFIG)
    old_file = [sys.executable, "-m", "agentgym_jax.launch", f"--config={tmp_path / 'old.py'}"]
    for command, key, renamed in ((override, old, new), (old_file, "horizon.rounds", "horizon_schedule.horizons")):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert done.stderr.strip().splitlines() == [f"config error: config key {key!r} is now {renamed!r}"]


def _documented_estimator() -> tuple[str, str]:
    """The new estimator's file and registry entry, as docs/algorithms.md shows them."""
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = page.split("## Adding an advantage estimator", 1)[1].split("\n## ", 1)[0]
    module, entry = re.findall(r"```python\n(.*?)```", section, re.S)
    return module, entry


def test_the_documented_new_estimator_is_one_file_one_entry_and_its_config_key(monkeypatch):
    """docs/algorithms.md's example, run as written: its file, its registry entry, its config key,
    through the settings and the jitted `prepare`, against the formula it states."""
    from test_train_steps import MODEL as STEP_MODEL, _batch, _state

    from agentgym_jax.config import load_config_file
    from agentgym_jax.rl import advantages
    from agentgym_jax.train import steps

    module, entry = _documented_estimator()
    namespace: dict = {}
    exec(compile(module, "batch_mean.py", "exec"), namespace)  # noqa: S102  (the page's file)
    name, spec = next(iter(eval("{" + entry + "}", {**namespace, "Estimator": advantages.Estimator}).items()))  # noqa: S307
    monkeypatch.setitem(advantages.ADVANTAGE_ESTIMATORS, name, spec)
    config = load_config_file("configs/quickstart.py")
    config.algo.scale = 0.5  # the config key the page adds
    config.algo.advantage, config.algo.kl_coef = name, 0.0
    update = settings.update(config, STEP_MODEL, objective="rl")
    assert update.rl.advantage_hparams == (("scale", 0.5),) and not settings.batch_filter(config).grouped
    batch, state = _batch(), _state()
    rl_batch, _ = jax.jit(steps.prepare, static_argnames="config")(state.params, state.params, batch, config=update)
    scores, mask = np.asarray(batch.scores, np.float64), np.asarray(batch.loss_mask) > 0
    want = np.where(mask, 0.5 * (scores - scores.mean())[:, None], 0.0)  # every row trains a token here
    np.testing.assert_allclose(np.asarray(rl_batch.advantages), want, rtol=1e-5, atol=1e-6)
    config.algo.scale = -1.0
    with pytest.raises(ConfigError, match="scale must be > 0, got -1.0"):
        settings.update(config, MODEL, objective="rl")


def test_a_job_without_held_out_tasks_is_refused_before_it_trains():
    config = quickstart.get_config()
    config.eval.num_tasks = 0
    with pytest.raises(ConfigError, match="eval.num_tasks must be >= 1"):
        play.HeldOut.of(config, None, None, None)


def test_a_job_finds_its_servers_by_the_configs_name_for_the_environment():
    """`env.name=module:Class` starts servers under that name; the server calls itself by its own."""
    info = TaskInfo(env="ragged", instruction="", success_threshold=1.0, splits={"train": [0], "test": []}, num_tasks=1)
    config = quickstart.get_config()
    job = setup.Job(None, None, None, config.env, {"bench.ragged_env:RaggedLengthEnv": ["http://127.0.0.1:1"]},
                    {"bench.ragged_env:RaggedLengthEnv": info})
    assert job.pool().urls == ["http://127.0.0.1:1"]
    two = dataclasses.replace(job, infos={**job.infos, "room": info}, urls={**job.urls, "room": []})
    with pytest.raises(ValueError, match="the job has 2 environments"):
        two.pool()


def _rl_recipes() -> list[str]:
    """Every `configs/<file>[:<arg>]` a docstring or README names that runs `mode=rl`."""
    from configs import cpu, smollm

    return ["quickstart", "quickstart_async", "textcraft_grpo", "babyai_scalinginter", "agent_movie", "agent_movie:engine",
             *(f"{env}_cpu" for env in ("maze", "textcraft", "babyai", "wordle", "guess_the_number", "movie", "search", "sql")),
             *(f"{env}_smollm" for env in ("textcraft", "babyai", "maze", "wordle")),
             *(f"cpu:{env}" for env in cpu.RECIPES), *(f"smollm:{env}" for env in smollm.RECIPES),
             *(f"smollm:{env}_replay" for env in smollm.REPLAY)]


@pytest.mark.parametrize("recipe", _rl_recipes())
def test_every_rl_recipe_cuts_its_step_into_its_micro_batches(recipe):
    """A recipe's own step (its tasks x samples, or its groups when packed) divides into its mini-
    and micro-batches on one device: what the job checks when it opens, here without a model."""
    name, _, arg = recipe.partition(":")
    config = importlib.import_module(f"configs.{name}").get_config(arg)
    assert config.mode == "rl"
    update = settings.update(config, MODEL, objective="rl")
    settings.check_step_rows(config, update, lambda rows: rows)
