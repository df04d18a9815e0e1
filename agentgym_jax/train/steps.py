"""Jitted, pure update steps: the PPO-family RL update, the SFT step and the DPO step, all on one
micro-batched update path (`accumulated_update`).

An `UpdateConfig` has typed parts, each read from its own config section by `train/settings.py`:
`Forward` (how the model runs: dtype, remat, where and how many positions project to the
vocabulary, kernels, LoRA scale; `train/scoring.py`, which every loss reads), `Batching`
(epochs, mini- and micro-batches, length buckets, loss aggregation), and the objective besides
behaviour cloning: `RLSpec` (estimator and policy loss from the `rl/` registries with their
declared hyper-parameters, KL, entropy, value model, temperature, correction) or `DPOSpec`.

`prepare` turns a `TokenBatch` of trajectories into an `RLBatch` (trainer log-probs of the
sampled tokens, reference log-probs, critic values, advantages, returns) once per rollout batch;
`rl_update` then runs `ppo_epochs` epochs over shuffled mini-batches, each mini-batch one
optimizer update whose gradient is accumulated (in float32) over micro-batches. Micro-batch
losses are weighted by their share of the mini-batch's tokens (or sequences, for the seq-mean
modes), so accumulation gives exactly the gradient of the whole mini-batch. An update whose loss
or gradient is not finite is skipped and counted (`TrainState.apply_gradients`).

A batch is plain rows or rows packed as prefix trees (`rollout/packing.py`: a group's shared
prompt computed once, forward and backward); either way it is cut into parts of whole units
(`train/microbatch.py`), so a group's rows stay in one micro-batch.

Memory does not grow with the batch, seq x vocab or seq x seq: `prepare` scores the batch one
micro-batch at a time (the update's micro-batch size), log-probs and entropies are computed a
chunk of `logprob_chunk` positions at a time (the [rows, seq, vocab] logits never exist, in the
backward pass neither), attention is blockwise (`decoder.flash_attention`), and `remat` picks
what each layer keeps for the backward pass.

`make_step_fns` jits the steps once per run: plainly on one device, or over a mesh with
explicit in/out shardings (`train_state_shardings` for the state, batch rows over
("data", "fsdp"), metrics replicated).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax.models import tuning
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.parallel.mesh import BATCH_AXES
from agentgym_jax.parallel.partition import DEFAULT_RULES, Rules, batch_sharding, param_shardings
from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS, Estimator, compute_advantages
from agentgym_jax.rl.correction import IS_LEVELS, importance_weights
from agentgym_jax.rl.dpo import dpo_loss
from agentgym_jax.rl.kl import KL_ESTIMATORS, apply_kl_penalty, kl_loss
from agentgym_jax.rl.losses import POLICY_LOSSES, PolicyLoss, value_loss
from agentgym_jax.rl.masked import LOSS_AGG_MODES, aggregate_loss, masked_count, masked_mean
from agentgym_jax.rollout.batch import PackedRows, TokenBatch
from agentgym_jax.train import microbatch
from agentgym_jax.train.scoring import Forward, critic_values, score
from agentgym_jax.train.state import TrainState

Metrics = dict[str, jax.Array]


# Off-policy corrections of trainer vs sampler log-probs (`rl/correction.py`): none, truncated IS.
IS_CORRECTIONS = ("none", *IS_LEVELS)
# GAE's value model: a head on the policy's trunk (one optimizer), or a separate model with its
# own parameters and optimizer (a second TrainState; verl's default).
CRITICS = ("shared", "separate")
Hparams = tuple[tuple[str, Any], ...]  # (name, value) pairs, sorted: hashable keyword arguments


def _one_of(owner: Any, name: str, valid) -> None:
    if getattr(owner, name) not in valid:
        raise ValueError(f"{name}={getattr(owner, name)!r} is not one of {', '.join(map(str, valid))}")


def _at_least(bound: float, strict: bool, **values) -> None:
    for name, value in values.items():
        if value is not None and (value < bound or (strict and value == bound)):
            raise ValueError(f"{name} must be {'>' if strict else '>='} {bound}, got {value}")


def _hparams(value: Mapping[str, Any] | Hparams) -> Hparams:
    return tuple(sorted(dict(value).items()))


@dataclasses.dataclass(frozen=True)
class Batching:
    """How an update cuts its batch (epochs, mini-batches, micro-batches, lengths) and sums the
    per-token losses into one number (`agg_mode`, which also weighs the micro-batches)."""

    ppo_epochs: int = 1  # passes over an RL batch (SFT and DPO: one)
    num_minibatches: int = 1  # optimizer updates per epoch
    num_microbatches: int = 1  # gradient-accumulation chunks per mini-batch
    length_buckets: int = 1  # > 1: micro-batches grouped by length, each run at its own (`length_buckets()`)
    length_spacing: str = "halving"  # those lengths: the full one and its halvings, or evenly spaced ("even")
    shared_prefix: bool = False  # each group's rows packed as one prefix tree (`rollout/packing.py`), cut by units
    agg_mode: str = "token-mean"  # one of rl.masked.LOSS_AGG_MODES
    loss_norm_length: int | None = None  # the constant of agg_mode "seq-mean-token-sum-norm"

    def __post_init__(self):
        _one_of(self, "agg_mode", LOSS_AGG_MODES)
        _one_of(self, "length_spacing", microbatch.LENGTH_SPACINGS)
        _at_least(1, False, ppo_epochs=self.ppo_epochs, num_minibatches=self.num_minibatches,
                  num_microbatches=self.num_microbatches, length_buckets=self.length_buckets)
        _at_least(0, True, loss_norm_length=self.loss_norm_length)
        if self.agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ValueError("agg_mode 'seq-mean-token-sum-norm' needs loss_norm_length (e.g. max_response_length)")

    def run_lengths(self, full: int) -> tuple[int, ...]:
        """The lengths a part of a batch `full` positions wide may run at (`microbatch.at_length`)."""
        return microbatch.length_buckets(full, self.length_buckets, spacing=self.length_spacing)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates of one `rl_update`: what learning-rate schedules count."""
        return self.ppo_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class RLSpec:
    """The RL objective: advantage estimator and policy loss (registries in `rl/`, each with its
    declared hyper-parameters), KL to the reference, entropy, the value model, the sampling
    temperature and the off-policy correction. A bad value raises `ValueError` naming it."""

    advantage: str = "grpo"  # a key of rl.advantages.ADVANTAGE_ESTIMATORS
    advantage_hparams: Hparams = ()  # of those the estimator declares; unset ones take its defaults
    policy_loss: str = "ppo"  # a key of rl.losses.POLICY_LOSSES
    loss_hparams: Hparams = ()  # of those the loss declares (PPO: clip_eps_low, clip_eps_high, dual_clip_c)
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    kl_in_reward: bool = False  # False: KL is a loss term (GRPO); True: a reward penalty (PPO)
    entropy_coef: float = 0.0
    vf_coef: float = 0.5  # weight of the value loss in the shared-trunk loss
    clip_eps_value: float = 0.5
    critic: str = "shared"  # one of CRITICS (estimators that need a critic only)
    critic_model: ModelConfig | None = None  # the separate critic's architecture; None: the policy's
    temperature: float = 1.0  # the sampling temperature: RL log-probs are of logits / temperature
    is_correction: str = "none"  # truncated importance sampling: one of IS_CORRECTIONS
    decoupled_ppo: bool = False  # behaviour = sampler log-probs, proximal = recomputed old log-probs
    is_cap: float = 2.0  # truncation (TIS) or drop (decoupled PPO) threshold of the weights

    def __post_init__(self):
        object.__setattr__(self, "advantage_hparams", _hparams(self.advantage_hparams))
        object.__setattr__(self, "loss_hparams", _hparams(self.loss_hparams))
        _one_of(self, "advantage", ADVANTAGE_ESTIMATORS)
        _one_of(self, "policy_loss", POLICY_LOSSES)
        _one_of(self, "kl_estimator", KL_ESTIMATORS)
        _one_of(self, "is_correction", IS_CORRECTIONS)
        _one_of(self, "critic", CRITICS)
        _at_least(0, False, kl_coef=self.kl_coef, vf_coef=self.vf_coef, clip_eps_value=self.clip_eps_value)
        _at_least(0, True, temperature=self.temperature, is_cap=self.is_cap)
        if self.decoupled_ppo and self.is_correction != "none":
            raise ValueError(f"decoupled_ppo weights the loss already; is_correction must be 'none', got {self.is_correction!r}")
        for owner, declared, given in (("advantage " + self.advantage, self.estimator.hparams, self.advantage_hparams),
                                       ("policy_loss " + self.policy_loss, self.loss.hparams, self.loss_hparams)):
            if unknown := sorted(set(dict(given)) - set(declared)):
                raise ValueError(f"{owner} takes no {unknown}; valid: {sorted(declared)}")
        self._check_hparams()

    def _check_hparams(self) -> None:
        """The estimator and loss refuse their own bad hyper-parameters (`rl.masked.check_hparams`):
        traced once on abstract [1, 2] rows, so a bad value stops the job before any work."""
        row = jax.ShapeDtypeStruct((1, 2), jnp.float32)
        mask = jax.ShapeDtypeStruct((1, 2), jnp.bool_)
        jax.eval_shape(lambda r, m, v, g, s: compute_advantages(self.advantage, token_rewards=r, loss_mask=m, values=v,
                                                                 group_ids=g, step_groups=s, **dict(self.advantage_hparams)),
                       row, mask, row, jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 2), jnp.int32))
        jax.eval_shape(lambda lp, m: self.loss.fn(lp, lp, lp, m, agg_mode="token-mean", **dict(self.loss_hparams)), row, mask)

    @property
    def estimator(self) -> Estimator:
        return ADVANTAGE_ESTIMATORS[self.advantage]

    @property
    def loss(self) -> PolicyLoss:
        return POLICY_LOSSES[self.policy_loss]

    @property
    def uses_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def shared_value_head(self) -> bool:
        """The policy params carry the value head and `rl_loss` trains it."""
        return self.uses_critic and self.critic == "shared"

    @property
    def separate_critic(self) -> bool:
        """Values come from a separate critic model trained by `critic_update`."""
        return self.uses_critic and self.critic == "separate"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def corrects_off_policy(self) -> bool:
        return self.decoupled_ppo or self.is_correction != "none"


