"""Jitted, pure update steps: the PPO-family RL update, the SFT step and the DPO step, all on one
micro-batched update path (`accumulated_update`).

An `UpdateConfig` has typed parts, each read from its own config section by `train/settings.py`:
`Forward` (how the model runs: dtype, remat, log-prob chunk, kernels, LoRA scale), `Batching`
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
from agentgym_jax.models.decoder import block_layout, hidden_states, output_head, remat_name, soft_cap
from agentgym_jax.models.moe import Routing, load_balancing_loss
from agentgym_jax.models.decoder import value_head as decoder_value_head
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.parallel.mesh import BATCH_AXES
from agentgym_jax.parallel.partition import DEFAULT_RULES, Rules, batch_sharding, fit_spec, param_shardings
from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS, Estimator, compute_advantages
from agentgym_jax.rl.correction import IS_LEVELS, importance_weights
from agentgym_jax.rl.dpo import dpo_loss
from agentgym_jax.rl.kl import KL_ESTIMATORS, apply_kl_penalty, kl_loss
from agentgym_jax.rl.losses import POLICY_LOSSES, PolicyLoss, entropy_from_logits, value_loss
from agentgym_jax.rl.masked import LOSS_AGG_MODES, aggregate_loss, masked_count, masked_mean
from agentgym_jax.rollout.batch import TokenBatch
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
class Forward:
    """How the trainer runs the model, whatever the loss (RL, SFT, DPO, the critic's)."""

    model: ModelConfig
    compute_dtype: str | None = None  # None: the parameters' dtype
    remat: str | bool = "none"  # what each layer keeps for the backward: a key of decoder.REMAT_POLICIES
    logprob_chunk: int = 1024  # sequence positions projected to the vocabulary at a time
    kernels: AttentionKernels = AttentionKernels()  # attention implementations (`models.kernels`)
    lora_scale: float = 0.0  # LoRA adapters' alpha / rank (`models/tuning.py`); 0: no adapters
    # A mixture of experts' load-balancing loss (`models.moe.load_balancing_loss`) added to the
    # policy's losses with this weight; 0 (off) like the MoE RL recipes.
    router_aux_coef: float = 0.0
    # Set by `make_step_fns` from the mesh: pins the residual stream [batch, seq, hidden] to the batch axes.
    activation_sharding: NamedSharding | None = None

    def __post_init__(self):
        remat_name(self.remat)  # raises on an unknown policy, naming the valid ones
        if self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1 (positions per vocabulary projection), got {self.logprob_chunk}")
        if self.router_aux_coef and not self.model.moe:
            raise ValueError(f"router_aux_coef={self.router_aux_coef} needs a mixture of experts; {self.model.family} has none")


@dataclasses.dataclass(frozen=True)
class Batching:
    """How an update cuts its batch (epochs, mini-batches, micro-batches, lengths) and sums the
    per-token losses into one number (`agg_mode`, which also weighs the micro-batches)."""

    ppo_epochs: int = 1  # passes over an RL batch (SFT and DPO: one)
    num_minibatches: int = 1  # optimizer updates per epoch
    num_microbatches: int = 1  # gradient-accumulation chunks per mini-batch
    length_buckets: int = 1  # > 1: micro-batches grouped by length, each run at its own (`length_buckets()`)
    agg_mode: str = "token-mean"  # one of rl.masked.LOSS_AGG_MODES
    loss_norm_length: int | None = None  # the constant of agg_mode "seq-mean-token-sum-norm"

    def __post_init__(self):
        _one_of(self, "agg_mode", LOSS_AGG_MODES)
        _at_least(1, False, ppo_epochs=self.ppo_epochs, num_minibatches=self.num_minibatches,
                  num_microbatches=self.num_microbatches, length_buckets=self.length_buckets)
        _at_least(0, True, loss_norm_length=self.loss_norm_length)
        if self.agg_mode == "seq-mean-token-sum-norm" and self.loss_norm_length is None:
            raise ValueError("agg_mode 'seq-mean-token-sum-norm' needs loss_norm_length (e.g. max_response_length)")

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
        jax.eval_shape(lambda r, m, v, g: compute_advantages(self.advantage, token_rewards=r, loss_mask=m, values=v,
                                                              group_ids=g, **dict(self.advantage_hparams)),
                       row, mask, row, jax.ShapeDtypeStruct((1,), jnp.int32))
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
    def scores_rollouts(self) -> bool:
        """Whether `prepare` runs the trainer over the batch. It need not when the batch makes one
        optimizer update and nothing else reads the scoring pass (no reference, value model or
        off-policy correction): the update's own log-probs, gradient stopped, are then the old ones
        (ratio 1, the same gradient), which saves a forward pass over every rollout."""
        rl, batching = self.rl, self.batching
        return (batching.updates_per_step > 1 or rl.uses_reference or rl.uses_critic or rl.corrects_off_policy)


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


def token_logprobs(
    params: Any, tokens: jax.Array, positions: jax.Array, forward: Forward, temperature: float = 1.0,
    value_head: bool = False, router_aux: bool = False,
) -> tuple[jax.Array, ...]:
    """Log-prob, entropy and critic value of every token given its prefix, each [batch, seq].

    Entry t describes token t (predicted from position t - 1), so it lines up with `loss_mask`;
    entry 0 has no prefix and is 0. Log-probs and entropy are of `logits / temperature`, the
    distribution the sampler drew from at that temperature. The trunk runs once to the final
    hidden states; the vocabulary projection, log-softmax and gather then run `logprob_chunk`
    positions at a time (`chunked_logprobs`), so the [batch, seq, vocab] logits are never held.
    With `router_aux`, a mixture of experts' load-balancing loss over the rows comes fourth.
    """
    hidden, routing = _trunk(params, tokens, positions, forward, forward.model)  # [batch, seq, hidden]
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # [batch, seq]: position t predicts token t + 1
    logp, entropy = chunked_logprobs(
        hidden, output_head(params, forward.model), targets, forward.logprob_chunk, temperature,
        forward.model.final_softcap,
    )
    if value_head:
        values = decoder_value_head(params, hidden)  # value of the state each token is sampled in
    else:
        values = jnp.zeros_like(logp)
    shift = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0)))  # noqa: E731
    scores = (shift(logp), shift(entropy), shift(values))
    return (*scores, load_balancing_loss(routing, forward.model.num_experts)) if router_aux else scores


