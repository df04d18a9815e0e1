"""A trajectory viewer in the browser: `python -m agentgym_jax.view runs/<job> [runs/<other>]`.

An index of a run's episodes built by streaming its JSONL files once (`index.py`), failure
patterns found from each record (`patterns.py`), token ids decoded with the run's tokenizer
(`tokens.py`), a JSON API on 127.0.0.1 (`server.py`) and one static page (`static/`).
See docs/viewer.md.
"""
