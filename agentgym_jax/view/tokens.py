"""Token ids back to text with the run's own tokenizer, one piece per id.

Trajectories store token ids (DESIGN rule 3); the viewer shows each id as the text it stands
for, beside its loss mask and log-prob. A run's tokenizer is where its job put it or read it
(`find_tokenizer`). Byte-level tokenizers split a character of several UTF-8 bytes over several
ids; the character shows on the last of them (the others show nothing), so the pieces join to
exactly the text the whole sequence decodes to.
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


def _has_tokenizer(folder: pathlib.Path) -> bool:
    return (folder / TOKENIZER_FILE).is_file()


POLICY_KINDS = ("checkpoint", "hf", "pretrained")  # the specs a job's `policy` takes


def policy_tokenizer(spec: str, build: bool = False) -> pathlib.Path | None:
    """The tokenizer folder a job's policy spec reads: `checkpoint:<dir>` -> `<dir>/tokenizer`;
    `hf:<dir>`, or `hf:<org>/<name>` in the Hugging Face cache; `pretrained:<name>` as
    `models/fetch.py` keeps it (built first when `build`, as a job would build it; otherwise the
    folder it would be in). None for what is no such spec (a folder, `oracle`). Raises
    `FetchError` (one line) for a model that is not on this machine."""
    kind, sep, where = spec.partition(":")
    if not sep or kind not in POLICY_KINDS:
        return None
    if kind == "checkpoint":
        return pathlib.Path(where) / "tokenizer"
    if kind == "hf" and pathlib.Path(where).exists():
        return pathlib.Path(where)
    from agentgym_jax.models import fetch  # only for these two: it imports the GGUF reader

    if kind == "hf":
        return fetch.hf_snapshot(where)
    if _has_tokenizer(fetch.cache_root() / where) or not build:
        return fetch.cache_root() / where
    return fetch.fetch(where)


def find_tokenizer(run: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(the tokenizer folder of a run, how it was found) or (None, why not).

    Looked for in order: `<run>/tokenizer` (what `mode=rl`, `sft`, `dpo`, `agentevol`, the
    gateway and an oracle `eval`/`collect` write), then the policy's own named in
    `<run>/run.json` (an eval's or collection's `checkpoint:`, `hf:` or `pretrained:` policy;
    nothing is fetched), in the run folder; for a JSONL file given alone, in its folder and that
    folder's parent (AgentEvol's `iter_<i>/explored.jsonl`).
    """
    from agentgym_jax.models.fetch import FetchError

    folders = [run] if run.is_dir() else [run.parent, run.parent.parent]
    for folder in folders:
        if _has_tokenizer(folder / "tokenizer"):
            return folder / "tokenizer", f"{folder / 'tokenizer'}"
        spec = folder / "run.json"
        if spec.is_file():
            policy = str(json.loads(spec.read_text()).get("policy", ""))
            try:
                candidate = policy_tokenizer(policy)
            except FetchError:
                candidate = None
            if candidate is not None and _has_tokenizer(candidate):
                return candidate, f"{candidate} (the policy of {spec})"
            return None, f"{spec} names the policy {policy!r}, whose {TOKENIZER_FILE} is not on this machine"
    return None, f"no tokenizer/ or run.json in {' or '.join(map(str, folders))}"


class TokenText:
    """A tokenizer's text for each id of a sequence, and its end-of-turn ids."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        try:  # the chat framing knows which id ends a policy turn
            self.end_of_turn_ids: frozenset[int] | None = frozenset(ChatFraming(tokenizer).end_of_turn_ids)
        except FramingError:
            self.end_of_turn_ids = None

    @classmethod
    def load(cls, folder: pathlib.Path) -> TokenText:
        return cls(load_tokenizer(folder))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per id, joining to the decoded text.

        Streaming detokenization: each id's text is what decoding up to it adds to decoding up to
        the previous one, both decoded from the start of the piece before (context that keeps a
        word's leading space). An id that leaves a character unfinished (the text ends in a
        replacement character) adds nothing until the id that finishes it; bytes that no id
        finishes (a turn cut inside a character) show as replacement characters on the last of
        them, not on the next id.
        """
        ids = [int(i) for i in ids]
        out: list[str] = []
        prefix, read = 0, 0  # decoded context starts at `prefix`; `read` is where its emitted part ends
        for end in range(1, len(ids) + 1):
            before = self._decode(ids[prefix:read])
            after = self._decode(ids[prefix:end])
            if len(after) > len(before) and not after.endswith(_REPLACEMENT):
                piece, pending = after[len(before):], end - read - 1
                if pending:  # replacement characters in front are the waiting ids' unfinished bytes
                    head = len(piece) - len(piece.lstrip(_REPLACEMENT))
                    out += [""] * (pending - 1) + [piece[:head]]
                    piece = piece[head:]
                out.append(piece)
                prefix, read = read, end
        if read < len(ids):  # the text ends inside a character: its replacement characters
            out += [""] * (len(ids) - read - 1) + [self._decode(ids[prefix:])[len(self._decode(ids[prefix:read])):]]
        return out