def critic_values(critic_params: Any, tokens: jax.Array, positions: jax.Array, forward: Forward,
                  model: ModelConfig | None = None) -> jax.Array:
    """The separate critic's values `[batch, seq]`, aligned like `token_logprobs`: entry t is the
    value of the state token t is sampled in (entry 0 is 0). The critic's logits are unused (and
    left out by XLA). `model`: the critic's architecture (None: the policy's)."""
    hidden, _ = _trunk(critic_params, tokens, positions, forward, model or forward.model)
    return jnp.pad(decoder_value_head(critic_params, hidden)[:, :-1], ((0, 0), (1, 0)))


def _trunk(params: Any, tokens: jax.Array, positions: jax.Array, config: Forward,
           model: ModelConfig) -> tuple[jax.Array, Routing | None]:
    """`model`'s final hidden states [batch, seq, hidden] in the update's compute dtype, remat,
    attention kernels and activation sharding, and its experts' routing (None: a dense model)."""
    dtype = jnp.dtype(config.compute_dtype) if config.compute_dtype else None
    activations = config.activation_sharding
    if activations is not None:  # a micro-batch the batch axes do not divide stays replicated
        spec = fit_spec(activations.spec, (*tokens.shape, model.hidden_size), activations.mesh)
        activations = NamedSharding(activations.mesh, spec)
    return hidden_states(params, tokens, positions, config=model, dtype=dtype, remat=config.remat,
                         activation_sharding=activations, kernels=config.kernels, lora_scale=config.lora_scale,
                         return_routing=True)


