"""The training config read into typed settings, each section in one place.

`rl/` holds the pure pieces (estimators and losses in registries with their hyper-parameters,
schedules, curricula) and knows nothing of configs. Here `config.algo` becomes the update's
`Forward`, `Batching` and `RLSpec` (`train/steps.py`) and the `BatchFilter`; `config.horizon_schedule` and
`config.curriculum` their schedules; `config.optim` each phase's optimizer settings; `config.rollout`'s
asynchronous keys `rl_episodes.AsyncSettings`. Fields are
read by name, so a config key is the field it sets (`algo.<field>`, and `algo.<hparam>` for each
hyper-parameter the chosen estimator or loss declares); 0 sets an optional value to "off" (its
function's default). A bad value is a one-line `ConfigError` naming it (architecture rule 6).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_collections

from agentgym_jax.config import ConfigError
from agentgym_jax.job import settings as job_settings
from agentgym_jax.models.config import ModelConfig, load_config
from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from agentgym_jax.rl.curriculum import Curriculum
from agentgym_jax.rl.horizon import HORIZON_SCHEDULES, HorizonSchedule
from agentgym_jax.rl.losses import POLICY_LOSSES
from agentgym_jax.rollout.rl_batch import BatchFilter
from agentgym_jax.train import rl_episodes
from agentgym_jax.train.scoring import Forward
from agentgym_jax.train.steps import Batching, DPOSpec, RLSpec, UpdateConfig, check_microbatches

# Hyper-parameters whose config key is not their name (a bare `epsilon` would say nothing of which).
CONFIG_KEYS = {"epsilon": "advantage_epsilon"}
# Optional values a config turns off (leaves at the function's default) with 0.
ZERO_IS_UNSET = {"advantage_epsilon", "dual_clip_c", "loss_norm_length"}


def _value(section: Mapping[str, Any], key: str) -> Any:
    value = section[key]
    return None if key in ZERO_IS_UNSET and not value else value


def _by_field(cls: type, section: Mapping[str, Any], **given: Any) -> Any:
    """`cls` with every field the section has a key for (besides `given`), or a `ConfigError`."""
    values = {f.name: _value(section, f.name) for f in dataclasses.fields(cls) if f.name in section and f.name not in given}
    try:
        return cls(**values, **given)
    except ValueError as e:
        raise ConfigError(f"config.algo: {e}") from e


def _hparams(algo: Mapping[str, Any], owner: str, declared: Sequence[str], registry: Iterable) -> dict[str, Any]:
    """The hyper-parameters `owner` declares, read from `algo.<key>` (unset where 0 means off); an
    optional key set for an owner that does not read it is refused (it would silently do nothing)."""
    hparams = {}
    for name in declared:
        key = CONFIG_KEYS.get(name, name)
        if key in algo and (value := _value(algo, key)) is not None:
            hparams[name] = value
    others = {CONFIG_KEYS.get(h, h) for entry in registry for h in entry.hparams} - {CONFIG_KEYS.get(h, h) for h in declared}
    for key in sorted(others & ZERO_IS_UNSET):
        if algo.get(key):
            raise ConfigError(f"config.algo: {key} is not used by {owner}; leave it unset (0)")
    return hparams


def forward_pass(config: ml_collections.ConfigDict, model: ModelConfig) -> Forward:
    """How the trainer runs `model`: `config.model`'s compute dtype, remat, log-prob chunk, attention
    kernels, LoRA scale and a mixture of experts' load-balancing weight (`router_aux_coef`)."""
    try:
        return Forward(model, compute_dtype=config.model.compute_dtype, remat=config.model.remat,
                       logprob_chunk=config.model.logprob_chunk, logprobs_at=config.model.get("logprobs_at", "all"),
                       kernels=job_settings.attention_kernels(config), lora_scale=job_settings.tuning(config).lora_scale,
                       router_aux_coef=config.model.get("router_aux_coef", 0.0))
    except ValueError as e:
        raise ConfigError(f"config.model: {e}") from e


