"""Which attention implementation each path of the decoder uses, and the Pallas kernels.

The XLA paths (`decoder.flash_attention` for training rows and prefills, `grouped_attention` for
a decode step) run on every backend and are the reference. Two Pallas kernels of the pinned JAX
replace them where they exist:
- training rows on TPU: splash attention (`splash_attention`), blockwise and causal, with
  segment ids for padding;
- a decode step on GPU: the Triton ragged decode kernel (`ragged_decode_attention`), which reads
  only each row's filled cache slots (`index[b] + 1` of them), not the whole bucket.

Each is exact under one precondition that the project's batches and caches hold by construction:
- training rows have their real tokens at increasing positions and padding at -1
  (`rollout.batch.make_token_batch` puts them at 0 .. n-1). Then "causal by position, padding
  sees nothing" is splash's causal mask with segment ids 1 (real) and 0 (padding);
- a row's cache slots `0 .. index[b]` hold its real tokens and later slots are empty
  (`models.cache`; fresh rows and copied prefixes reset them). Then the positional decode mask
  is "slot < index[b] + 1" once the step's own key is written.
Padded queries give other (finite, ignored) values than the XLA path's; real ones agree.

Under a mesh each kernel runs per shard (`jax.shard_map`: rows over the batch axes, heads over
`tensor` where they divide), since XLA cannot partition a Pallas call. `interpret=True` runs a
kernel's semantics on any backend: how the parity tests check them on a CPU, far too slow to
train with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from agentgym_jax.parallel.partition import fit_spec

Axes = str | tuple[str, ...] | None  # mesh axes of one array dimension
ATTENTION_BLOCK = 512  # query and key positions per attention block (the score tile is block x block)
TRAINING_KERNELS = ("xla", "splash")
DECODE_KERNELS = ("xla", "triton")
MOE_DISPATCH = ("dense", "ragged")  # the dispatches of `models.moe` (kept here: moe imports nothing of kernels)
_NATIVE = {"splash": "tpu", "triton": "gpu"}  # the backend each Pallas kernel is written for
_LANES = 128  # splash tiles are multiples of the TPU lane width


@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """The decoder's attention implementations (hashable: a static argument of jitted steps).

    `training`: rows without a cache (losses, `prepare`); `decode`: one-token steps on a cache;
    `block`: the tile of the blockwise paths; `interpret`: Pallas kernels in interpret mode.
    """

    training: str = "xla"
    decode: str = "xla"
    block: int = ATTENTION_BLOCK
    interpret: bool = False
    moe_dispatch: str = "dense"  # how a mixture of experts reaches its experts: one of MOE_DISPATCH (`models.moe`)

    def __post_init__(self):
        for name, label, valid in (("training", "training attention kernel", TRAINING_KERNELS),
                                   ("decode", "decode attention kernel", DECODE_KERNELS),
                                   ("moe_dispatch", "moe_dispatch", MOE_DISPATCH)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{label} {getattr(self, name)!r} is not one of {', '.join(valid)}")
        if self.block < 1:
            raise ValueError(f"attention block must be >= 1, got {self.block}")

    @classmethod
    def for_backend(cls, training: str = "auto", decode: str = "auto", backend: str | None = None,
                    moe_dispatch: str = "auto") -> AttentionKernels:
        """"auto" picks the Pallas kernel on the backend it is written for, XLA elsewhere; a Pallas
        kernel named on another backend is an error (interpret mode is for tests only). A mixture
        of experts dispatches by grouped matmuls ("ragged") on accelerators, densely on the CPU,
        where `ragged_dot` is a masked dense product anyway."""
        backend = backend or jax.default_backend()
        if moe_dispatch == "auto":
            moe_dispatch = "dense" if backend == "cpu" else "ragged"

        def pick(kind: str, name: str, valid: tuple[str, ...]) -> str:
            if name == "auto":
                return next((k for k in valid if _NATIVE.get(k) == backend), "xla")
            if name in _NATIVE and _NATIVE[name] != backend:
                raise ValueError(
                    f"{kind} attention kernel {name!r} runs on {_NATIVE[name]}, not {backend}; use 'xla' or 'auto'"
                )
            return name

        return cls(training=pick("training", training, TRAINING_KERNELS), decode=pick("decode", decode, DECODE_KERNELS),
                   moe_dispatch=moe_dispatch)


def _shard_spec(mesh: Mesh, batch_axes: Axes, shape: tuple[int, ...], heads_dim: int, kv_heads: int) -> P:
    """Rows over `batch_axes`, heads over "tensor" when both head counts divide it."""
    spec = [None] * len(shape)
    spec[0] = batch_axes
    if "tensor" in mesh.shape and kv_heads % mesh.shape["tensor"] == 0:
        spec[heads_dim] = "tensor"
    return fit_spec(P(*spec), shape, mesh)


def _per_shard(
    fn: Callable, mesh: Mesh | None, batch_axes: Axes, args: tuple, heads_dims: tuple[int | None, ...], kv_heads: int
) -> jax.Array:
    """`fn(*args)` on each shard of `mesh` (rows and heads split as `_shard_spec`); output laid
    out like the first argument. Without a mesh: `fn(*args)`."""
    if mesh is None:
        return fn(*args)
    specs = tuple(
        _shard_spec(mesh, batch_axes, x.shape, h, kv_heads) if h is not None else fit_spec(P(batch_axes), x.shape, mesh)
        for x, h in zip(args, heads_dims)
    )
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    block: int = ATTENTION_BLOCK,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    mesh: Mesh | None = None,
    batch_axes: Axes = None,
    interpret: bool = False,
) -> jax.Array:
    """`decoder.flash_attention(q, k, v, positions, positions, window=..., scale=..., softcap=...)`
    by TPU splash attention.

    q [batch, seq, heads, head_dim]; k, v [batch, kv_heads, seq, head_dim]; positions [batch, seq]
    (real tokens at increasing positions, padding -1). A sliding `window` is splash's local mask,
    which skips the tiles outside the band. Returns [batch, seq, heads, head_dim].
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    _, seq, _, head_dim = q.shape
    tile = max(_LANES, min(block, -(-seq // _LANES) * _LANES) // _LANES * _LANES)
    padded = -(-seq // tile) * tile
    segments = (positions >= 0).astype(jnp.int32)
    scale = head_dim**-0.5 if scale is None else scale
    q = (q * scale).astype(q.dtype).swapaxes(1, 2)  # [batch, heads, seq, head_dim]
    if padded > seq:  # padded columns: segment 0, like padding
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - seq), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, padded - seq), (0, 0))) for x in (k, v))
        segments = jnp.pad(segments, ((0, 0), (0, padded - seq)))

    def attend(q, k, v, segments):
        sizes = splash.BlockSizes(
            block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile, block_kv_dkv=tile,
            block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile,
        )
        shape = (padded, padded)
        causal = masks.CausalMask(shape) if window is None else masks.LocalMask(shape, (window - 1, 0), offset=0)
        kernel = splash.make_splash_mha(masks.MultiHeadMask([causal] * q.shape[1]), block_sizes=sizes, head_shards=1,
                                        q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(q, k, v, segments)

    out = _per_shard(attend, mesh, batch_axes, (q, k, v, segments), (1, 1, 1, None), k.shape[1])
    return out[:, :, :seq].swapaxes(1, 2)


def ragged_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    starts: jax.Array | None = None,
    *,
    scale: float | None = None,
    mesh: Mesh | None = None,
    batch_axes: Axes = None,
    interpret: bool = False,
) -> jax.Array:
    """One decode step's attention over each row's cache slots `starts[b] .. lengths[b] - 1` (all
    from 0 without `starts`; a sliding window's start otherwise), by the GPU (Triton) ragged decode
    kernel: work per row follows its own length, not the bucket's.

    q [batch, 1, heads, head_dim]; k, v [batch, kv_heads, slots, head_dim] (the cache, the step's
    key already written); lengths, starts [batch] int; scores scaled by `scale` (default
    head_dim ** -0.5; no soft cap). Returns [batch, 1, heads, head_dim].
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    slots = k.shape[2]
    if slots % 16:
        raise ValueError(f"the triton decode kernel needs a cache of a multiple of 16 slots, got {slots}")
    # The kernel splits the slots into `splits` parts (one program each) read in key blocks of a
    # power of two of at least 16 (Triton's tiles).
    block_k = next(b for b in (128, 64, 32, 16) if slots % b == 0)
    splits = next(s for s in (16, 8, 4, 2, 1) if slots % (s * block_k) == 0)

    starts = jnp.zeros_like(lengths) if starts is None else starts

    def attend(q, k, v, lengths, starts):
        # gqa takes keys slot-major; the swap undoes its own, so XLA moves no cache bytes.
        return decode_attention.gqa(
            q[:, 0], k.swapaxes(1, 2), v.swapaxes(1, 2), start_idx=starts, kv_seq_len=lengths, sm_scale=scale,
            k_splits=splits, block_k=block_k, interpret=interpret,
        )[:, None]

    args = (q, k, v, lengths.astype(jnp.int32), starts.astype(jnp.int32))
    return _per_shard(attend, mesh, batch_axes, args, (2, 1, 1, None, None), k.shape[1])
