"""What every loss reads of a batch under a policy: the log-prob, entropy and value of each token.

`score` runs the model over a `TokenBatch` in either layout and returns `[rows, seq]` arrays
aligned with `loss_mask` (entry t describes token t, predicted from the state before it; 0
where nothing predicts it):
- plain rows (`batch.layout is None`): each row runs alone;
- rows packed as prefix trees (`rollout/packing.py`): what a unit's rows share runs once, and
  each row token is read from the packed position before it (`PackedRows.sources`), so a
  shared prompt costs one forward and one backward instead of one per row.
Where the output layer runs is `Forward.logprobs_at`: at every token ("all"), or only where the
loss reads a log-prob ("loss": the loss-masked tokens, gathered before the head, a chunk of
`logprob_chunk` at a time, chunks with nothing to score skipped). Both are exact: every loss,
metric and estimator reads log-probs, entropies and values only where `loss_mask` is set.

Memory follows rule 10: the trunk's attention is blockwise, the [rows, seq, vocab] logits never
exist (a chunk of positions at a time, each chunk rematerialised in the backward pass).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import block_layout, hidden_states, output_head, remat_name, soft_cap
from agentgym_jax.models.decoder import value_head as decoder_value_head
from agentgym_jax.models.kernels import AttentionKernels
from agentgym_jax.models.moe import Routing, load_balancing_loss
from agentgym_jax.parallel.partition import fit_spec
from agentgym_jax.rl.losses import entropy_from_logits
from agentgym_jax.rollout.batch import TokenBatch

LOGPROBS_AT = ("loss", "all")  # where the output layer runs: loss-masked tokens only, or every token


@dataclasses.dataclass(frozen=True)
class Forward:
    """How the trainer runs the model, whatever the loss (RL, SFT, DPO, the critic's)."""

    model: ModelConfig
    compute_dtype: str | None = None  # None: the parameters' dtype
    remat: str | bool = "none"  # what each layer keeps for the backward: a key of decoder.REMAT_POLICIES
    logprob_chunk: int = 1024  # sequence positions projected to the vocabulary at a time
    logprobs_at: str = "all"  # one of LOGPROBS_AT
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
        if self.logprobs_at not in LOGPROBS_AT:
            raise ValueError(f"logprobs_at={self.logprobs_at!r} is not one of {', '.join(LOGPROBS_AT)}")
        if self.router_aux_coef and not self.model.moe:
            raise ValueError(f"router_aux_coef={self.router_aux_coef} needs a mixture of experts; {self.model.family} has none")


def score(
    params: Any, batch: TokenBatch, forward: Forward, temperature: float = 1.0, value_head: bool = False,
    router_aux: bool = False,
) -> tuple[jax.Array, ...]:
    """Log-prob, entropy and critic value of every token given the tokens before it, each
    [rows, seq] float32, of `logits / temperature` (the distribution the sampler drew from at
    that temperature; the logits soft-capped first where the family caps them). Values:
    `params`' value head (`value_head`), else zeros. With `logprobs_at="loss"` log-probs and
    entropies are 0 where `loss_mask` is not set. With `router_aux`, a mixture of experts'
    load-balancing loss over the tokens computed comes fourth (a packed batch's shared tokens
    count once)."""
    hidden, sources, routing = _trunk_and_sources(params, batch, forward, forward.model)
    slots = _unit_rows(sources, sources)  # [units, rows per unit * seq]
    need = slots >= 0
    if forward.logprobs_at == "loss":
        need &= _unit_rows(batch.loss_mask, sources) > 0
    logp, entropy = gathered_logprobs(hidden, output_head(params, forward.model), slots, _unit_rows(batch.tokens, sources),
                                      need, forward.logprob_chunk, temperature, forward.model.final_softcap)
    values = _values(params, hidden, sources) if value_head else jnp.zeros_like(logp)
    rows = batch.tokens.shape
    scores = (logp.reshape(rows), entropy.reshape(rows), values.reshape(rows))
    return (*scores, load_balancing_loss(routing, forward.model.num_experts)) if router_aux else scores


def critic_values(critic_params: Any, batch: TokenBatch, forward: Forward, model: ModelConfig | None = None) -> jax.Array:
    """The separate critic's values `[rows, seq]`, aligned like `score`'s (entry t: the value of
    the state token t is sampled in). `model`: the critic's architecture (None: the policy's)."""
    hidden, sources, _ = _trunk_and_sources(critic_params, batch, forward, model or forward.model)
    return _values(critic_params, hidden, sources).reshape(batch.tokens.shape)


def gathered_logprobs(
    hidden: jax.Array, head: jax.Array, sources: jax.Array, targets: jax.Array, need: jax.Array, chunk: int,
    temperature: float = 1.0, softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """log p(target) and the entropy at each slot whose `need` is set (0 elsewhere), each
    [units, slots] float32, under `logits / temperature` (soft-capped first by `softcap`).

    hidden [units, width, hidden] (compute dtype), head [hidden, vocab], sources [units, slots]
    (the hidden state predicting each slot's target), targets [units, slots] int, need [units,
    slots] bool. The needed slots of each unit are moved to the front, then projected `chunk` at
    a time (a `lax.map`, each chunk rematerialised: forward and backward hold one [units, chunk,
    vocab] block of logits); a chunk no unit needs is skipped, so the head costs what the loss
    reads, not what the rows hold.
    """
    units, slots = sources.shape
    chunk, padded = block_layout(slots, chunk)
    order = jnp.argsort(~need, axis=1, stable=True)  # [units, slots]: needed slots first
    needed = jnp.sum(need, axis=1)  # [units]
    if padded > slots:
        order = jnp.pad(order, ((0, 0), (0, padded - slots)))
    head = head.astype(hidden.dtype)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def block(inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        start, picked = inputs  # [], [units, chunk] slot indices
        valid = start + jnp.arange(chunk) < needed[:, None]  # [units, chunk]

        def project(_):
            where = jnp.take_along_axis(sources, picked, axis=1)
            h = jnp.take_along_axis(hidden, jnp.maximum(where, 0)[..., None], axis=1)  # [units, chunk, hidden]
            logits = soft_cap(jnp.einsum("utd,dv->utv", h, head, preferred_element_type=jnp.float32), softcap) / temperature
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.take_along_axis(targets, picked, axis=1)[..., None],
                                       axis=-1)[..., 0]
            return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy_from_logits(logits), 0.0)

        zeros = jnp.zeros((units, chunk), jnp.float32)
        return jax.lax.cond(jnp.any(valid), project, lambda _: (zeros, zeros), None)

    starts = jnp.arange(0, padded, chunk, dtype=jnp.int32)
    logp, entropy = jax.lax.map(block, (starts, order.reshape(units, -1, chunk).swapaxes(0, 1)))  # [chunks, units, chunk]
    back = jnp.argsort(order[:, :slots], axis=1)  # each slot's place in the sorted order

    def unsort(x: jax.Array) -> jax.Array:
        return jnp.take_along_axis(x.swapaxes(0, 1).reshape(units, padded), back, axis=1)

    return unsort(logp), unsort(entropy)


def plain_sources(positions: jax.Array) -> jax.Array:
    """[rows, 1, seq] the sources of plain rows: token t is predicted at t - 1 of its own row
    (-1 for a row's first token and for padding): each row is a unit of one row."""
    seq = positions.shape[1]
    previous = jnp.arange(seq, dtype=jnp.int32) - 1
    return jnp.where((positions > 0) & (previous >= 0), previous, -1)[:, None, :]


def _trunk_and_sources(params: Any, batch: TokenBatch, forward: Forward,
                       model: ModelConfig) -> tuple[jax.Array, jax.Array, Routing | None]:
    """The final hidden states [units, width, hidden] of the batch's layout, its sources
    [units, rows per unit, seq] (plain rows: units of one row) and the experts' routing (None:
    a dense model)."""
    layout = batch.layout
    if layout is None:
        hidden, routing = _trunk(params, batch.tokens, batch.positions, None, forward, model)
        return hidden, plain_sources(batch.positions), routing
    hidden, routing = _trunk(params, layout.tokens, layout.positions, layout.ends, forward, model)
    return hidden, layout.sources, routing


def _unit_rows(x: jax.Array, sources: jax.Array) -> jax.Array:
    """[rows, seq] -> [units, rows per unit * seq], the slots of `sources` flattened."""
    return x.reshape(sources.shape[0], -1)


def _values(params: Any, hidden: jax.Array, sources: jax.Array) -> jax.Array:
    """[units, rows per unit * seq] the value head at each token's source; 0 where it has none."""
    values = decoder_value_head(params, hidden)  # [units, width]
    flat = sources.reshape(sources.shape[0], -1)
    return jnp.where(flat >= 0, jnp.take_along_axis(values, jnp.maximum(flat, 0), axis=1), 0.0)


def _trunk(params: Any, tokens: jax.Array, positions: jax.Array, ends: jax.Array | None, config: Forward,
           model: ModelConfig) -> tuple[jax.Array, Routing | None]:
    """`model`'s final hidden states [rows, seq, hidden] in the update's compute dtype, remat,
    attention kernels and activation sharding, and its experts' routing (None: a dense model)."""
    dtype = jnp.dtype(config.compute_dtype) if config.compute_dtype else None
    activations = config.activation_sharding
    if activations is not None:  # a micro-batch the batch axes do not divide stays replicated
        spec = fit_spec(activations.spec, (*tokens.shape, model.hidden_size), activations.mesh)
        activations = NamedSharding(activations.mesh, spec)
    return hidden_states(params, tokens, positions, config=model, dtype=dtype, remat=config.remat,
                         activation_sharding=activations, kernels=config.kernels, lora_scale=config.lora_scale,
                         ends=ends, return_routing=True)
