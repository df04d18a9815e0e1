"""Hugging Face checkpoints in and out: safetensors folders <-> the decoder's parameter pytree.

Loading never touches PyTorch and never holds two full copies of the model in host memory: each
parameter is built with `jax.make_array_from_callback`, so each device reads only its slice of
the safetensors file (stacked layers read per-layer slices), straight into the target sharding.
Export writes config.json plus `model.safetensors` (or numbered shards with an index above
`max_shard_bytes`) that `transformers.AutoModelForCausalLM.from_pretrained` loads, and copies
the tokenizer files of a source folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from agentgym_jax.models.config import ModelConfig, load_config
from agentgym_jax.models.decoder import Params, init_params
from agentgym_jax.parallel.partition import path_str

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(ValueError):
    """A checkpoint folder that does not match the model it is loaded into."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one of our parameters is stored in the HF file.

    The HF tensor, reshaped so that its dims are the flattened `groups` (each group is one HF dim
    split into factors), then transposed by `perm`, is our array; stacked parameters have one HF
    tensor per layer (`{layer}` in the name) and a leading [layers] axis on our side, and a
    mixture of experts' weights one per layer and expert (`{expert}` too) and [layers, experts].
    """

    name: str
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def stacks(self) -> tuple[str, ...]:
        """The stacked axes in front of ours: () | ("layer",) | ("layer", "expert")."""
        return tuple(axis for axis in _STACKS if "{" + axis + "}" in self.name)

    def names(self, config: ModelConfig) -> Iterator[tuple[tuple[int, ...], str]]:
        """(index on the stacked axes, HF name) of each of its HF tensors, in file order."""
        counts = {"layer": config.num_layers, "expert": config.num_experts}
        for index in itertools.product(*(range(counts[axis]) for axis in self.stacks)):
            yield index, self.name.format(**dict(zip(self.stacks, index)))


_STACKS = ("layer", "expert")


def _layouts(config: ModelConfig) -> dict[str, _Layout]:
    """Our parameter path ('layers/attn/q_proj/kernel') -> its HF layout."""
    c = config
    d, f, v, hd = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    layer = "model.layers.{layer}."
    table = {
        "embed/embedding": ("model.embed_tokens.weight", ((v,), (d,)), (0, 1)),
        "lm_head": ("lm_head.weight", ((v,), (d,)), (1, 0)),
        "final_norm/scale": ("model.norm.weight", ((d,),), (0,)),
        "layers/attn_norm/scale": (layer + "input_layernorm.weight", ((d,),), (0,)),
        "layers/mlp_norm/scale": (layer + "post_attention_layernorm.weight", ((d,),), (0,)),
        "layers/attn/o_proj/kernel": (layer + "self_attn.o_proj.weight", ((d,), (c.num_heads, hd)), (1, 2, 0)),
        "layers/attn/o_proj/bias": (layer + "self_attn.o_proj.bias", ((d,),), (0,)),
        "layers/attn/q_norm/scale": (layer + "self_attn.q_norm.weight", ((hd,),), (0,)),
        "layers/attn/k_norm/scale": (layer + "self_attn.k_norm.weight", ((hd,),), (0,)),
        "layers/mlp/gate_proj/kernel": (layer + "mlp.gate_proj.weight", ((f,), (d,)), (1, 0)),
        "layers/mlp/up_proj/kernel": (layer + "mlp.up_proj.weight", ((f,), (d,)), (1, 0)),
        "layers/mlp/down_proj/kernel": (layer + "mlp.down_proj.weight", ((d,), (f,)), (1, 0)),
    }
    for proj, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
        name = layer + f"self_attn.{proj}_proj."
        table[f"layers/attn/{proj}_proj/kernel"] = (name + "weight", ((heads, hd), (d,)), (2, 0, 1))
        table[f"layers/attn/{proj}_proj/bias"] = (name + "bias", ((heads, hd),), (0, 1))
    if c.sandwich_norms:  # Gemma: post_attention_layernorm is the norm after attention, not before the MLP
        for ours, theirs in (("post_attn_norm", "post_attention_layernorm"), ("mlp_norm", "pre_feedforward_layernorm"),
                             ("post_mlp_norm", "post_feedforward_layernorm")):
            table[f"layers/{ours}/scale"] = (layer + f"{theirs}.weight", ((d,),), (0,))
    if c.moe:
        m, s = c.moe_intermediate_size, c.shared_expert_intermediate_size
        expert = layer + "mlp.experts.{expert}."
        table["layers/moe/router/kernel"] = (layer + "mlp.gate.weight", ((c.num_experts,), (d,)), (1, 0))
        table["layers/moe/gate_proj/kernel"] = (expert + "gate_proj.weight", ((m,), (d,)), (1, 0))
        table["layers/moe/up_proj/kernel"] = (expert + "up_proj.weight", ((m,), (d,)), (1, 0))
        table["layers/moe/down_proj/kernel"] = (expert + "down_proj.weight", ((d,), (m,)), (1, 0))
        shared = layer + "mlp.shared_expert."
        table["layers/shared_expert/gate_proj/kernel"] = (shared + "gate_proj.weight", ((s,), (d,)), (1, 0))
        table["layers/shared_expert/up_proj/kernel"] = (shared + "up_proj.weight", ((s,), (d,)), (1, 0))
        table["layers/shared_expert/down_proj/kernel"] = (shared + "down_proj.weight", ((d,), (s,)), (1, 0))
        table["layers/shared_expert_gate/kernel"] = (layer + "mlp.shared_expert_gate.weight", ((1,), (d,)), (1, 0))
    return {path: _Layout(*spec) for path, spec in table.items()}


def param_shapes(config: ModelConfig, dtype: jnp.dtype = jnp.float32) -> Params:
    """The parameter pytree as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return jax.eval_shape(lambda rng: init_params(config, rng, param_dtype=dtype), jax.random.key(0))