def chunked_logprobs(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk: int, temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """log p(targets) and the entropy at every position under `logits / temperature`, each
    [batch, seq] float32 (the logits soft-capped first where the model caps them: `softcap`).

    hidden [batch, seq, hidden] (compute dtype), head [hidden, vocab], targets [batch, seq] int.
    A `lax.map` over chunks of `chunk` positions, each rematerialised: forward and backward hold
    one [batch, chunk, vocab] block of logits at a time, never [batch, seq, vocab].
    """
    batch, seq, width = hidden.shape
    chunk, padded = block_layout(seq, chunk)
    if padded > seq:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - seq), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - seq)))
    head = head.astype(hidden.dtype)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block(inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        h, t = inputs  # [batch, chunk, hidden], [batch, chunk]
        logits = soft_cap(jnp.einsum("btd,dv->btv", h, head, preferred_element_type=jnp.float32), softcap) / temperature
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), t[..., None], axis=-1)[..., 0]
        return logp, entropy_from_logits(logits)

    blocks = (hidden.reshape(batch, -1, chunk, width).swapaxes(0, 1), targets.reshape(batch, -1, chunk).swapaxes(0, 1))
    logp, entropy = jax.lax.map(block, blocks)  # [chunks, batch, chunk] each
    merge = lambda x: x.swapaxes(0, 1).reshape(batch, padded)[:, :seq]  # noqa: E731
    return merge(logp), merge(entropy)


def prepare(
    params: Any, ref_params: Any, batch: TokenBatch, critic_params: Any = None, *, config: UpdateConfig
) -> tuple[RLBatch, Metrics]:
    """Scores a rollout batch with the current and the reference policy and computes advantages.

    The forward passes run one micro-batch at a time, micro-batches of the update's size
    (`num_minibatches x num_microbatches` parts), like the update's: grouped by length and each
    cut to its own with `length_buckets > 1`, and skipped where no row trains a token.
    `batch.old_logprobs` are the sampler's: they feed `logprob_gap` and the importance weights;
    the PPO ratio is taken against the trainer's recomputed log-probs. `critic_params`: the
    separate critic's (`config.rl.separate_critic`), else None. Where nothing reads a scoring pass
    (`UpdateConfig.scores_rollouts`), none runs: advantages only.
    """
    rl = config.rl
    if rl.separate_critic != (critic_params is not None):
        raise ValueError(f"critic={rl.critic!r} with advantage={rl.advantage!r}: critic_params must be "
                         f"{'given' if rl.separate_critic else 'None'}")
    mask = batch.loss_mask
    check_microbatches(batch.tokens.shape[0], config)
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
    )
    return rl_batch, metrics


