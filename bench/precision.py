"""bfloat16 against float32 compute on this machine, at a real model's shape: an SFT update, the
scoring pass of an RL step (`prepare`: log-probs of every token), and sampler decode steps.

    python bench/precision.py                                  # SmolLM2-135M-Instruct (pretrained:)
    python bench/precision.py --model=/path/to/hf_folder --batch 8 --seq 512 --decode-batch 32

Both precisions run the same jitted code in one process, in alternating rounds (best of
`--rounds` each), so load on a shared machine hits both alike. Parameters stay float32 master
weights for the update (compute in the named dtype, gradients accumulated in float32); the
sampler's weights and KV cache are held in the compute dtype, as the jobs hold them. On CPUs
without native bfloat16 arithmetic XLA converts around every dot, and bfloat16 can be slower.
Last line: `summary: sft_bf16_speedup=<x> score_bf16_speedup=<y> decode_bf16_speedup=<z>`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from agentgym_jax.models import fetch  # noqa: E402
from agentgym_jax.models.hf_checkpoint import load_pretrained  # noqa: E402
from agentgym_jax.sampling.config import SamplingConfig  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler  # noqa: E402
from agentgym_jax.train.state import TrainState  # noqa: E402
from agentgym_jax.train.scoring import Forward  # noqa: E402
from agentgym_jax.train.steps import RLSpec, UpdateConfig, make_step_fns  # noqa: E402
from train_step import random_batch  # noqa: E402

DTYPES = ("float32", "bfloat16")


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pretrained:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=8, help="rows of the SFT update and of scoring")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model, params = load_pretrained(fetch.resolve(args.model))
    batch = random_batch(args.batch, args.seq, model.vocab_size, group_size=args.batch)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.vocab_size, args.prompt_len).tolist() for _ in range(args.decode_batch)]
    work = {}
    for dtype in DTYPES:
        config = UpdateConfig(Forward(model, compute_dtype=dtype), rl=RLSpec(kl_coef=0.0))
        fns = make_step_fns(config)
        state = TrainState.create(jax.tree.map(jnp.copy, params), optax.adamw(1e-6), jax.random.PRNGKey(1))
        sampler = Sampler.for_decoder(model, SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0),
                                      max_cache_len=args.prompt_len + args.new_tokens, dtype=dtype)
        weights = jax.tree.map(lambda x: x.astype(dtype), params)

        states = {"sft": state}  # the update donates its state: each call continues from the last

        def sft(fns=fns, states=states):
            states["sft"], metrics = fns.sft_update(states["sft"], batch)
            return metrics

        def score(fns=fns, states=states):
            return fns.prepare(states["sft"].params, states["sft"].params, batch)[1]

        def decode(sampler=sampler, weights=weights):
            state = sampler.prefill(weights, prompts)
            return sampler.generate(weights, state, jax.random.key(0))[1].count

        prefill_only = lambda sampler=sampler, weights=weights: sampler.prefill(weights, prompts)  # noqa: E731
        work[dtype] = dict(sft=sft, score=score, decode=decode, prefill=prefill_only)
        for fn in work[dtype].values():  # compile
            jax.block_until_ready(fn())
    best = {(d, k): float("inf") for d in DTYPES for k in work[d]}
    for _ in range(args.rounds):
        for dtype in DTYPES:
            for name, fn in work[dtype].items():
                best[dtype, name] = min(best[dtype, name], timed(fn))
    tokens = args.batch * args.seq
    rates = {}
    for dtype in DTYPES:
        decode_s = max(best[dtype, "decode"] - best[dtype, "prefill"], 1e-9)
        rates[dtype] = {
            "sft": tokens / best[dtype, "sft"],
            "score": tokens / best[dtype, "score"],
            "decode": args.decode_batch * args.new_tokens / decode_s,
        }
    print(f"model: {args.model} ({model.num_layers} layers, hidden {model.hidden_size}) | devices: {jax.devices()[0].device_kind}")
    print("| tokens/s | float32 | bfloat16 | bf16 / f32 |\n| --- | ---: | ---: | ---: |")
    labels = {"sft": f"SFT update ({args.batch} x {args.seq})", "score": f"scoring ({args.batch} x {args.seq})",
              "decode": f"decode ({args.decode_batch} rows, {args.new_tokens} new)"}
    for key, label in labels.items():
        f32, bf16 = rates["float32"][key], rates["bfloat16"][key]
        print(f"| {label} | {f32:.0f} | {bf16:.0f} | {bf16 / f32:.2f} |")
    ratio = {k: rates["bfloat16"][k] / rates["float32"][k] for k in labels}
    print(f"summary: sft_bf16_speedup={ratio['sft']:.2f} score_bf16_speedup={ratio['score']:.2f} "
          f"decode_bf16_speedup={ratio['decode']:.2f}")


if __name__ == "__main__":
    main()
