"""Token ids back to text with the run's own tokenizer, one piece per id.

Trajectories store token ids (DESIGN rule 3); the viewer shows each id as the text it stands
for, beside its loss mask and log-prob. A run's tokenizer is where its job put it or read it
(`find_tokenizer`). Byte-level tokenizers split a character of several UTF-8 bytes over several
ids; such ids are decoded together and the character shown on the last of them (the others
show nothing), so the text reads as the policy wrote it.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from agentgym_jax.models.chat import ChatFraming, FramingError
from agentgym_jax.models.tokenizer import load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"  # what a lone byte of a multi-byte character decodes to
_MAX_CHAR_BYTES = 4  # UTF-8


def _has_tokenizer(folder: pathlib.Path) -> bool:
    return (folder / TOKENIZER_FILE).is_file()


def find_tokenizer(run: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(the tokenizer folder of a run, how it was found) or (None, why not).

    Looked for in order: `<run>/tokenizer` (what `mode=rl`, `sft`, `dpo`, `agentevol` and an
    oracle `eval`/`collect` write), then the policy's own named in `<run>/run.json` (an eval's or
    collection's `checkpoint:<dir>` -> `<dir>/tokenizer`, `hf:<dir>` -> `<dir>`), in the run
    folder; for a JSONL file given alone, in its folder and that folder's parent (AgentEvol's
    `iter_<i>/explored.jsonl`).
    """
    folders = [run] if run.is_dir() else [run.parent, run.parent.parent]
    for folder in folders:
        if _has_tokenizer(folder / "tokenizer"):
            return folder / "tokenizer", f"{folder / 'tokenizer'}"
        spec = folder / "run.json"
        if spec.is_file():
            kind, _, where = str(json.loads(spec.read_text()).get("policy", "")).partition(":")
            candidate = {"checkpoint": pathlib.Path(where) / "tokenizer", "hf": pathlib.Path(where)}.get(kind)
            if candidate is not None and _has_tokenizer(candidate):
                return candidate, f"{candidate} (the policy of {spec})"
            if candidate is not None:
                return None, f"{spec} names the policy {kind}:{where}, which has no {TOKENIZER_FILE} here"
    return None, f"no tokenizer/ or run.json in {' or '.join(map(str, folders))}"


class TokenText:
    """A tokenizer's pieces of text per id, cached per id, and its end-of-turn ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}
        try:  # the chat framing knows which id ends a policy turn
            self.end_of_turn_ids: frozenset[int] | None = frozenset(ChatFraming(tokenizer).end_of_turn_ids)
        except FramingError:
            self.end_of_turn_ids = None

    @classmethod
    def load(cls, folder: pathlib.Path) -> TokenText:
        return cls(load_tokenizer(folder))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, token_id: int) -> str:
        if token_id not in self._pieces:
            self._pieces[token_id] = self._decode([token_id])
        return self._pieces[token_id]

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per id; their concatenation is the decoded text."""
        out: list[str] = []
        group: list[int] = []
        for token_id in ids:
            group.append(int(token_id))
            text = self.piece(group[0]) if len(group) == 1 else self._decode(group)
            if text.endswith(_REPLACEMENT) and len(group) < _MAX_CHAR_BYTES:
                continue  # part of a character: wait for its other bytes
            out += [""] * (len(group) - 1) + [text]
            group = []
        if group:  # a character cut off at the end stays a replacement character
            out += [""] * (len(group) - 1) + [self._decode(group)]
        return out