# ----------------------------------------------------------------------------------------------
# Loading


class _Tensors:
    """Open safetensors files of one folder; `name -> file` from the index when sharded."""

    def __init__(self, folder: str, stack: contextlib.ExitStack):
        index_path = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            weight_map = None
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder!r}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        self._handles = {
            name: stack.enter_context(safe_open(os.path.join(folder, name), framework="numpy")) for name in files
        }
        self._file_of = weight_map or {k: SINGLE_FILE for k in self._handles[SINGLE_FILE].keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def slice(self, name: str):
        return self._handles[self._file_of[name]].get_slice(name)


def _read(tensors: _Tensors, layout: _Layout, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The part `index` (on our side, unstacked) of HF tensor `name`, in our layout.

    Each HF dim is read over the range that covers the requested slice of its leading factor,
    so a device that holds 1/n of the heads reads 1/n of the rows.
    """
    split_index: list[slice] = [slice(None)] * len(layout.perm)
    for ours, split_dim in enumerate(layout.perm):
        split_index[split_dim] = index[ours]
    hf_index, local_shape, local_index = [], [], []
    dim = 0
    for group in layout.groups:
        start, stop, _ = split_index[dim].indices(group[0])
        inner = math.prod(group[1:])
        hf_index.append(slice(start * inner, stop * inner))
        local_shape.extend((stop - start, *group[1:]))
        local_index.extend((slice(None), *split_index[dim + 1 : dim + len(group)]))
        dim += len(group)
    part = tensors.slice(name)[tuple(hf_index)]
    return part.reshape(local_shape)[tuple(local_index)].transpose(layout.perm)


def _read_stacked(tensors: _Tensors, layout: _Layout, index: tuple[slice, ...], shape: tuple[int, ...],
                  at: dict[str, int]) -> np.ndarray:  # `at`: the stacked axes' indices chosen so far
    """The part `index` of our (stacked) array: its stacked axes' HF tensors read one by one."""
    depth = len(at)
    if depth == len(layout.stacks):
        return _read(tensors, layout, layout.name.format(**at), index[depth:])
    axis = layout.stacks[depth]
    return np.stack([_read_stacked(tensors, layout, index, shape, {**at, axis: i})
                     for i in range(*index[depth].indices(shape[depth]))])


def _check_tensors(tensors: _Tensors, config: ModelConfig, shapes: Mapping[str, Any]) -> None:
    """Names every missing tensor and every tensor whose shape differs from the config's."""
    layouts = _layouts(config)
    missing, wrong = [], []
    for path in shapes:
        layout = layouts[path]
        for _, name in layout.names(config):
            if name not in tensors:
                missing.append(name)
                continue
            got = tuple(tensors.slice(name).get_shape())
            if got != layout.hf_shape:
                wrong.append(f"{name}: expected {layout.hf_shape}, got {got}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")
    if wrong:
        raise CheckpointError("tensor(s) with the wrong shape: " + "; ".join(wrong))


def tokenizer_size(folder: str | os.PathLike) -> int | None:
    """1 + the largest token id of the tokenizer saved in `folder` (None if it has none)."""
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from tokenizers import Tokenizer  # noqa: PLC0415 (only needed when a tokenizer is present)

        vocab = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab(with_added_tokens=True)
        return max(vocab.values()) + 1
    if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        from transformers import AutoTokenizer  # noqa: PLC0415

        return len(AutoTokenizer.from_pretrained(folder))
    return None


def check_tokenizer(folder: str | os.PathLike, config: ModelConfig) -> None:
    """Refuses a tokenizer with ids the embedding has no row for."""
    size = tokenizer_size(folder)
    if size is not None and size > config.vocab_size:
        raise CheckpointError(
            f"tokenizer in {os.fspath(folder)!r} has {size} token ids but the model's embedding has "
            f"only {config.vocab_size} rows (vocab_size)"
        )


def load_pretrained(
    folder: str | os.PathLike,
    *,
    dtype: jnp.dtype = jnp.float32,
    shardings: Any = None,
    config: ModelConfig | None = None,
) -> tuple[ModelConfig, Params]:
    """Reads a local Hugging Face model folder into (config, params), without PyTorch.

    `shardings`: a pytree of `jax.sharding.Sharding` matching the params (see
    `parallel.partition.param_shardings`), one sharding for all, or None (first device).
    `config` overrides the folder's config.json. Tokenizer files in the folder are checked
    against the vocabulary size.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder {folder!r} does not exist")
    config = config or load_config(folder)
    check_tokenizer(folder, config)
    shapes = param_shapes(config, dtype)
    flat_shapes = {path_str(kp): s for kp, s in jax.tree_util.tree_flatten_with_path(shapes)[0]}
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, shapes)
    flat_shardings = {path_str(kp): s for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    layouts = _layouts(config)

    with contextlib.ExitStack() as stack:
        tensors = _Tensors(folder, stack)
        _check_tensors(tensors, config, flat_shapes)

        def build(path: str, shape: jax.ShapeDtypeStruct) -> jax.Array:
            layout = layouts[path]
            reads: dict[tuple, np.ndarray] = {}  # replicated slices are read once, not once per device

            def callback(index: tuple[slice, ...]) -> np.ndarray:
                key = tuple(s.indices(n) for s, n in zip(index, shape.shape))
                if key not in reads:
                    reads[key] = _read_stacked(tensors, layout, index, shape.shape, {}).astype(shape.dtype)
                return reads[key]

            return jax.make_array_from_callback(shape.shape, flat_shardings[path], callback)

        flat = {path: build(path, shape) for path, shape in flat_shapes.items()}
    params = jax.tree_util.tree_map_with_path(lambda kp, _: flat[path_str(kp)], shapes)
    return config, params


# ----------------------------------------------------------------------------------------------
# Export


def _to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-host sharded) array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _hf_tensors(params: Params, config: ModelConfig) -> Iterator[tuple[str, _Layout, jax.Array]]:
    """(HF name, layout, our array for that tensor) for every tensor of the export, in file order."""
    layouts = _layouts(config)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        layout = layouts[path_str(key_path)]
        for index, name in layout.names(config):
            yield name, layout, leaf[index]


def _to_hf(x: jax.Array, layout: _Layout, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(_to_host(x).transpose(np.argsort(layout.perm)).reshape(layout.hf_shape).astype(dtype))


def save_pretrained(
    params: Params,
    config: ModelConfig,
    folder: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 2**30,
) -> None:
    """Writes config.json and safetensors weights (sharded with an index above `max_shard_bytes`).

    `dtype` is the storage dtype ("float32", "bfloat16", "float16"; default: `config.dtype`).
    Tokenizer files of `tokenizer_dir` are copied after checking they fit the vocabulary.
    A value head is not part of a Hugging Face causal LM and is left out. Every process of a
    multi-host job must call this (arrays are gathered); only process 0 writes.
    """
    folder = os.fspath(folder)
    dtype = dtype or config.dtype
    config = dataclasses.replace(config, dtype=dtype)
    np_dtype = np.dtype(jnp.dtype(dtype))
    params = {name: p for name, p in params.items() if name != "value_head"}
    expected = {path_str(kp): s.shape for kp, s in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    got = {path_str(kp): tuple(x.shape) for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if expected != got:
        diffs = [f"{p}: expected {expected.get(p)}, got {got.get(p)}" for p in sorted(expected.keys() | got.keys())
                 if expected.get(p) != got.get(p)]
        raise CheckpointError("params do not match the config: " + "; ".join(diffs))
    if tokenizer_dir is not None:
        check_tokenizer(tokenizer_dir, config)
    writer = jax.process_index() == 0

    if writer:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config.to_hf_dict(), f, indent=2)
    entries = [
        (name, math.prod(layout.hf_shape) * np_dtype.itemsize, functools.partial(_to_hf, x, layout, np_dtype))
        for name, layout, x in _hf_tensors(params, config)
    ]
    write_tensors(folder, entries, max_shard_bytes=max_shard_bytes, write=writer)
    if writer and tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            source = os.path.join(tokenizer_dir, name)
            if os.path.isfile(source):
                shutil.copy(source, os.path.join(folder, name))


def write_tensors(
    folder: str | os.PathLike,
    entries: Sequence[tuple[str, int, Callable[[], np.ndarray]]],
    *,
    max_shard_bytes: int = 4 * 2**30,
    write: bool = True,
    progress: bool = False,
) -> None:
    """Writes `(name, bytes, make)` tensors as `model.safetensors`, or as numbered shards of at most
    `max_shard_bytes` with an index, making one shard's arrays at a time (never the whole model).

    Every `make` is called even where `write` is False (a multi-host export gathers in it).
    """
    shards: list[list[tuple[str, int, Callable[[], np.ndarray]]]] = [[]]
    shard_bytes = 0
    for entry in entries:
        if shards[-1] and shard_bytes + entry[1] > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += entry[1]
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    bar = tqdm.tqdm(total=len(entries), desc="writing tensors", unit="tensor", disable=not progress)
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        tensors = {}
        for name, _, make in shard:
            tensors[name] = make()
            bar.update()
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: file_name for name in tensors})
        if write:
            os.makedirs(folder, exist_ok=True)
            save_file(tensors, os.path.join(folder, file_name), metadata={"format": "pt"})
        del tensors
    bar.close()
    if write and len(shards) > 1:
        with open(os.path.join(folder, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
