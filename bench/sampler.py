"""Sampler throughput: our jitted KV-cache sampler vs transformers' PyTorch `generate`, and
multi-turn continuation vs re-prefilling the whole history every turn.

    python bench/sampler.py                      # 4 layers, hidden 512, batch 16, 128 new tokens
    python bench/sampler.py --layers 2 --batch 4 --new-tokens 32 --turns 3   # a quick look
    python bench/sampler.py --model=pretrained:smollm2-135m-instruct --batch 32 --new-tokens 32   # a real model

One random Qwen2 model is built by transformers, saved with save_pretrained and loaded by our
loader (or, with `--model`, a Hugging Face folder, `pretrained:<name>` or `hf:<org>/<name>` is
loaded by both), so both sides run the same float32 weights on the CPU with the same number of threads
(torch intra-op threads = the cores this process may use; XLA's CPU thread pool spans the same
cores). `taskset -c 0 python bench/sampler.py` pins both to one core and times them in process
CPU seconds, which the load of other processes on a shared machine does not move. Greedy
decoding with no stop id, so both generate exactly `--new-tokens` per row. `--dtype bfloat16`
runs both sides with bfloat16 weights and compute (an extra comparison; the headline is float32).
Times are steady state (every shape compiled or warmed up first), the best of `--repeats` rounds
that alternate between the two sides, so that load on a shared machine hits both alike.
The last line is `summary: decode_speedup_vs_hf=<x> prefill_speedup_vs_hf=<y> continuation_speedup_vs_reprefill=<z>`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from agentgym_jax.models import fetch  # noqa: E402
from agentgym_jax.models.hf_checkpoint import load_pretrained  # noqa: E402
from agentgym_jax.sampling.config import SamplingConfig  # noqa: E402
from agentgym_jax.sampling.sampler import Sampler  # noqa: E402


def build_model(args: argparse.Namespace, folder: str) -> transformers.PreTrainedModel:
    """A random Qwen2 model of the arguments' shape, saved to `folder`; or the `--model` named."""
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    model.save_pretrained(folder)
    return model


def seconds(fn, clock) -> float:
    start = clock()
    fn()
    return clock() - start


