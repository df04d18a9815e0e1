"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): top-k routing, expert dispatch, the
router's load-balancing loss and how often two runs route alike.

Routing follows the family: a linear router gives each token a softmax over the experts (in
float32), the `num_experts_per_tok` largest probabilities pick its experts and, with
`norm_topk_prob`, are renormalised to sum to 1; the token's output is the weighted sum of its
experts' SwiGLU MLPs (plus, in Qwen2-MoE, a shared expert scaled by a sigmoid gate).

The shared expert is the decoder's `MLP` (`decoder.Block`). Two dispatches compute the same sum (`MOE_DISPATCH`, chosen per backend by
`kernels.AttentionKernels.for_backend`):
- "dense": every expert runs on every token and the routing weights (zero off the top k) mix
  them: three einsums, no data movement; `num_experts / num_experts_per_tok` times the expert
  FLOPs, so it is for the CPU, the tests and tiny models;
- "ragged": the (token, expert) pairs are sorted by expert and each expert's contiguous rows go
  through `jax.lax.ragged_dot`, a grouped matmul (native on TPU, XLA's ragged dot on GPU; on the
  CPU it lowers to a masked dense product): the FLOPs of the chosen experts only, exact, no
  capacity and no dropped tokens.

Parameters (under `layers/moe/`, a leading [layers] axis): `router/kernel [hidden, experts]`,
`{gate,up}_proj/kernel [experts, hidden, moe]`, `down_proj/kernel [experts, moe, hidden]` (a
shared expert is `layers/shared_expert/` and `layers/shared_expert_gate/` beside it). LoRA adapters on the experts (`expert_{gate,up,down}_lora/{a [experts, in, rank],
b [experts, rank, out]}`) give each expert its own low-rank update.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.kernels import MOE_DISPATCH

EXPERT_PROJECTIONS = ("gate", "up", "down")
_INIT = nn.initializers.normal(0.02)


class Routing(NamedTuple):
    """What the routers did on a batch, per layer (a leading [layers] axis from the decoder).

    `experts` are each token's chosen experts, most probable first; `load` counts the (real
    token, chosen expert) pairs per expert and `importance` sums the router's probabilities per
    expert over real tokens (padding, position -1, counts in neither); `tokens` counts real tokens.
    """

    experts: jax.Array  # [batch, seq, k] int32
    load: jax.Array  # [experts] float32
    importance: jax.Array  # [experts] float32
    tokens: jax.Array  # [] float32


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [..., k] float32, experts [..., k] int32, probabilities [..., experts] float32)
    of router logits [..., experts]: softmax in float32, the top k, renormalised if asked."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def load_balancing_loss(routing: Routing, num_experts: int) -> jax.Array:
    """The Switch-Transformer auxiliary loss of the family over all layers and real tokens:
    `num_experts * sum_e f_e * P_e`, where f_e is the share of (token, chosen expert) pairs that
    picked expert e and P_e its mean router probability, both taken over every layer's real
    tokens together (transformers' `load_balancing_loss_func` with an attention mask)."""
    rows = jnp.maximum(jnp.sum(routing.tokens), 1.0)  # tokens x layers
    load = jnp.sum(routing.load, axis=0) / rows
    importance = jnp.sum(routing.importance, axis=0) / rows
    return num_experts * jnp.sum(load * importance)


def routing_mismatch(experts: jax.Array, other: jax.Array, real: jax.Array) -> jax.Array:
    """The share of (real token, layer) pairs whose chosen expert sets differ between two runs
    (the sampler's and the trainer's, say). experts, other [layers, batch, seq, k]; real
    [batch, seq] bool."""
    same = jnp.all(jnp.sort(experts, axis=-1) == jnp.sort(other, axis=-1), axis=-1)  # [layers, batch, seq]
    real = jnp.broadcast_to(real, same.shape)
    return jnp.sum(real & ~same) / jnp.maximum(jnp.sum(real), 1)