@dataclasses.dataclass(frozen=True)
class DPOSpec:
    """Direct Preference Optimization (`rl/dpo.py`): `beta`, the temperature of the implicit reward."""

    beta: float = 0.1

    def __post_init__(self):
        _at_least(0, True, beta=self.beta)


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """One update: the forward pass, the batching, and the objective besides behaviour cloning
    (which every config has: SFT), RL's or DPO's; hashable, so it is a static argument of the
    jitted steps."""

    forward: Forward
    batching: Batching = Batching()
    rl: RLSpec | None = None
    dpo: DPOSpec | None = None

    def __post_init__(self):
        if self.rl is not None and self.dpo is not None:
            raise ValueError("an update has one objective besides behaviour cloning: rl or dpo, not both")

    @property
    def scores_policy(self) -> bool:
        """Whether `prepare` runs the trainer's policy over the batch. It need not when the batch
        makes one optimizer update and nothing reads the old log-probs before it (no value model,
        off-policy correction or KL penalty in the reward): the update's own log-probs, gradient
        stopped, are then the old ones (ratio 1, the same gradient), which saves a forward pass
        over every rollout. A KL term in the loss still needs the reference's pass."""
        rl, batching = self.rl, self.batching
        return (batching.updates_per_step > 1 or rl.uses_critic or rl.corrects_off_policy
                or (rl.uses_reference and rl.kl_in_reward))

    @property
    def scores_rollouts(self) -> bool:
        """Whether `prepare` runs any model over the batch: the policy's pass, the reference's, or both."""
        return self.scores_policy or self.rl.uses_reference


