"""Loads a tokenizer from a local Hugging Face folder (never from the hub)."""

from __future__ import annotations

import os
import pathlib

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class TokenizerError(ValueError):
    """A tokenizer that cannot be used: missing folder, no fast backend, no chat template."""


def load_tokenizer(path: str | os.PathLike, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)` for a local folder only.

    `chat_template`, when given, replaces the folder's template (for tokenizers that ship none, or
    to pin a variant). The chat framing (`models/chat.py`) needs a template; it refuses a tokenizer
    without one.
    """
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder not found: {str(folder)!r} (only local folders are loaded)")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise TokenizerError(
            f"{str(folder)!r} holds no tokenizer.json or tokenizer_config.json; "
            "build one with `python -m agentgym_jax.models.build_tokenizer --out=<dir>`"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
