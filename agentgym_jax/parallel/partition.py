"""Partition rules: regexes on parameter paths -> `PartitionSpec`s over the ("data", "fsdp", "tensor") mesh.

Megatron-style tensor parallelism splits query/key/value heads and the MLP hidden dimension over
`tensor` (so attention and the MLP need one all-reduce each, after o_proj and down_proj); FSDP
shards the model dimension of every matrix over `fsdp`, and a mixture of experts' experts. A dimension that the mesh axes do not
divide is replicated over them instead (e.g. 2 key/value heads on a tensor axis of 4).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agentgym_jax.parallel.mesh import BATCH_AXES

Rules = Sequence[tuple[str, P]]

# First match wins; paths look like "layers/attn/q_proj/kernel" (a leading [layers] axis on layers/*).
DEFAULT_RULES: Rules = (
    # [vocab, hidden]: vocab-parallel over both axes. Sharding hidden instead makes the lookup's
    # output sharded on hidden, which XLA can only turn into batch sharding by a full regather.
    (r"embed/embedding$", P(("fsdp", "tensor"), None)),
    (r"lm_head$", P("fsdp", "tensor")),  # [hidden, vocab]
    (r"attn/(q|k|v)_proj/kernel$", P(None, "fsdp", "tensor", None)),  # [L, hidden, heads, head_dim]
    (r"attn/(q|k|v)_proj/bias$", P(None, "tensor", None)),  # [L, heads, head_dim]
    (r"attn/o_proj/kernel$", P(None, "tensor", None, "fsdp")),  # [L, heads, head_dim, hidden]
    (r"(mlp|shared_expert)/(gate|up)_proj/kernel$", P(None, "fsdp", "tensor")),  # [L, hidden, mlp]
    (r"(mlp|shared_expert)/down_proj/kernel$", P(None, "tensor", "fsdp")),  # [L, mlp, hidden]
    # A mixture of experts: the experts over fsdp (each device stores its share of them, gathered
    # a layer at a time like any FSDP weight), their hidden dimension over tensor.
    (r"moe/(gate|up)_proj/kernel$", P(None, "fsdp", None, "tensor")),  # [L, experts, hidden, moe]
    (r"moe/down_proj/kernel$", P(None, "fsdp", "tensor", None)),  # [L, experts, moe, hidden]
    # LoRA adapters (`models/tuning.py`), split like the kernel they adapt: a [L, *in, rank], b [L, rank, *out]
    (r"attn/(q|k|v)_lora/a$", P(None, "fsdp", None)),
    (r"attn/(q|k|v)_lora/b$", P(None, None, "tensor", None)),
    (r"attn/o_lora/a$", P(None, "tensor", None, None)),
    (r"attn/o_lora/b$", P(None, None, "fsdp")),
    (r"mlp/(gate|up)_lora/a$", P(None, "fsdp", None)),
    (r"mlp/(gate|up)_lora/b$", P(None, None, "tensor")),
    (r"mlp/down_lora/a$", P(None, "tensor", None)),
    (r"mlp/down_lora/b$", P(None, None, "fsdp")),
    (r"moe/expert_(gate|up)_lora/a$", P(None, "fsdp", None, None)),  # [L, experts, hidden, rank]
    (r"moe/expert_(gate|up)_lora/b$", P(None, "fsdp", None, "tensor")),  # [L, experts, rank, moe]
    (r"moe/expert_down_lora/a$", P(None, "fsdp", "tensor", None)),
    (r"moe/expert_down_lora/b$", P(None, "fsdp", None, None)),
    (r".*", P()),  # norm scales, o_proj bias, routers, value head: small, replicated
)


def path_str(key_path) -> str:
    """'layers/attn/q_proj/kernel' from a pytree key path."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` padded to len(shape), with every axis that does not divide its dimension dropped."""
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the array has dims {tuple(shape)}")
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        fitted.append(axes if dim % math.prod(mesh.shape[a] for a in names) == 0 else None)
    return P(*fitted)


def spec_for(path: str, shape: Sequence[int], mesh: Mesh, rules: Rules = DEFAULT_RULES) -> P:
    for pattern, spec in rules:
        if re.search(pattern, path):
            return fit_spec(spec, shape, mesh)
    raise ValueError(f"no partition rule matches parameter {path!r}")


def param_shardings(params: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A pytree of `NamedSharding`s matching `params` (arrays or `jax.ShapeDtypeStruct`s)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, spec_for(path_str(kp), x.shape, mesh, rules)), params
    )


def sharded_init(init_fn: Callable[[jax.Array], Any], rng: jax.Array, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """Runs `init_fn(rng)` under jit so each device only ever materialises its own shards."""
    shapes = jax.eval_shape(init_fn, rng)
    return jax.jit(init_fn, out_shardings=param_shardings(shapes, mesh, rules))(rng)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dim over ("data", "fsdp"), the rest replicated: tokens, masks, activations."""
    return NamedSharding(mesh, P(BATCH_AXES))


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """Shardings for a `KVCache`: rows over the batch axes, key/value heads over `tensor`."""
    kv = P(None, BATCH_AXES, "tensor", None, None)  # [layers, batch, kv_heads, max_len, head_dim]
    specs = type(cache)(k=kv, v=kv, positions=P(BATCH_AXES, None), index=P(BATCH_AXES))
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, fit_spec(spec, x.shape, mesh)),
        specs, cache, is_leaf=lambda s: isinstance(s, P),
    )
