"""Throughput of the jitted GRPO update (`prepare` + `rl_update`) and its achieved FLOP/s as a
fraction of a large float32 matmul's FLOP/s measured in the same run on the same device.

    python bench/train_step.py                   # Qwen2, 4 layers, hidden 512, vocab 4096, 16 x 512 tokens
    python bench/train_step.py --layers 2 --seq 128 --rounds 2   # a quick look
    python bench/train_step.py --model=pretrained:smollm2-135m-instruct --batch 8 --seq 512 \
        [--compute-dtype bfloat16] [--lora-rank 16] [--trainable-layers 8]    # a real model, tuned

One update is GRPO as the RL job runs it: `prepare` (policy and reference forward: log-probs,
entropy, advantages) then `rl_update` with `--ppo-epochs` epochs of one mini-batch (forward +
backward + AdamW). Model FLOPs per update, counting matmuls only (2 FLOPs per multiply-add):

    FLOPs = (1 + [kl_coef > 0] + 3 * ppo_epochs) * (2 * N * B * T  +  4 * L * d_attn * B * T^2)

i.e. `prepare` runs the policy forward (and the reference's), every epoch a forward and a
backward (two forwards' worth). N is the matmul parameters (attention, MLP, LM head; not the
embedding lookup), B x T the batch, L layers and d_attn = heads * head_dim (QK^T and AV each
2 * d_attn FLOPs per query-key pair; the masked causal half is computed too, so T^2, not
T^2 / 2). Per epoch this is the usual 6 * N * tokens + 12 * L * d_attn * T^2 per sequence for
forward + backward; `prepare` adds 1 or 2 forward-only passes. Remat recomputation is not
counted (model FLOPs, as in MFU).
XLA's own count (`compiled.cost_analysis()["flops"]`) is printed next to it: it counts every
op but each `while` body once, so the scanned layers (and epochs, mini- and micro-batches) only
once; it is a lower bound, not the number the fraction uses.

The reference is a jitted `--matmul` x `--matmul` float32 matmul (2 n^3 FLOPs), best of 5. The
update and the matmul are timed in alternating rounds, best of `--rounds` each, so load from
other processes on a shared machine hits both alike. Last line:
`summary: update_tokens_per_s=<x> flops_fraction_of_matmul=<f>`.
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

from agentgym_jax.models import fetch, tuning  # noqa: E402
from agentgym_jax.models.config import ModelConfig  # noqa: E402
from agentgym_jax.models.decoder import init_params  # noqa: E402
from agentgym_jax.models.hf_checkpoint import load_pretrained  # noqa: E402
from agentgym_jax.rollout.batch import TokenBatch  # noqa: E402
from agentgym_jax.train.state import TrainState  # noqa: E402
from agentgym_jax.train.scoring import Forward  # noqa: E402
from agentgym_jax.train.steps import Batching, RLSpec, UpdateConfig, make_step_fns  # noqa: E402


def random_batch(rows: int, seq: int, vocab: int, group_size: int, seed: int = 0) -> TokenBatch:
    """Full-length rows, a prompt of seq/4 tokens then policy tokens, 0/1 outcome rewards."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, seq // 4 :] = 1
    scores = rng.integers(0, 2, rows).astype(np.float32)
    token_rewards = np.zeros((rows, seq), np.float32)
    token_rewards[:, -1] = scores
    return TokenBatch(
        tokens=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
        loss_mask=mask,
        old_logprobs=np.zeros((rows, seq), np.float32),
        token_rewards=token_rewards,
        group_ids=(np.arange(rows) // group_size).astype(np.int32),
        scores=scores,
    )


def bench_model(layers: int, hidden: int, vocab: int) -> ModelConfig:
    """A Qwen2-style decoder with 64-wide heads, a key/value head per 256 of width, MLP 3x wide."""
    return ModelConfig.small(
        "qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_layers=layers, num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
    )


def matmul_params(m: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: attention, MLP, LM head."""
    attn = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)  # q, o, k, v
    mlp = 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * (attn + mlp) + m.hidden_size * m.vocab_size


def model_flops(m: ModelConfig, rows: int, seq: int, config: UpdateConfig) -> float:
    """Matmul FLOPs of one prepare + rl_update (see the module docstring), full training: what the
    update would cost with every parameter trained (a tuned update does less of it, faster)."""
    forward = 2 * matmul_params(m) * rows * seq + 4 * m.num_layers * m.num_heads * m.head_dim * rows * seq**2
    passes = 1 + (1 if config.rl.uses_reference else 0) + 3 * config.batching.ppo_epochs
    return passes * forward


def xla_flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return float(analysis.get("flops", float("nan")))


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--kl-coef", type=float, default=0.001)  # the GRPO configs' KL loss
    parser.add_argument("--compute-dtype", default=None, help="e.g. bfloat16; default: the params' float32")
    parser.add_argument("--model", default="", help="a Hugging Face folder, pretrained:<name> or hf:<org>/<name> "
                        "(its shape replaces --layers/--hidden/--vocab)")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--trainable-layers", type=int, default=0)
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--matmul", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    if args.model:
        model, params = load_pretrained(fetch.resolve(args.model))
    else:
        model = bench_model(args.layers, args.hidden, args.vocab)
        params = init_params(model, jax.random.PRNGKey(0))
    spec = tuning.Tuning(lora_rank=args.lora_rank, trainable_layers=args.trainable_layers)
    config = UpdateConfig(Forward(model, compute_dtype=args.compute_dtype, remat=args.remat, lora_scale=spec.lora_scale),
                          Batching(ppo_epochs=args.ppo_epochs), RLSpec(kl_coef=args.kl_coef))
    fns = make_step_fns(config)
    trainable, frozen = tuning.split(params, spec, jax.random.PRNGKey(4), frozen_dtype=args.compute_dtype)
    ref_params = jax.tree.map(jnp.copy, trainable)
    state = TrainState.create(trainable, optax.adamw(1e-6), jax.random.PRNGKey(1), frozen=frozen)
    batch = random_batch(args.batch, args.seq, model.vocab_size, group_size=8)
    tokens = args.batch * args.seq

    start = time.perf_counter()
    prepare = fns.prepare.lower(state.policy_params, state.policy_of(ref_params), batch).compile()
    rl_batch, _ = prepare(state.policy_params, state.policy_of(ref_params), batch)
    rl_update = fns.rl_update.lower(state, rl_batch).compile()
    state, metrics = rl_update(state, rl_batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    flops_xla = xla_flops(prepare) + xla_flops(rl_update)

    a = jax.random.normal(jax.random.PRNGKey(2), (args.matmul, args.matmul), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(3), (args.matmul, args.matmul), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))

    def update():
        nonlocal state
        rl_batch, _ = prepare(state.policy_params, state.policy_of(ref_params), batch)
        state, metrics = rl_update(state, rl_batch)
        return metrics

    update_s = matmul_s = float("inf")
    for _ in range(args.rounds):  # alternate, so that load on the machine hits both alike
        matmul_s = min(matmul_s, best_seconds(lambda: matmul(a, b), 5))
        update_s = min(update_s, best_seconds(update, 1))

    flops_model = model_flops(model, args.batch, args.seq, config)
    matmul_flops_s = 2 * args.matmul**3 / matmul_s
    fraction = flops_model / update_s / matmul_flops_s
    rows = [
        ("device", str(jax.devices()[0].device_kind), ""),
        ("model", args.model or f"qwen2 L={args.layers} d={args.hidden} vocab={args.vocab}",
         f"{model.family} L={model.num_layers} d={model.hidden_size} vocab={model.vocab_size}"),
        ("compute dtype / trained", f"{args.compute_dtype or 'float32'} / "
         + ("all" if spec.full else f"lora_rank={spec.lora_rank} trainable_layers={spec.trainable_layers or 'all'}"), ""),
        ("matmul params N", f"{matmul_params(model) / 1e6:.1f}M", "attention, MLP, LM head"),
        ("batch x seq (tokens)", f"{args.batch} x {args.seq} ({tokens})", ""),
        ("first call (compile + run) s", f"{compile_s:.1f}", ""),
        ("update s (prepare + rl_update)", f"{update_s:.3f}", f"best of {args.rounds}"),
        ("update tokens/s", f"{tokens / update_s:.0f}", ""),
        ("model GFLOP / update", f"{flops_model / 1e9:.1f}", "formula (docstring)"),
        ("XLA GFLOP / update", f"{flops_xla / 1e9:.1f}", "cost_analysis: all ops, loop bodies once"),
        ("update GFLOP/s (model)", f"{flops_model / update_s / 1e9:.1f}", ""),
        ("update GFLOP/s (XLA count)", f"{flops_xla / update_s / 1e9:.1f}", ""),
        (f"matmul {args.matmul}^3 GFLOP/s", f"{matmul_flops_s / 1e9:.1f}", "best of 5 per round"),
        ("fraction of matmul (model FLOPs)", f"{fraction:.3f}", ""),
    ]
    print("| quantity | value | note |\n| --- | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"summary: update_tokens_per_s={tokens / update_s:.0f} flops_fraction_of_matmul={fraction:.3f}")


if __name__ == "__main__":
    main()
