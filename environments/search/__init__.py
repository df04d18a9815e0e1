"""Multi-turn search over a BM25 index of packaged geography facts (`--env=search`)."""
