"""Shared test markers."""

import os

import pytest

# Tests too long for the 30-minute suite budget on 2 cores until they are shrunk; they run with
# AGENTGYM_LONG_TESTS=1 (see CONTRIBUTING.md). Every other test, `slow` included, runs in CI.
long_test = pytest.mark.skipif(
    os.environ.get("AGENTGYM_LONG_TESTS") != "1",
    reason="over the CI time budget; set AGENTGYM_LONG_TESTS=1 to run",
)