@flax.struct.dataclass
class RLBatch:
    tokens: jax.Array  # [batch, seq] int32
    positions: jax.Array  # [batch, seq] int32; -1 on padding
    loss_mask: jax.Array  # [batch, seq] float32
    old_logprobs: jax.Array  # [batch, seq] trainer log-probs under the params that sampled
    ref_logprobs: jax.Array  # [batch, seq]
    old_values: jax.Array  # [batch, seq]; zeros without a critic
    advantages: jax.Array  # [batch, seq]
    returns: jax.Array  # [batch, seq]
    is_weights: jax.Array  # [batch, seq] off-policy weights of each token's loss; ones when off
    layout: PackedRows | None = None  # the rows packed as prefix trees (the `TokenBatch`'s); None: plain rows
    # [batch, seq, layers, k] the sampler's routing (the `TokenBatch`'s) where the update's forward
    # pass compares it (no scoring pass: `prepare` compared it); else None
    experts: jax.Array | None = None


def prepare(
    params: Any, ref_params: Any, batch: TokenBatch, critic_params: Any = None, *, config: UpdateConfig
) -> tuple[RLBatch, Metrics]:
    """Scores a rollout batch with the current and the reference policy and computes advantages.

    The forward passes run one micro-batch at a time, micro-batches of the update's size
    (`num_minibatches x num_microbatches` parts), like the update's: grouped by length and each
    cut to its own with `length_buckets > 1`, and skipped where no row trains a token.
    `batch.old_logprobs` are the sampler's: they feed `logprob_gap` and the importance weights;
    the PPO ratio is taken against the trainer's recomputed log-probs. `critic_params`: the
    separate critic's (`config.rl.separate_critic`), else None. Where nothing reads the policy's
    pass before the update (`UpdateConfig.scores_policy`), only the reference's runs, or none
    (advantages only). Where the batch holds the sampler's experts (`TokenBatch.experts`),
    `routing_mismatch` is the share of (policy token, layer) pairs the trainer routes to another
    expert set (from the update's forward pass where the policy's pass does not run).
    """
    rl = config.rl
    if rl.separate_critic != (critic_params is not None):
        raise ValueError(f"critic={rl.critic!r} with advantage={rl.advantage!r}: critic_params must be "
                         f"{'given' if rl.separate_critic else 'None'}")
    mask = batch.loss_mask
    check_microbatches(batch, config)
    if config.scores_rollouts:
        old_logprobs, values, ref_logprobs, is_weights, score_metrics = _score_rollouts(
            (params, ref_params, critic_params), batch, config)
    else:  # `rl_loss` takes the update's own log-probs, gradient stopped, as the old ones
        old_logprobs = ref_logprobs = batch.old_logprobs
        values, is_weights, score_metrics = jnp.zeros_like(mask), jnp.ones_like(mask), {}
    rewards = batch.token_rewards
    if rl.kl_in_reward:
        rewards, _ = apply_kl_penalty(rewards, old_logprobs, ref_logprobs, mask, kl_coef=rl.kl_coef, estimator=rl.kl_estimator)
    advantages, returns = compute_advantages(
        rl.advantage,
        token_rewards=rewards,
        loss_mask=mask,
        values=values if rl.uses_critic else None,
        group_ids=batch.group_ids,
        step_groups=batch.step_groups,
        **dict(rl.advantage_hparams),
    )
    metrics = {**score_metrics, **_advantage_metrics(advantages, mask)}
    rl_batch = RLBatch(
        tokens=batch.tokens,
        positions=batch.positions,
        loss_mask=mask,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        old_values=values,
        advantages=advantages,
        returns=returns,
        is_weights=is_weights,
        layout=batch.layout,
        experts=None if config.scores_policy else batch.experts,
    )
    return rl_batch, metrics


