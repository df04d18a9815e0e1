"""Plain data across the grading boundary: values as JSON, rebuilt from builtin types only.

The grader sends a test's arguments to the candidate's process and gets its return value back
through these two functions (`harness.py` and `grader.py` both run this module). Only values of
exactly the builtin types None, bool, int, float, complex, str, bytes, list, tuple, dict, set
and frozenset, nested at most `MAX_DEPTH` deep, are plain; anything else (a subclass, an object
with its own `__eq__`, a generator) raises `NotPlain`. `decode` builds fresh builtin values from
the JSON, so nothing the candidate defined ever reaches the grader. Lists are JSON arrays, other
containers and the floats JSON has no number for are one-key objects: `{"tuple": [...]}`,
`{"dict": [[key, value], ...]}`, `{"float": "nan"}`. Standard library only.
"""

import math

MAX_DEPTH = 64
_TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset"}
_UNTAG = {"tuple": tuple, "set": set, "frozenset": frozenset}
NAMES = "None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset"


class NotPlain(ValueError):
    """A value that is not plain data (or JSON that does not encode one)."""


def encode(value, depth=0):
    """A plain value -> a JSON-able tree; raises `NotPlain` for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind in _TAGGED:
        return {_TAGGED[kind]: [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise NotPlain(f"type {kind.__name__}; plain data is {NAMES}")


def decode(tree, depth=0):
    """A tree from `encode` (parsed from JSON) -> fresh builtin values; raises `NotPlain` otherwise."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(tree)
    if tree is None or kind in (bool, int, float, str):
        return tree
    if kind is list:
        return [decode(item, depth + 1) for item in tree]
    if kind is not dict or len(tree) != 1:
        raise NotPlain(f"not an encoded plain value: {kind.__name__}")
    (tag, body), = tree.items()
    if tag in _UNTAG and type(body) is list:
        return _UNTAG[tag](decode(item, depth + 1) for item in body)
    if tag == "dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(decode(body[0], depth + 1), decode(body[1], depth + 1))
    raise NotPlain(f"not an encoded plain value: tag {tag!r}")