def _score_rollouts(all_params: tuple[Any, Any, Any], batch: TokenBatch,
                    config: UpdateConfig) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Metrics]:
    """`prepare`'s scoring pass: trainer and reference log-probs and values of every row, the
    importance weights of trainer vs sampler, and their metrics."""
    rl, forward, batching, mask = config.rl, config.forward, config.batching, batch.loss_mask

    def score(all_params: tuple[Any, Any, Any], part: TokenBatch) -> tuple[jax.Array, ...]:
        params, ref_params, critic_params = all_params
        rows = (part.tokens, part.positions)
        old_logprobs, entropy, values = token_logprobs(params, *rows, forward, rl.temperature, rl.shared_value_head)
        if rl.separate_critic:
            values = critic_values(critic_params, *rows, forward, rl.critic_model)
        ref_logprobs = (token_logprobs(ref_params, *rows, forward, rl.temperature)[0] if rl.uses_reference
                        else old_logprobs)
        return old_logprobs, entropy, values, ref_logprobs

    parts = batching.num_minibatches * batching.num_microbatches
    # Parts of like lengths, each scored at its own (rows that train nothing: not at all), as the update runs them.
    order = _length_order(batch, parts) if batching.length_buckets > 1 and parts > 1 else None
    rows = batch if order is None else jax.tree.map(lambda x: x[order], batch)
    score_at = _at_length(score, length_buckets(batch.tokens.shape[1], batching.length_buckets), per_position=True)
    scored, run_lengths = jax.lax.map(lambda part: score_at(all_params, part), _split(rows, parts))
    scored = _merge(scored)
    if order is not None:
        scored = jax.tree.map(lambda x: x[jnp.argsort(order)], scored)  # back to the batch's row order
    old_logprobs, entropy, values, ref_logprobs = scored
    # Weights of trainer vs sampler: always in the metrics, in the loss only with a correction on.
    is_weights, is_metrics = importance_weights(
        old_logprobs, batch.old_logprobs, mask, level="token" if rl.is_correction == "none" else rl.is_correction,
        cap=rl.is_cap, mode="drop" if rl.decoupled_ppo else "truncate",
    )
    if not rl.corrects_off_policy:
        is_weights = jnp.ones_like(is_weights)
    metrics = {
        **_rollout_metrics(old_logprobs, batch.old_logprobs, entropy, mask),
        **is_metrics,
        "score_length_fraction": jnp.mean(run_lengths) / batch.tokens.shape[1],  # of the padded positions, scored
    }
    return old_logprobs, values, ref_logprobs, is_weights, metrics


def _rollout_metrics(trainer_logprobs: jax.Array, sampler_logprobs: jax.Array, entropy: jax.Array,
                     mask: jax.Array) -> Metrics:
    # Same tokens, two code paths: a gap here means the sampler and trainer disagree.
    return {"logprob_gap": masked_mean(jnp.abs(sampler_logprobs - trainer_logprobs), mask),
            "entropy_at_rollout": masked_mean(entropy, mask)}


def _advantage_metrics(advantages: jax.Array, mask: jax.Array) -> Metrics:
    return {"advantage_mean": masked_mean(advantages, mask), "advantage_abs_mean": masked_mean(jnp.abs(advantages), mask),
            "policy_tokens": masked_count(mask)}


