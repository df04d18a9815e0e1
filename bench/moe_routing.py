r"""How often the trainer routes a sampled token to other experts than the sampler did: the
"routing mismatch" of mixture-of-experts RL.

    python bench/moe_routing.py                                      # a random Qwen3-MoE shape, here
    python bench/moe_routing.py --hf_dir=hf:Qwen/Qwen3-30B-A3B --rows=8 --prompt=512 --new=256   # on an accelerator

The sampler samples `--new` tokens (temperature 1) after random `--prompt`-token prompts, a token
at a time through its KV cache, and records the experts each sampled token went to
(`TurnOutput.experts`); the trainer's pass over the same rows (no cache, the blockwise training
attention) routes them again (`forward(..., return_routing=True)`). For each (sampler, trainer)
precision pair it prints the share of (sampled token, layer) pairs whose top-k expert sets differ
(`moe.routing_mismatch`), overall and in the worst layer. float32 / float32 is the control: the
two paths route alike there (tests/test_model_families.py checks it). bfloat16 sampler weights
and cache against float32 master weights with bfloat16 compute is what an RL job runs. A random
model's routers are not a trained model's: the numbers that count come from a real checkpoint.
Last line: `summary: model=<name> pairs=<n> mismatch_f32=<x> mismatch_bf16=<x>`.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.models import decoder  # noqa: E402
from agentgym_jax.models.config import ModelConfig  # noqa: E402
from agentgym_jax.models.fetch import resolve  # noqa: E402
from agentgym_jax.models.hf_checkpoint import load_pretrained  # noqa: E402
from agentgym_jax.models.moe import routing_mismatch  # noqa: E402
from agentgym_jax.sampling.config import SamplingConfig  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler  # noqa: E402

PRECISIONS = {"f32": (jnp.float32, jnp.float32), "bf16": (jnp.bfloat16, jnp.bfloat16)}  # name -> (sampler, trainer compute)


def measure(config: ModelConfig, params, rows: int, prompt: int, new: int, sampler_dtype, trainer_dtype, seed: int):
    """(mismatch over every layer, per-layer mismatch [layers], sampled tokens) of one precision pair."""
    sampler = Sampler.for_decoder(config, SamplingConfig(max_new_tokens=new, temperature=1.0),
                                  max_cache_len=prompt + new, dtype=sampler_dtype)
    weights = sampler.sampling_params(params)
    prompts = np.random.default_rng(seed).integers(3, config.vocab_size, (rows, prompt)).tolist()
    _, turn = sampler.generate(weights, sampler.prefill(weights, prompts), jax.random.key(seed))
    tokens = np.zeros((rows, prompt + new), np.int32)
    tokens[:, :prompt] = prompts
    tokens[:, prompt:] = turn.tokens
    length = prompt + turn.count
    positions = np.where(np.arange(prompt + new)[None] < length[:, None], np.arange(prompt + new)[None], -1).astype(np.int32)
    run = jax.jit(functools.partial(decoder.forward, config=config, dtype=trainer_dtype, return_routing=True))
    trained = np.asarray(run(params, tokens, positions)[2].experts)  # [layers, rows, seq, k]
    sampled = (np.arange(prompt + new)[None] >= prompt) & (positions >= 0)
    recorded = np.full(trained.shape, -1, np.int32)
    recorded[:, :, prompt:] = turn.experts.transpose(2, 0, 1, 3)
    per_layer = [float(routing_mismatch(recorded[i : i + 1], trained[i : i + 1], sampled)) for i in range(config.num_layers)]
    return float(routing_mismatch(recorded, trained, sampled)), per_layer, int(sampled.sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf_dir", default="", help="a folder or hf:<org>/<name>; empty: a random qwen3_moe shape")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.hf_dir:
        config, params = load_pretrained(resolve(args.hf_dir))
        name = pathlib.Path(args.hf_dir).name
    else:
        config = ModelConfig.small("qwen3_moe", vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4,
                                   num_experts=args.experts, num_experts_per_tok=args.top_k,
                                   moe_intermediate_size=args.hidden // 2)
        params = decoder.init_params(config, jax.random.key(args.seed))
        name = f"random-qwen3_moe-L{args.layers}-d{args.hidden}-e{args.experts}k{args.top_k}"
    if not config.moe:
        raise SystemExit(f"{name} is {config.family}, not a mixture of experts")
    print(f"model={name} layers={config.num_layers} experts={config.num_experts} top_k={config.num_experts_per_tok} "
          f"rows={args.rows} prompt={args.prompt} new={args.new} on {jax.default_backend()}\n")
    print("| sampler | trainer compute | sampled tokens | mismatch | worst layer |")
    print("| --- | --- | ---: | ---: | ---: |")
    results = {}
    for label, (sampler_dtype, trainer_dtype) in PRECISIONS.items():
        mismatch, per_layer, pairs = measure(config, params, args.rows, args.prompt, args.new, sampler_dtype,
                                             trainer_dtype, args.seed)
        results[label] = mismatch
        worst = int(np.argmax(per_layer))
        print(f"| {jnp.dtype(sampler_dtype).name} | {jnp.dtype(trainer_dtype).name} | {pairs} | {mismatch:.4f} | "
              f"{per_layer[worst]:.4f} (layer {worst}) |")
    print(f"\nsummary: model={name} pairs={pairs * config.num_layers} mismatch_f32={results['f32']:.4f} "
          f"mismatch_bf16={results['bf16']:.4f}")


if __name__ == "__main__":
    main()
