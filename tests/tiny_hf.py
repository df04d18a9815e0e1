"""Tiny random Hugging Face models (built by transformers with PyTorch, saved with save_pretrained).

They are the independent reference for the decoder and the checkpoint code: nothing here is
downloaded, and every weight (biases and norm scales included) is random so that a wrong mapping
shows in the logits.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    # Qwen2: q/k/v biases, untied head.
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=False),
    # Llama 3.1-style: llama3 rope scaling with a short original context so every band is exercised.
    "llama3": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_scaling=dict(
            rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16,
        ),
    ),
    # Qwen3: q/k RMSNorm, head_dim (32) != hidden / heads (16), tied embeddings.
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
    # Llama 3.2-style: tied embeddings, llama3 scaling (3.2's factor 32).
    "llama3.2": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16,
        ),
    ),
    # Mistral: a sliding window (6) shorter than the test sequences on every layer.
    "mistral": lambda: transformers.MistralConfig(**TINY, head_dim=16, sliding_window=6, tie_word_embeddings=False),
    # Gemma 2: local (window 6) and global layers, soft caps small enough to bend the scores and logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", pad_token_id=0,
    ),
    # Gemma 3 (text): q/k norms, a local RoPE (10k) and a global one (1M, linear scaling 8).
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=6, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    ),
    # Qwen3-MoE: 8 experts, 2 per token, renormalised top-k weights, q/k norms.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    ),
    # Qwen2-MoE: 8 experts, 2 per token, raw top-k weights, a shared expert behind a sigmoid gate.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        shared_expert_intermediate_size=48,
    ),
}


def build(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A float32 eager-attention model of `family` with all parameters randomised (`overrides`:
    config attributes to change, e.g. a tokenizer's `vocab_size`)."""
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # routers: logits far apart, no near-ties in the top k
                p.copy_(0.6 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def save(family: str, folder, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> transformers.PreTrainedModel:
    model = build(family, seed, **(overrides or {}))
    model.save_pretrained(folder, **save_kwargs)
    return model


def logits(model: transformers.PreTrainedModel, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[batch, seq, vocab] logits of right-padded rows (`lengths` valid tokens each)."""
    mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        )
    return out.logits.float().numpy()


def save_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer with ids 0 .. vocab_size - 1, saved as tokenizer.json + config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