def rl_loss(params: Any, batch: RLBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """The policy loss (`rl.losses.POLICY_LOSSES`) + KL to the reference - entropy bonus + clipped value loss.
    Without a scoring pass (`UpdateConfig.scores_rollouts`) the batch's old log-probs are the
    sampler's and the loss's own, gradient stopped, stand in for the trainer's."""
    rl = config.rl
    logprobs, entropy, values, *router = token_logprobs(params, batch.tokens, batch.positions, config.forward,
                                                        rl.temperature, rl.shared_value_head, _router_aux(config))
    mask = batch.loss_mask
    old_logprobs, metrics = batch.old_logprobs, {}
    if not config.scores_rollouts:
        old_logprobs = jax.lax.stop_gradient(logprobs)
        metrics = _rollout_metrics(old_logprobs, batch.old_logprobs, jax.lax.stop_gradient(entropy), mask)
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
    values = critic_values(critic_params, batch.tokens, batch.positions, config.forward, config.rl.critic_model)
    loss, metrics = value_loss(
        values, batch.old_values, batch.returns, batch.loss_mask, agg_mode=config.batching.agg_mode,
        norm_length=config.batching.loss_norm_length, clip_eps_value=config.rl.clip_eps_value,
    )
    return loss, {**metrics, "value_loss": loss, "loss": loss}


def sft_loss(params: Any, batch: TokenBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """Behaviour cloning: negative log-likelihood of the policy tokens (same masks as RL), of the
    model's own distribution (temperature 1)."""
    logprobs, _, _, *router = token_logprobs(params, batch.tokens, batch.positions, config.forward,
                                             router_aux=_router_aux(config))
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


def pair_logprobs(params: Any, chosen: TokenBatch, rejected: TokenBatch, forward: Forward) -> tuple[jax.Array, jax.Array]:
    """Log-probs of every token of the chosen and rejected rows, each [pairs, seq].

    One forward over the rows of both (`[2 * pairs, seq]`): half the program of two forwards, so
    the update compiles in about half the time.
    """
    tokens = jnp.concatenate([chosen.tokens, rejected.tokens])  # [2 * pairs, seq]
    positions = jnp.concatenate([chosen.positions, rejected.positions])
    logprobs = token_logprobs(params, tokens, positions, forward)[0]
    return logprobs[: chosen.tokens.shape[0]], logprobs[chosen.tokens.shape[0] :]


def dpo_reference(ref_params: Any, chosen: TokenBatch, rejected: TokenBatch, config: UpdateConfig) -> tuple[jax.Array, jax.Array]:
    """The frozen reference's log-probs of the chosen and rejected rows, each [pairs, seq], one
    micro-batch (of the update's size) at a time, without gradient."""
    parts = config.batching.num_microbatches
    check_microbatches(chosen.tokens.shape[0], _one_minibatch(config))
    scored = jax.lax.map(lambda pair: pair_logprobs(ref_params, *pair, config.forward), _split((chosen, rejected), parts))
    return jax.lax.stop_gradient(_merge(scored))


def dpo_objective(params: Any, batch: DPOBatch, config: UpdateConfig) -> tuple[jax.Array, Metrics]:
    """The DPO loss of `rl/dpo.py` under `params` (mean over valid pairs), and its metrics."""
    chosen_logprobs, rejected_logprobs = pair_logprobs(params, batch.chosen, batch.rejected, config.forward)
    loss, metrics = dpo_loss(
        chosen_logprobs, batch.chosen_ref_logprobs, batch.chosen.loss_mask,
        rejected_logprobs, batch.rejected_ref_logprobs, batch.rejected.loss_mask, beta=config.dpo.beta,
    )
    return loss, {**metrics, "loss": loss}


def _share(loss_mask: jax.Array, agg_mode: str) -> jax.Array:
    """[num_micro] weights making the weighted sum of micro-batch losses equal the full loss."""
    if agg_mode == "token-mean":
        counts = jnp.sum(loss_mask, axis=(1, 2))  # tokens per micro-batch
    else:
        counts = jnp.sum(jnp.any(loss_mask > 0, axis=2), axis=1).astype(jnp.float32)  # sequences
    return counts / jnp.maximum(jnp.sum(counts), 1.0)


def _split(tree: Any, parts: int) -> Any:
    """[batch, ...] -> [parts, batch // parts, ...] on every leaf; part i takes rows i, i + parts, ...

    Strided rather than contiguous, so that with rows sharded over devices every part keeps
    rows on every device (the reshape needs no communication).
    """
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1), tree)