def _score_rollouts(all_params: tuple[Any, Any, Any], batch: TokenBatch,
                    config: UpdateConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Metrics]:
    """`prepare`'s scoring pass: trainer and reference log-probs and values of every row, the
    importance weights of trainer vs sampler, and their metrics."""
    rl, forward, batching, mask = config.rl, config.forward, config.batching, batch.loss_mask
    compare = batch.experts is not None

    def score_part(all_params: tuple[Any, Any, Any], units: TokenBatch) -> tuple[jax.Array, ...]:
        params, ref_params, critic_params = all_params
        part = microbatch.to_rows(units)
        scored = ()
        if config.scores_policy:
            old_logprobs, entropy, values, *differs = score(params, part, forward, rl.temperature, rl.shared_value_head,
                                                            routing_differs=compare)
            if rl.separate_critic:
                values = critic_values(critic_params, part, forward, rl.critic_model)
            scored = (old_logprobs, entropy, values, *differs)
        ref_logprobs = score(ref_params, part, forward, rl.temperature)[0] if rl.uses_reference else scored[0]
        rows = microbatch.rows_per_unit(units)
        return tuple(x.reshape(-1, rows, x.shape[-1]) if rows > 1 else x for x in (ref_logprobs, *scored))

    parts = batching.num_minibatches * batching.num_microbatches
    units = microbatch.to_units(batch)
    # Parts of like lengths, each scored at its own (units that train nothing: not at all), as the update runs them.
    order = microbatch.length_order(units, parts) if batching.length_buckets > 1 and parts > 1 else None
    ordered = units if order is None else jax.tree.map(lambda x: x[order], units)
    full = microbatch.full_length(batch)
    score_at = microbatch.at_length(score_part, batching.run_lengths(full), per_position=True)
    scored, run_lengths = jax.lax.map(lambda part: score_at(all_params, part), microbatch.split(ordered, parts))
    scored = microbatch.merge(scored)
    if order is not None:
        scored = jax.tree.map(lambda x: x[jnp.argsort(order)], scored)  # back to the batch's unit order
    ref_logprobs, *policy = (x.reshape(mask.shape) for x in scored)
    metrics = {
        "score_length_fraction": jnp.mean(run_lengths) / full,  # of the padded positions, scored
        "score_positions": jnp.sum(run_lengths) * (microbatch.count_units(batch) // parts),  # one policy's pass
    }
    if not config.scores_policy:  # the reference's pass only: `rl_loss` takes its own log-probs as the old ones
        return batch.old_logprobs, jnp.zeros_like(mask), ref_logprobs, jnp.ones_like(mask), metrics
    old_logprobs, entropy, values, *differs = policy
    # Weights of trainer vs sampler: always in the metrics, in the loss only with a correction on.
    is_weights, is_metrics = importance_weights(
        old_logprobs, batch.old_logprobs, mask, level="token" if rl.is_correction == "none" else rl.is_correction,
        cap=rl.is_cap, mode="drop" if rl.decoupled_ppo else "truncate",
    )
    if not rl.corrects_off_policy:
        is_weights = jnp.ones_like(is_weights)
    metrics = {**_rollout_metrics(old_logprobs, batch.old_logprobs, entropy, mask),
               **_routing_metrics(differs, batch, config.forward.model), **is_metrics, **metrics}
    return old_logprobs, values, ref_logprobs, is_weights, metrics


def _rollout_metrics(trainer_logprobs: jax.Array, sampler_logprobs: jax.Array, entropy: jax.Array,
                     mask: jax.Array) -> Metrics:
    # Same tokens, two code paths: a gap here means the sampler and trainer disagree.
    return {"logprob_gap": masked_mean(jnp.abs(sampler_logprobs - trainer_logprobs), mask),
            "entropy_at_rollout": masked_mean(entropy, mask)}


def _routing_metrics(differs: list[jax.Array], batch: TokenBatch | RLBatch, model: ModelConfig) -> Metrics:
    """`routing_mismatch`: the share of (policy token, layer) pairs with a sampler's record whose
    experts the trainer chose otherwise (`differs`: `score`'s last output, or none: no metric)."""
    if not differs:
        return {}
    compared = (batch.loss_mask > 0) & (batch.experts[..., 0, 0] >= 0)
    pairs = jnp.sum(compared) * model.num_layers
    return {"routing_mismatch": jnp.sum(jnp.where(compared, differs[0], 0.0)) / jnp.maximum(pairs, 1)}


def _advantage_metrics(advantages: jax.Array, mask: jax.Array) -> Metrics:
    return {"advantage_mean": masked_mean(advantages, mask), "advantage_abs_mean": masked_mean(jnp.abs(advantages), mask),
            "policy_tokens": masked_count(mask)}


def rl_loss(params: Any, batch: RLBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """The policy loss (`rl.losses.POLICY_LOSSES`) + KL to the reference - entropy bonus + clipped value loss.
    Without the policy's scoring pass (`UpdateConfig.scores_policy`) the batch's old log-probs are
    the sampler's and the loss's own, gradient stopped, stand in for the trainer's."""
    rl, aux = config.rl, int(_router_aux(config))
    logprobs, entropy, values, *extra = score(params, batch, config.forward, rl.temperature, rl.shared_value_head,
                                              bool(aux), batch.experts is not None)
    router, differs = extra[:aux], extra[aux:]
    mask = batch.loss_mask
    old_logprobs, metrics = batch.old_logprobs, {}
    if not config.scores_policy:
        old_logprobs = jax.lax.stop_gradient(logprobs)
        metrics = {**_rollout_metrics(old_logprobs, batch.old_logprobs, jax.lax.stop_gradient(entropy), mask),
                   **_routing_metrics(differs, batch, config.forward.model)}
    agg = dict(agg_mode=config.batching.agg_mode, norm_length=config.batching.loss_norm_length)
    pg_loss, loss_metrics = rl.loss.fn(
        logprobs, old_logprobs, batch.advantages, mask, **agg,
        token_weights=batch.is_weights if rl.corrects_off_policy else None, **dict(rl.loss_hparams),
    )
    metrics = {**metrics, **loss_metrics}
    entropy_loss = aggregate_loss(entropy, mask, **agg)
    loss = pg_loss - rl.entropy_coef * entropy_loss
    metrics = {**metrics, "pg_loss": pg_loss, "entropy": entropy_loss}
    if rl.uses_reference and not rl.kl_in_reward:
        kl = kl_loss(logprobs, batch.ref_logprobs, mask, estimator=rl.kl_estimator, **agg)
        loss = loss + rl.kl_coef * kl
        metrics["kl"] = kl
    loss, metrics = _with_router_aux(loss, metrics, router, config)
    if rl.shared_value_head:
        v_loss, v_metrics = value_loss(values, batch.old_values, batch.returns, mask, **agg, clip_eps_value=rl.clip_eps_value)
        loss = loss + rl.vf_coef * v_loss
        metrics = {**metrics, **v_metrics, "value_loss": v_loss}
    return loss, {**metrics, "loss": loss}


def critic_loss(critic_params: Any, batch: RLBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """The separate critic's clipped value loss (its own optimizer: no `vf_coef`)."""
    values = critic_values(critic_params, batch, config.forward, config.rl.critic_model)
    loss, metrics = value_loss(
        values, batch.old_values, batch.returns, batch.loss_mask, agg_mode=config.batching.agg_mode,
        norm_length=config.batching.loss_norm_length, clip_eps_value=config.rl.clip_eps_value,
    )
    return loss, {**metrics, "value_loss": loss, "loss": loss}


def sft_loss(params: Any, batch: TokenBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """Behaviour cloning: negative log-likelihood of the policy tokens (same masks as RL), of the
    model's own distribution (temperature 1)."""
    logprobs, _, _, *router = score(params, batch, config.forward, router_aux=_router_aux(config))
    nll = aggregate_loss(-logprobs, batch.loss_mask, config.batching.agg_mode, config.batching.loss_norm_length)
    loss, metrics = _with_router_aux(nll, {"nll": nll}, router, config)
    return loss, {**metrics, "loss": loss}


def _router_aux(config: UpdateConfig) -> bool:
    return config.forward.router_aux_coef > 0


def _with_router_aux(loss: jax.Array, metrics: Metrics, router: list, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """`loss` plus the weighted load-balancing loss where the update asks for it (`Forward.router_aux_coef`)."""
    if not router:
        return loss, metrics
    return loss + config.forward.router_aux_coef * router[0], {**metrics, "router_aux_loss": router[0]}


@flax.struct.dataclass
class DPOBatch:
    """Preference pairs: row i of `chosen` and of `rejected` are pair i (`train/dpo_pairs.py`)."""

    chosen: TokenBatch  # [pairs, seq]
    rejected: TokenBatch  # [pairs, seq], the same shape
    chosen_ref_logprobs: jax.Array  # [pairs, seq] frozen reference
    rejected_ref_logprobs: jax.Array  # [pairs, seq]
    layout: PackedRows | None = None  # each pair's two rows (chosen, rejected) packed as one prefix tree
    rows_are_units = True  # a class attribute, not a field: every leaf is per pair already (`microbatch.to_units`)

    # What the micro-batched update reads of a batch, per pair: the tokens a pair trains (the
    # chosen row's, where both rows have one: `rl.dpo.dpo_loss`'s valid pairs) and its length.
    @property
    def loss_mask(self) -> jax.Array:
        valid = jnp.any(self.chosen.loss_mask > 0, axis=-1) & jnp.any(self.rejected.loss_mask > 0, axis=-1)
        return self.chosen.loss_mask * valid[..., None]

    @property
    def positions(self) -> jax.Array:
        return jnp.maximum(self.chosen.positions, self.rejected.positions)

    @property
    def tokens(self) -> jax.Array:
        return self.chosen.tokens


def pair_logprobs(params: Any, chosen: TokenBatch, rejected: TokenBatch, forward: Forward,
                  layout: PackedRows | None = None) -> tuple[jax.Array, jax.Array]:
    """Log-probs of every token of the chosen and rejected rows, each [pairs, seq].

    One forward over the rows of both: half the program of two forwards, so the update compiles
    in about half the time; with `layout`, each pair's rows as one prefix tree (the prompt once).
    """
    pairs = chosen.tokens.shape[0]
    if layout is None:  # [chosen rows, rejected rows]
        logprobs = score(params, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), chosen, rejected), forward)[0]
        return logprobs[:pairs], logprobs[pairs:]
    rows = jax.tree.map(lambda a, b: jnp.stack([a, b], axis=1).reshape(2 * pairs, *a.shape[1:]), chosen, rejected)
    logprobs = score(params, rows.replace(layout=layout), forward)[0].reshape(pairs, 2, -1)  # pair i: rows 2i, 2i + 1
    return logprobs[:, 0], logprobs[:, 1]


def dpo_reference(ref_params: Any, chosen: TokenBatch, rejected: TokenBatch, layout: PackedRows | None = None, *,
                  config: UpdateConfig) -> tuple[jax.Array, jax.Array]:
    """The frozen reference's log-probs of the chosen and rejected rows, each [pairs, seq], one
    micro-batch (of the update's size) at a time, without gradient."""
    parts = config.batching.num_microbatches
    check_microbatches(chosen, _one_minibatch(config))
    scored = jax.lax.map(lambda part: pair_logprobs(ref_params, part[0], part[1], config.forward, part[2]),
                         microbatch.split((chosen, rejected, layout), parts))
    return jax.lax.stop_gradient(microbatch.merge(scored))


def dpo_objective(params: Any, batch: DPOBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """The DPO loss of `rl/dpo.py` under `params` (mean over valid pairs), and its metrics."""
    chosen_logprobs, rejected_logprobs = pair_logprobs(params, batch.chosen, batch.rejected, config.forward, batch.layout)
    loss, metrics = dpo_loss(
        chosen_logprobs, batch.chosen_ref_logprobs, batch.chosen.loss_mask,
        rejected_logprobs, batch.rejected_ref_logprobs, batch.rejected.loss_mask, beta=config.dpo.beta,
    )
    return loss, {**metrics, "loss": loss}


def accumulated_update(
    state: TrainState, batch: Any, loss_fn: Callable, config: UpdateConfig, agg_mode: str | None = None
) -> tuple[TrainState, Metrics]:
    """One optimizer update on `batch`, its gradient accumulated over `num_microbatches` parts of
    its units (rows, or the prefix trees of a packed batch: a group's rows stay together),
    grouped by length and each cut to its own with `length_buckets > 1`; a micro-batch that
    trains no token is not run. Gradients are of `state.params` only (tuned: `state.frozen` is
    merged in for the forward pass and gets none). Micro-batches weigh by their share of the
    batch's loss tokens or rows, as `agg_mode` (default: the batching's) sums the loss.

    The accumulator is float32 whatever the parameters' dtype (bfloat16 sums of many small
    micro-batch gradients lose their low bits); `TrainState.apply_gradients` takes it as is.
    """
    batching = config.batching
    units = microbatch.to_units(batch)
    if batching.length_buckets > 1 and batching.num_microbatches > 1:
        order = microbatch.length_order(units, batching.num_microbatches)
        units = jax.tree.map(lambda x: x[order], units)
    micro = microbatch.split(units, batching.num_microbatches)
    weights = microbatch.share(micro, agg_mode or batching.agg_mode)

    def trainable_loss(params, micro_units):
        policy = tuning.combine(params, state.frozen) if state.frozen else params
        return loss_fn(policy, microbatch.to_rows(micro_units), config=config)

    full = microbatch.full_length(batch)
    grad_fn = microbatch.at_length(jax.value_and_grad(trainable_loss, has_aux=True), batching.run_lengths(full))

    def micro_step(grads, inputs):
        micro_units, weight = inputs
        ((_, metrics), micro_grads), length = grad_fn(state.params, micro_units)
        grads = jax.tree.map(lambda g, m: g + weight * m.astype(jnp.float32), grads, micro_grads)
        return grads, (jax.tree.map(lambda m: weight * m, metrics), length)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    grads, (metrics, run_lengths) = jax.lax.scan(micro_step, zeros, (micro, weights))
    metrics = jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
    metrics["length_fraction"] = jnp.mean(run_lengths) / full  # of the padded positions, computed
    metrics["positions"] = jnp.sum(run_lengths) * micro.loss_mask.shape[1]  # the trunk's positions, all micro-batches
    metrics["grad_norm"] = optax.global_norm(grads)
    empty = jnp.sum(micro.loss_mask) == 0  # e.g. a mini-batch of rows the batch filter masked out
    new_state = state.apply_gradients(grads, loss=metrics["loss"], empty=empty)
    metrics["skipped_update"] = (new_state.skipped_updates - state.skipped_updates).astype(jnp.float32)
    metrics["empty_update"] = empty.astype(jnp.float32)
    return new_state, metrics


def rl_update(state: TrainState, batch: RLBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """`ppo_epochs` x `num_minibatches` optimizer updates over shuffled units (rows, or a packed
    batch's prefix trees) of `batch`."""
    return _epochs(state, batch, rl_loss, config)


def critic_update(critic_state: TrainState, batch: RLBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """The separate critic's `ppo_epochs` x `num_minibatches` updates (its own shuffles, from its RNG)."""
    critic_state, metrics = _epochs(critic_state, batch, critic_loss, config)
    return critic_state, {f"critic/{k}": v for k, v in metrics.items()}


def _epochs(state: TrainState, batch: RLBatch, loss_fn: Callable, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    batching = config.batching
    check_microbatches(batch, config)
    units = microbatch.to_units(batch)
    count = microbatch.count_units(batch)

    def epoch(state, _):
        rng, shuffle_rng = jax.random.split(state.rng)
        permuted = jax.tree.map(lambda x: x[jax.random.permutation(shuffle_rng, count)], units)
        minibatches = microbatch.split(permuted, batching.num_minibatches)
        return jax.lax.scan(
            lambda s, mb: accumulated_update(s, microbatch.to_rows(mb), loss_fn, config), state.replace(rng=rng),
            minibatches,
        )

    state, metrics = jax.lax.scan(epoch, state, None, length=batching.ppo_epochs)
    metrics = jax.tree.map(jnp.mean, metrics)
    for key in ("skipped_update", "empty_update"):  # counts over the step's updates, not means
        metrics[key] = metrics[key] * batching.updates_per_step
    return state, metrics


def _one_minibatch(config: UpdateConfig) -> UpdateConfig:
    return dataclasses.replace(config, batching=dataclasses.replace(config.batching, num_minibatches=1))


def sft_update(state: TrainState, batch: TokenBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """One behaviour-cloning update (the batch is one mini-batch), accumulated over `num_microbatches`."""
    check_microbatches(batch, _one_minibatch(config))
    return accumulated_update(state, batch, sft_loss, config)


def dpo_update(state: TrainState, batch: DPOBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """One DPO update (the batch is one mini-batch), accumulated over `num_microbatches` like
    every other update; micro-batches weigh by their share of the valid pairs (the loss is a mean
    over pairs), so accumulation gives the whole batch's gradient."""
    check_microbatches(batch, _one_minibatch(config))
    return accumulated_update(state, batch, dpo_objective, config, agg_mode="seq-mean-token-mean")


def check_microbatches(batch: Any, config: UpdateConfig) -> None:
    """A clear error unless `batch`'s units (its rows, or its packed prefix trees; or a count of
    them, units with `Batching.shared_prefix`) cut into the update's mini- and micro-batches,
    each a multiple of the mesh's batch shards."""
    packed = config.batching.shared_prefix if isinstance(batch, int) else getattr(batch, "layout", None) is not None
    units = batch if isinstance(batch, int) else microbatch.count_units(batch)
    activations = config.forward.activation_sharding
    microbatch.check_parts(units, config.batching.num_minibatches, config.batching.num_microbatches,
                           None if activations is None else dict(activations.mesh.shape), "units" if packed else "rows")


def train_state_shardings(state: TrainState, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> TrainState:
    """A `TrainState` of `NamedSharding`s for `state` (arrays or `jax.eval_shape` structs).

    Params follow the partition rules. Optimizer states mirror the params (Adam's mu and nu,
    momentum): every subtree with the params' tree structure is sharded like the params, leaf by
    leaf where the shapes agree; every other leaf (step counts, the RNG key) is replicated.
    """
    params = param_shardings(state.params, mesh, rules)
    replicated = NamedSharding(mesh, P())
    params_def = jax.tree.structure(state.params)
    like_params = lambda x: jax.tree.structure(x) == params_def  # noqa: E731

    def opt_sharding(x: Any) -> Any:
        if not like_params(x):
            return replicated
        return jax.tree.map(lambda leaf, p, s: s if leaf.shape == p.shape else replicated, x, state.params, params)

    return state.replace(
        params=params,
        opt_state=jax.tree.map(opt_sharding, state.opt_state, is_leaf=like_params),
        step=replicated,
        rng=replicated,
        skipped_updates=replicated,
        frozen=param_shardings(state.frozen, mesh, rules),
    )


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The jitted steps of one `UpdateConfig` and placement; build once, call every step. The RL
    steps exist when the config has an RL objective; `critic_update` with a separate critic."""

    sft_update: Callable[[TrainState, TokenBatch], tuple[TrainState, Metrics]]  # donates the state
    row_shards: int  # batches need a multiple of this many rows (pad with `make_token_batch(batch_size=)`)
    prepare: Callable[..., tuple[RLBatch, Metrics]] | None = None  # (params, ref_params, batch[, critic_params])
    rl_update: Callable[[TrainState, RLBatch], tuple[TrainState, Metrics]] | None = None  # donates the state
    critic_update: Callable[[TrainState, RLBatch], tuple[TrainState, Metrics]] | None = None
    dpo_reference: Callable[..., tuple[jax.Array, jax.Array]] | None = None  # (ref_params, chosen, rejected)
    dpo_update: Callable[[TrainState, DPOBatch], tuple[TrainState, Metrics]] | None = None  # donates the state

    def padded_rows(self, rows: int) -> int:
        """The smallest row count >= `rows` that splits evenly over the batch axes."""
        return -(-rows // self.row_shards) * self.row_shards


def make_step_fns(
    config: UpdateConfig,
    mesh: Mesh | None = None,
    state_shardings: TrainState | None = None,
    critic_shardings: TrainState | None = None,
) -> StepFns:
    """`sft_update`; with an RL objective `prepare` and `rl_update` (and, with a separate critic,
    `critic_update`); with DPO's, `dpo_reference` and `dpo_update`: all jitted.

    Without a mesh: plain `jax.jit` (one device). With one: explicit `in_shardings` and
    `out_shardings` — the state as `state_shardings` (`train_state_shardings(state, mesh)`; pass
    states already placed there, e.g. with `jax.device_put`), the reference params like the
    params, batch rows over ("data", "fsdp") (the row count must divide over them), metrics
    replicated. Outputs come back in the input shardings, so step after step compiles nothing.
    A separate critic's state is placed as `critic_shardings` (None: as its inputs come) and is the
    fourth argument of `prepare`. `prepare` takes whole policies (`TrainState.policy_params`; a
    tuned reference: `tuning.combine(ref_params, state.frozen)`).
    Each call makes new jitted functions, i.e. new compilations: call it once per run.
    """
    params = state = rows = replicated = critic = None
    if mesh is not None:
        if state_shardings is None:
            raise ValueError("make_step_fns with a mesh needs state_shardings, e.g. train_state_shardings(state, mesh)")
        critic = critic_shardings
        config = dataclasses.replace(config, forward=dataclasses.replace(config.forward, activation_sharding=batch_sharding(mesh)))
        params, state = state_shardings.policy_params, state_shardings
        rows, replicated = batch_sharding(mesh), NamedSharding(mesh, P())

    def jit(fn: Callable, ins: tuple, outs: tuple, **kw) -> Callable:
        shardings = {} if mesh is None else dict(in_shardings=ins, out_shardings=outs)
        return jax.jit(functools.partial(fn, config=config), **shardings, **kw)

    fns = StepFns(
        sft_update=jit(sft_update, (state, rows), (state, replicated), donate_argnums=0),
        row_shards=1 if mesh is None else math.prod(mesh.shape[axis] for axis in BATCH_AXES),
    )
    if config.dpo is not None:
        return dataclasses.replace(
            fns, dpo_reference=jit(dpo_reference, (params, rows, rows, rows), (rows, rows)),
            dpo_update=jit(dpo_update, (state, rows), (state, replicated), donate_argnums=0),
        )
    if config.rl is None:
        return fns
    separate = config.rl.separate_critic
    prepare_ins = (params, params, rows) + ((None if critic is None else critic.params,) if separate else ())
    return dataclasses.replace(
        fns,
        prepare=jit(prepare, prepare_ins, (rows, replicated)),
        rl_update=jit(rl_update, (state, rows), (state, replicated), donate_argnums=0),
        critic_update=jit(critic_update, (critic, rows), (critic, replicated), donate_argnums=0) if separate else None,
    )