def batching(config: ml_collections.ConfigDict) -> Batching:
    """`config.algo`'s epochs, mini- and micro-batches, length buckets and loss aggregation."""
    return _by_field(Batching, config.algo)


def rl(config: ml_collections.ConfigDict) -> RLSpec:
    """`config.algo`'s RL objective at the rollout's temperature (`rl_temperature`)."""
    a = config.algo
    if a.advantage not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"config.algo: advantage={a.advantage!r} is not one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    if a.policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"config.algo: policy_loss={a.policy_loss!r} is not one of {', '.join(POLICY_LOSSES)}")
    return _by_field(
        RLSpec, a,
        advantage_hparams=_hparams(a, a.advantage, ADVANTAGE_ESTIMATORS[a.advantage].hparams, ADVANTAGE_ESTIMATORS.values()),
        loss_hparams=_hparams(a, a.policy_loss, POLICY_LOSSES[a.policy_loss].hparams, POLICY_LOSSES.values()),
        critic_model=load_config(a.critic_dir) if a.critic_dir else None,
        temperature=rl_temperature(config),
    )


OBJECTIVES = ("sft", "rl", "dpo")


def update(config: ml_collections.ConfigDict, model: ModelConfig, objective: str = "sft") -> UpdateConfig:
    """The update of `model` the config describes, for behaviour cloning (`"sft"`: mode=sft,
    AgentEvol), or also RL's objective (`"rl"`, whose warm start clones too) or DPO's (`"dpo"`)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}")
    return UpdateConfig(forward_pass(config, model), batching(config), rl(config) if objective == "rl" else None,
                        dpo(config) if objective == "dpo" else None)


def dpo(config: ml_collections.ConfigDict) -> DPOSpec:
    """`config.dpo` (`beta`)."""
    try:
        return DPOSpec(beta=config.dpo.beta)
    except ValueError as e:
        raise ConfigError(f"config.dpo: {e}") from e


def rl_temperature(config: ml_collections.ConfigDict) -> float:
    """The temperature the RL trainer applies to its logits: the rollout's, which must sample the
    whole distribution (the trainer cannot reproduce top-k / top-p filtering, nor learn from
    greedy samples)."""
    r = config.rollout
    if r.temperature <= 0:
        raise ConfigError(f"RL needs rollout.temperature > 0 (0 is greedy decoding), got {r.temperature}")
    if r.top_k != 0 or r.top_p != 1.0:
        raise ConfigError(
            f"RL samples must come from the full distribution the trainer computes: rollout.top_k must be 0 "
            f"and rollout.top_p 1.0 (off), got top_k={r.top_k}, top_p={r.top_p}"
        )
    return float(r.temperature)


def async_rollout(config: ml_collections.ConfigDict, corrects_off_policy: bool) -> rl_episodes.AsyncSettings:
    """`rollout.max_staleness`, `stale_groups`, `lock_step`; a one-line error for what cannot run."""
    r = config.rollout
    k, stale = r.get("max_staleness", 0), r.get("stale_groups", "drop")
    if not isinstance(k, int) or k < 0:
        raise ConfigError(f"rollout.max_staleness must be an integer >= 0 (0: synchronous), got {k!r}")
    if stale not in rl_episodes.STALE_GROUPS:
        raise ConfigError(f"rollout.stale_groups must be one of {', '.join(rl_episodes.STALE_GROUPS)}, got {stale!r}")
    if k and not r.num_slots and not config.env.get("agent", ""):  # an agent's episodes stream through the gateway
        raise ConfigError("rollout.max_staleness > 0 streams episodes through continuous batching: set rollout.num_slots > 0")
    if k and not corrects_off_policy:
        raise ConfigError("rollout.max_staleness > 0 samples with older weights than the update's: set "
                          "algo.decoupled_ppo=True (or algo.is_correction=token|sequence) to correct for them")
    return rl_episodes.AsyncSettings(k, stale, bool(r.lock_step))


def batch_filter(config: ml_collections.ConfigDict) -> BatchFilter:
    """Which rollout episodes train (`rollout/rl_batch.py`), from `config.algo` and the token budget."""
    grouped = ADVANTAGE_ESTIMATORS[config.algo.advantage].needs_groups
    return _by_field(BatchFilter, config.algo, grouped=grouped, max_response_length=config.rollout.max_response_length)


def optim(config: ml_collections.ConfigDict, total_updates: int, lr: float | None = None) -> ml_collections.ConfigDict:
    """`config.optim` with the schedule length (and optionally the learning rate) of one training phase."""
    out = ml_collections.ConfigDict(config.optim.to_dict())
    out.total_updates = total_updates
    if lr is not None:
        out.lr = lr
    return out


def rl_optim(config: ml_collections.ConfigDict, updates_per_step: int, lr: float | None = None) -> ml_collections.ConfigDict:
    """The RL phase's optimizer settings: its schedule (warm-up and decay) counts optimizer updates,
    `updates_per_step` (ppo_epochs x num_minibatches) per RL step, over `train.steps` steps."""
    return optim(config, config.train.steps * updates_per_step, lr)


def horizon_schedule(section: Mapping[str, Any]) -> HorizonSchedule:
    """`config.horizon_schedule`: `{"kind": "fixed", "horizons": 10}` or `{"kind": "stepwise",
    "horizons": [10, 20, 30], "steps_per_stage": 100}` (a dict or a ConfigDict)."""
    params = dict(section.items())
    kind = params.pop("kind", None)
    if kind not in HORIZON_SCHEDULES:
        raise ConfigError(f"unknown horizon schedule {kind!r}; valid: {', '.join(HORIZON_SCHEDULES)}")
    builder = HORIZON_SCHEDULES[kind]
    valid = inspect.signature(builder).parameters
    if unknown := sorted(set(params) - set(valid)):
        raise ConfigError(f"horizon schedule {kind!r} takes no {unknown}; valid: {sorted(valid)}")
    if "horizons" not in params:
        raise ConfigError(f"horizon schedule {kind!r} needs 'horizons'")
    try:
        return builder(**params)
    except ValueError as e:
        raise ConfigError(f"horizon_schedule: {e}") from e


def curriculum(section: Mapping[str, Any]) -> Curriculum:
    """`config.curriculum` (`key`, `max_grades`, `steps_per_stage`)."""
    params = dict(section.items())
    params["max_grades"] = tuple(params.get("max_grades") or ())
    try:
        return Curriculum(**params)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_curriculum(plan: Curriculum, train_ids: Sequence[int], metadata: Mapping[str, Any]) -> None:
    """Refuses, when the job opens, a key the environment does not grade by or a stage with no task."""
    try:
        plan.check(train_ids, metadata)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def rows_per_episode(config: ml_collections.ConfigDict) -> int:
    """Training rows an episode may bring: `env.agent_conversations` for an agent program's, else one."""
    if not config.env.get("agent", ""):
        return 1
    n = config.env.get("agent_conversations", 1)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"env.agent_conversations must be an integer >= 1, got {n!r}")
    return n


def check_step_rows(config: ml_collections.ConfigDict, update: UpdateConfig, padded_rows: Callable[[int], int]) -> None:
    """Refuses, when the job opens, a step's batch (`rollout.batch_tasks x rollout.group_size`
    rows of `rows_per_episode` each, padded over the mesh; with `algo.shared_prefix`, its
    `rollout.batch_tasks` groups) that the update cannot cut into its mini- and micro-batches,
    which the first update would otherwise find after SFT and the first rollout."""
    groups = config.rollout.batch_tasks
    per_group = config.rollout.group_size * rows_per_episode(config)
    rows = padded_rows(groups if update.batching.shared_prefix else groups * per_group)
    try:
        check_microbatches(rows, update)
    except ValueError as e:
        units = "rollout.batch_tasks groups (algo.shared_prefix)" if update.batching.shared_prefix else \
            "rollout.batch_tasks x rollout.group_size"
        raise ConfigError(f"{e} ({units}, algo.num_minibatches x algo.num_microbatches)") from e
