"""Flax decoder (Llama / Qwen2 / Qwen3), Hugging Face checkpoints in and out, tokenizer and chat framing."""