def _merge(tree: Any) -> Any:
    """The inverse of `_split`: [parts, batch // parts, ...] -> [batch, ...] in the original row order."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def length_buckets(seq: int, count: int, multiple: int = 64) -> tuple[int, ...]:
    """The lengths a micro-batch of `seq`-token rows can run at, longest first: `seq` and its
    halvings (`count` in all, rounded up to a `multiple` of positions, repeats dropped)."""
    halvings = (-(-(seq >> i) // multiple) * multiple for i in range(count))
    return tuple(sorted({min(seq, max(length, multiple)) for length in halvings}, reverse=True))


def _row_lengths(batch: Any) -> jax.Array:
    """[rows] the positions each row needs: its real tokens (rows are right-padded, position -1),
    or none when it trains no token (e.g. a group the batch filter dropped: it adds nothing)."""
    trains = jnp.any(batch.loss_mask > 0, axis=1)
    return jnp.where(trains, jnp.sum(batch.positions >= 0, axis=1), 0)


def _length_order(batch: Any, parts: int) -> jax.Array:
    """[rows] a row order in which `_split(rows, parts)` part i holds the i-th shortest
    `rows / parts` rows: parts of like lengths, so that each can run at its own length."""
    order = jnp.argsort(_row_lengths(batch))
    per_part = order.shape[0] // parts
    return order.reshape(parts, per_part).T.reshape(-1)  # part i (rows i, i + parts, ...) = order[i * per_part:]


def _at_length(fn: Callable, lengths: tuple[int, ...], per_position: bool = False) -> Callable:
    """`fn(params, batch)` run on `batch` cut to the shortest of `lengths` that holds its longest
    row (one `lax.switch` branch per length; only the taken one runs), and that length; with
    several lengths, not run at all (zeros, length 0) when no row trains a token, e.g. groups
    that dynamic sampling left out. `per_position`: the output's [rows, length] leaves are padded back to `lengths[0]`.

    Exact: positions past a row's end are padding, which no real token attends to and no loss
    counts (nor any position of a row that trains no token), every loss aggregation is
    independent of the padded length, and a part that trains no token has a zero loss, gradient
    and micro-batch weight, and scores that every later use masks out."""
    full = lengths[0]

    def cut(length: int) -> Callable:
        trim = lambda x: x[:, :length] if x.ndim == 2 and x.shape[1] == full else x  # noqa: E731
        pad = lambda y: jnp.pad(y, ((0, 0), (0, full - length))) if per_position else y  # noqa: E731
        return lambda params, batch: jax.tree.map(pad, fn(params, jax.tree.map(trim, batch)))

    branches = [cut(length) for length in lengths]

    def skip(params, batch):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(branches[0], params, batch))

    if len(lengths) == 1:  # one length: no switch (a conditional costs the update memory at real shapes)
        return lambda params, batch: (branches[0](params, batch), jnp.float32(full))

    def run(params, batch):
        needed = jnp.max(_row_lengths(batch))
        fits = jnp.sum(jnp.asarray(lengths) >= needed) - 1  # longest first: a prefix fits
        index = jnp.where(needed > 0, fits, len(lengths))
        out = jax.lax.switch(index, [*branches, skip], params, batch)
        return out, jnp.asarray((*lengths, 0), jnp.float32)[index]

    return run


def check_microbatches(rows: int, config: UpdateConfig) -> None:
    """A clear error unless a `rows`-row batch cuts into `num_minibatches x num_microbatches` parts
    that each split evenly over the mesh's batch shards (else a part is replicated and recomputed
    on every device)."""
    mini, micro = config.batching.num_minibatches, config.batching.num_microbatches
    if rows % (mini * micro):
        raise ValueError(f"batch of {rows} rows is not divisible into {mini} mini-batches x {micro} micro-batches")
    per_mini = rows // mini
    activations = config.forward.activation_sharding
    mesh = None if activations is None else activations.mesh
    shards = 1 if mesh is None else math.prod(mesh.shape[axis] for axis in BATCH_AXES)
    if (per_mini // micro) % shards:
        fix = (
            f"set num_microbatches to a divisor of {per_mini // shards} (at most {per_mini // shards})"
            if per_mini % shards == 0
            else f"no num_microbatches fits: give each mini-batch a multiple of {shards} rows (num_minibatches, rows)"
        )
        raise ValueError(
            f"mini-batch of {per_mini} rows / num_microbatches={micro} = {per_mini // micro} rows per micro-batch, "
            f"but the mesh has {shards} batch shards (data x fsdp) and a micro-batch needs a multiple of them: {fix}"
        )


def accumulated_update(
    state: TrainState, batch: Any, loss_fn: Callable, config: UpdateConfig, agg_mode: str | None = None
) -> tuple[TrainState, Metrics]:
    """One optimizer update on `batch`, its gradient accumulated over `num_microbatches`
    (grouped by length and each cut to its own with `length_buckets > 1`; a micro-batch that
    trains no token is not run). Gradients are of `state.params` only (tuned: `state.frozen` is
    merged in for the forward pass and gets none). Micro-batches weigh by their share of the
    batch's loss tokens or rows, as `agg_mode` (default: the batching's) sums the loss.

    The accumulator is float32 whatever the parameters' dtype (bfloat16 sums of many small
    micro-batch gradients lose their low bits); `TrainState.apply_gradients` takes it as is.
    """
    batching = config.batching
    if batching.length_buckets > 1 and batching.num_microbatches > 1:
        order = _length_order(batch, batching.num_microbatches)
        batch = jax.tree.map(lambda x: x[order], batch)
    micro = _split(batch, batching.num_microbatches)
    weights = _share(micro.loss_mask, agg_mode or batching.agg_mode)

    def trainable_loss(params, micro_batch):
        return loss_fn(tuning.combine(params, state.frozen) if state.frozen else params, micro_batch, config=config)

    grad_fn = _at_length(
        jax.value_and_grad(trainable_loss, has_aux=True), length_buckets(batch.tokens.shape[1], batching.length_buckets),
    )

    def micro_step(grads, inputs):
        micro_batch, weight = inputs
        ((_, metrics), micro_grads), length = grad_fn(state.params, micro_batch)
        grads = jax.tree.map(lambda g, m: g + weight * m.astype(jnp.float32), grads, micro_grads)
        return grads, (jax.tree.map(lambda m: weight * m, metrics), length)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    grads, (metrics, run_lengths) = jax.lax.scan(micro_step, zeros, (micro, weights))
    metrics = jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
    metrics["length_fraction"] = jnp.mean(run_lengths) / batch.tokens.shape[1]  # of the padded positions, computed
    metrics["grad_norm"] = optax.global_norm(grads)
    empty = jnp.sum(micro.loss_mask) == 0  # e.g. a mini-batch of rows the batch filter masked out
    new_state = state.apply_gradients(grads, loss=metrics["loss"], empty=empty)
    metrics["skipped_update"] = (new_state.skipped_updates - state.skipped_updates).astype(jnp.float32)
    metrics["empty_update"] = empty.astype(jnp.float32)
    return new_state, metrics


def rl_update(state: TrainState, batch: RLBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """`ppo_epochs` x `num_minibatches` optimizer updates over shuffled rows of `batch`."""
    return _epochs(state, batch, rl_loss, config)


def critic_update(critic_state: TrainState, batch: RLBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """The separate critic's `ppo_epochs` x `num_minibatches` updates (its own shuffles, from its RNG)."""
    critic_state, metrics = _epochs(critic_state, batch, critic_loss, config)
    return critic_state, {f"critic/{k}": v for k, v in metrics.items()}


