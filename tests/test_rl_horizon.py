"""Horizon schedules: boundary steps, the resume contract, config building and bad input."""

import ml_collections
import pytest

from agentgym_jax.config import ConfigError
from agentgym_jax.rl import horizon
from agentgym_jax.train import settings


def test_stepwise_boundaries():
    schedule = horizon.stepwise(horizons=[10, 20, 30], steps_per_stage=100)
    want = {0: 10, 1: 10, 99: 10, 100: 20, 101: 20, 199: 20, 200: 30, 299: 30, 10**6: 30}
    assert {step: schedule.horizon(step) for step in want} == want
    stages = {0: 0, 99: 0, 100: 1, 199: 1, 200: 2, 10**6: 2}
    assert {step: schedule.stage(step) for step in stages} == stages


def test_fixed_is_constant():
    schedule = horizon.fixed(15)
    assert {schedule.horizon(s) for s in (0, 1, 99, 100, 12345)} == {15}
    assert {schedule.stage(s) for s in (0, 100, 12345)} == {0}


def run_steps(schedule_config, first_step, last_step):
    """What a training run does: build the schedule from the config, ask each step's horizon."""
    schedule = settings.horizon_schedule(schedule_config)
    return {step: schedule.horizon(step) for step in range(first_step, last_step)}


def test_resumed_run_has_the_uninterrupted_horizons():
    """A run killed after 100 updates resumes at step 100 (the checkpoint's count of updates done)
    with a freshly built schedule. Every step must get the horizon of the uninterrupted run; in
    AgentGym-RL steps 102-200 of such a resume ran with 30 turns instead of 20."""
    config = {"kind": "stepwise", "horizons": [10, 20, 30], "steps_per_stage": 100}
    uninterrupted = run_steps(config, 0, 300)
    first_part = run_steps(config, 0, 100)
    resumed = run_steps(config, 100, 300)
    assert {**first_part, **resumed} == uninterrupted
    assert [resumed[s] for s in (100, 101, 102, 199, 200)] == [20, 20, 20, 20, 30]
    # Interrupted again mid-stage, and asked out of order: still a function of the step alone.
    assert run_steps(config, 150, 160) == {s: 20 for s in range(150, 160)}
    schedule = settings.horizon_schedule(config)
    assert [schedule.horizon(s) for s in (250, 5, 150, 99, 100)] == [30, 10, 20, 10, 20]


def test_from_config_accepts_dicts_and_config_dicts():
    config = ml_collections.ConfigDict(
        {"kind": "stepwise", "horizons": (5, 8), "steps_per_stage": 3}
    )
    assert settings.horizon_schedule(config) == horizon.stepwise((5, 8), 3)
    assert settings.horizon_schedule({"kind": "fixed", "horizons": 12}) == horizon.fixed(12)
    assert settings.horizon_schedule({"kind": "stepwise", "horizons": [1, 2, 3]}).steps_per_stage == 100


def test_fixed_on_a_stepwise_config_is_its_final_horizon():
    """ScalingInter-RL's baseline is one flag: `--config.horizon_schedule.kind=fixed` keeps the config's
    horizons and stage length and trains at the last horizon from the first step."""
    from tests.test_rl_config import parse

    schedule = settings.horizon_schedule(parse("--config.horizon_schedule.kind=fixed").horizon_schedule)
    assert schedule == horizon.fixed(12) and [schedule.horizon(s) for s in (0, 8, 23)] == [12, 12, 12]
    assert settings.horizon_schedule({"kind": "fixed", "horizons": (4, 8), "steps_per_stage": 5}) == horizon.fixed(8)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"kind": "linear", "horizons": 3}, "unknown horizon schedule 'linear'; valid: fixed"),
        ({"horizons": 3}, "unknown horizon schedule None"),
        ({"kind": "fixed", "horizons": []}, "horizons must be positive integers"),
        ({"kind": "fixed", "horizons": 3, "step_per_stage": 5}, r"no \['step_per_stage'\]"),
        ({"kind": "stepwise", "horizon": [10]}, r"takes no \['horizon'\]"),
        ({"kind": "stepwise"}, "needs 'horizons'"),
        ({"kind": "stepwise", "horizons": []}, "horizons must be positive integers"),
        ({"kind": "stepwise", "horizons": [10, 0]}, "horizons must be positive integers"),
        ({"kind": "fixed", "horizons": 2.5}, "horizons must be positive integers"),
        ({"kind": "stepwise", "horizons": [1], "steps_per_stage": 0}, "steps_per_stage must be"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        settings.horizon_schedule(config)


def test_bad_steps_are_refused():
    schedule = horizon.stepwise()
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        schedule.horizon(-1)
    with pytest.raises(TypeError):
        schedule.stage(1.5)