class _Kernel(nn.Module):
    """One stacked weight `kernel` of the given shape (the experts' projections, their adapters)."""

    shape: tuple[int, ...]
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", _INIT, self.shape, self.param_dtype)


def _dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [tokens, experts, in] (or [tokens, in]: the same input for every expert) @ w [experts, in, out]."""
    spec = "tei,eio->teo" if x.ndim == 3 else "ti,eio->teo"
    return jnp.einsum(spec, x, w)


def _ragged_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """x [pairs, in] (sorted by expert, `sizes[e]` rows of expert e) @ w[expert of the row] -> [pairs, out]."""
    return jax.lax.ragged_dot(x, w, sizes)


class MoE(nn.Module):
    """The layer's experts on x [batch, seq, hidden] at `positions` [batch, seq] (-1: padding):
    returns (output [batch, seq, hidden], `Routing`)."""

    config: ModelConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    dispatch: str = "dense"  # one of MOE_DISPATCH
    lora_targets: tuple[str, ...] = ()  # adapted expert projections ("gate", "up", "down")
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Routing]:
        c = self.config
        if self.dispatch not in MOE_DISPATCH:
            raise ValueError(f"moe dispatch {self.dispatch!r} is not one of {', '.join(MOE_DISPATCH)}")
        batch, seq, hidden = x.shape
        experts, moe, k = c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
        tokens = x.reshape(-1, hidden)  # [T, hidden]
        logits = nn.Dense(experts, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=_INIT,
                          name="router")(tokens)
        weights, chosen, probs = route(logits, k, c.norm_topk_prob)  # [T, k], [T, k], [T, experts]
        one_hot = jax.nn.one_hot(chosen, experts, dtype=jnp.float32)  # [T, k, experts]
        shapes = {"gate": (experts, hidden, moe), "up": (experts, hidden, moe), "down": (experts, moe, hidden)}
        kernels = {p: _Kernel(shapes[p], self.param_dtype, name=f"{p}_proj")().astype(self.dtype) for p in shapes}
        adapters = {p: (self.get_variable("params", f"expert_{p}_lora")) for p in self.lora_targets}

        def project(name: str, h: jax.Array, matmul) -> jax.Array:
            """h through every (dense) or its own (ragged) expert's projection `name`, plus its LoRA update."""
            out = matmul(h, kernels[name])
            if name in adapters:
                a, b = (adapters[name][w].astype(self.dtype) for w in ("a", "b"))
                out = out + self.lora_scale * matmul(matmul(h, a), b)
            return out

        act = nn.silu
        if self.dispatch == "dense":
            mix = jnp.einsum("tk,tke->te", weights, one_hot)  # the routing weights, 0 off the top k
            h = act(project("gate", tokens, _dense_matmul)) * project("up", tokens, _dense_matmul)  # [T, experts, moe]
            h = h * mix.astype(h.dtype)[..., None]  # each expert's share, folded in before down_proj
            out = jnp.sum(project("down", h, _dense_matmul), axis=1)  # [T, hidden]
        else:
            flat = chosen.reshape(-1)  # [T * k] pairs, token-major
            order = jnp.argsort(flat, stable=True)
            sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
            rows = tokens[order // k]  # [T * k, hidden], sorted by expert
            matmul = lambda h, w: _ragged_matmul(h, w, sizes)  # noqa: E731
            h = act(project("gate", rows, matmul)) * project("up", rows, matmul)
            y = project("down", h, matmul) * weights.reshape(-1)[order][:, None].astype(h.dtype)
            out = jnp.sum(y[jnp.argsort(order)].reshape(-1, k, hidden), axis=1)
        real = (positions.reshape(-1) >= 0).astype(jnp.float32)  # [T]
        routing = Routing(
            experts=chosen.reshape(batch, seq, k),
            load=jnp.sum(one_hot * real[:, None, None], axis=(0, 1)),
            importance=jnp.sum(probs * real[:, None], axis=0),
            tokens=jnp.sum(real),
        )
        return out.reshape(batch, seq, hidden).astype(self.dtype), routing