def _epochs(state: TrainState, batch: RLBatch, loss_fn: Callable, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    rows, batching = batch.tokens.shape[0], config.batching
    check_microbatches(rows, config)

    def epoch(state, _):
        rng, shuffle_rng = jax.random.split(state.rng)
        permuted = jax.tree.map(lambda x: x[jax.random.permutation(shuffle_rng, rows)], batch)
        minibatches = _split(permuted, batching.num_minibatches)
        return jax.lax.scan(
            lambda s, mb: accumulated_update(s, mb, loss_fn, config), state.replace(rng=rng), minibatches
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
    check_microbatches(batch.tokens.shape[0], _one_minibatch(config))
    return accumulated_update(state, batch, sft_loss, config)


def dpo_update(state: TrainState, batch: DPOBatch, config: UpdateConfig) -> tuple[TrainState, Metrics]:
    """One DPO update (the batch is one mini-batch), accumulated over `num_microbatches` like
    every other update; micro-batches weigh by their share of the valid pairs (the loss is a mean
    over pairs), so accumulation gives the whole batch's gradient."""
    check_microbatches(batch.tokens.shape[0], _one_minibatch(config))
    return accumulated_update(state, batch, dpo_objective, config, agg_mode="seq-mean-token-mean")


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
            fns, dpo_reference=jit(dpo_reference, (params, rows, rows), (rows, rows)),
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
