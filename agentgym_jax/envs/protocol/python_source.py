"""Python's parser for servers that answer sessions from threads.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state; when a
garbage collection inside `ast.parse` runs a callback that releases the GIL (JAX registers one),
another thread's parse moves the shared depth and one of them fails with "AST constructor
recursion depth mismatch" (python/cpython#106905). One lock makes parses take turns.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """`ast.parse(source, mode=mode)`, one thread at a time."""
    with _LOCK:
        return ast.parse(source, mode=mode)