def hf_generate(model, prompts: list[list[int]]):
    """`run(n)`: transformers' greedy `generate` of exactly n new tokens for the left-padded batch."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
    kwargs = dict(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids != 0, dtype=torch.long),
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )

    def run(n: int) -> None:
        with torch.no_grad():
            out = model.generate(**kwargs, max_new_tokens=n, min_new_tokens=n)
        assert out.shape[1] == width + n

    return run


def our_generate(sampler: Sampler, params, prompts):
    """`(prefill(), generate(state))`: our sampler, blocking until the results are ready."""

    def prefill():
        return jax.block_until_ready(sampler.prefill(params, prompts))

    def generate(state) -> None:
        _, turn = sampler.generate(params, state, jax.random.key(0))  # host arrays: blocks
        assert (turn.count == sampler.config.max_new_tokens).all()

    return prefill, generate


def conversation(sampler: Sampler, params, prompts, observations, continuation: bool) -> None:
    """A `len(observations)`-turn conversation: continuation, or re-prefill of all history each turn."""
    histories = [list(p) for p in prompts]
    state = sampler.prefill(params, prompts)
    for turn_index, chunks in enumerate(observations):
        if not continuation and turn_index:
            state = sampler.prefill(params, histories)
        state, turn = sampler.generate(params, state, jax.random.key(turn_index))
        for row, chunk in enumerate(chunks):
            histories[row] += turn.tokens[row, : turn.count[row]].tolist() + chunk
        if continuation:
            state, overflow = sampler.append(params, state, chunks)
            assert not overflow.any()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128, help="longest prompt; others 50-100%% of it")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=32, help="new tokens per conversation turn")
    parser.add_argument("--obs-len", type=int, default=48, help="longest environment observation per turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and compute, both sides")
    parser.add_argument("--model", default="", help="a Hugging Face folder, pretrained:<name> or hf:<org>/<name> "
                        "(instead of a random model of --layers/--hidden/--vocab)")
    args = parser.parse_args()

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    # On one core, process CPU time is the work done whatever the neighbours' load; on several,
    # it would charge parallelism (and torch's spinning threads), so wall time is used.
    clock, clock_name = (time.process_time, "cpu") if threads == 1 else (time.perf_counter, "wall")
    with tempfile.TemporaryDirectory() as scratch:
        folder = fetch.resolve(args.model) if args.model else scratch
        hf_model = build_model(args, folder)
        model_config, params = load_pretrained(folder, dtype=args.dtype)
    args.vocab = model_config.vocab_size
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.batch)
    lengths[0] = args.prompt_len
    prompts = [rng.integers(3, args.vocab, n).tolist() for n in lengths]
    prompt_tokens = int(lengths.sum())
    print(
        f"model: {args.model or 'qwen2'} {model_config.family} layers={model_config.num_layers} "
        f"hidden={model_config.hidden_size} vocab={args.vocab} {args.dtype} | "
        f"batch={args.batch} prompt_tokens={prompt_tokens} new_tokens={args.new_tokens} | "
        f"threads={threads} clock={clock_name} | "
        f"jax={jax.__version__} torch={torch.__version__} transformers={transformers.__version__}"
    )

    max_cache_len = 1 << (args.prompt_len + args.new_tokens - 1).bit_length()
    greedy = SamplingConfig(max_new_tokens=args.new_tokens, temperature=0.0)
    sampler = Sampler.for_decoder(model_config, greedy, max_cache_len=max_cache_len)
    prefill, generate = our_generate(sampler, params, prompts)
    hf_run = hf_generate(hf_model, prompts)
    generate(prefill())  # compile
    hf_run(2)  # warm up
    # Rounds alternate between the two sides so that load on a shared machine hits both alike;
    # each number is the best round.
    times = {"ours_prefill": [], "ours_decode": [], "hf_prefill": [], "hf_total": []}
    for _ in range(args.repeats):
        times["ours_prefill"].append(seconds(prefill, clock))
        state = prefill()
        times["ours_decode"].append(seconds(lambda: generate(state), clock))
        times["hf_prefill"].append(seconds(lambda: hf_run(1), clock))
        times["hf_total"].append(seconds(lambda: hf_run(args.new_tokens), clock))
    best = {k: min(v) for k, v in times.items()}
    # Decode tokens/s = tokens fed through the model one step at a time. Ours feeds every sampled
    # token back (new_tokens steps); generate's first token comes out of its prefill (new_tokens - 1).
    hf_decode = best["hf_total"] - best["hf_prefill"]
    rows = [
        ("prefill tokens/s", prompt_tokens / best["ours_prefill"], prompt_tokens / best["hf_prefill"]),
        (
            "decode tokens/s",
            args.batch * args.new_tokens / best["ours_decode"],
            args.batch * (args.new_tokens - 1) / hf_decode,
        ),
    ]
    print(f"{'':18s} {'agentgym_jax':>14s} {'transformers':>14s} {'speedup':>8s}")
    for name, ours, hf in rows:
        print(f"{name:18s} {ours:14.0f} {hf:14.0f} {ours / hf:7.2f}x")

    # A conversation: prompt, then `turns` x (sample turn_tokens, append an observation).
    turn_config = SamplingConfig(max_new_tokens=args.turn_tokens, temperature=0.0)
    history_len = args.prompt_len + args.turns * (args.turn_tokens + args.obs_len)
    turn_sampler = Sampler.for_decoder(
        model_config, turn_config, max_cache_len=1 << max(history_len + 2 * args.obs_len, 1).bit_length()
    )
    observations = [
        [rng.integers(3, args.vocab, rng.integers(args.obs_len // 2, args.obs_len + 1)).tolist() for _ in prompts]
        for _ in range(args.turns)
    ]
    conversation_times = {True: [], False: []}
    for repeat in range(args.repeats + 1):  # the first round compiles every bucket
        for continuation in (True, False):
            t = seconds(lambda: conversation(turn_sampler, params, prompts, observations, continuation), clock)
            if repeat:
                conversation_times[continuation].append(t)
    seconds_by_mode = {mode: min(ts) for mode, ts in conversation_times.items()}
    print(
        f"{args.turns}-turn conversation ({args.turn_tokens} tokens/turn, observations <= {args.obs_len}): "
        f"continuation {seconds_by_mode[True]:.2f}s, re-prefill {seconds_by_mode[False]:.2f}s"
    )
    print(
        f"summary: decode_speedup_vs_hf={rows[1][1] / rows[1][2]:.2f} "
        f"prefill_speedup_vs_hf={rows[0][1] / rows[0][2]:.2f} "
        f"continuation_speedup_vs_reprefill={seconds_by_mode[False] / seconds_by_mode[True]:.2f}"
    )


if __name__ == "__main__":
    main()
