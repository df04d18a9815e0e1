"""The import rules of docs/architecture.md, checked on every import of every module (top-level
and inside functions): packages import only the layers below them (`launch -> train/eval -> job
-> rollout -> sampling -> models -> parallel`, `rollout -> envs`, `train/eval -> gateway -> job`), `rl` only jax, chex and numpy,
servers and trainer share only the protocol package, and the repository ignores what a user's
machine adds to a clone."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# package -> the packages of agentgym_jax it may import (besides itself and UTILITIES).
LAYERS = {
    "parallel": set(),
    "models": {"parallel"},
    "sampling": {"models", "parallel"},
    "envs": set(),
    "rollout": {"sampling", "models", "parallel", "envs"},
    "rl": set(),
    "job": {"rollout", "sampling", "models", "parallel", "envs"},
    "train": {"gateway", "job", "rl", "rollout", "sampling", "models", "parallel", "envs"},
    "eval": {"gateway", "job", "rollout", "sampling", "models", "parallel", "envs"},
    "gateway": {"job", "rollout", "sampling", "models", "parallel", "envs"},
    "view": {"rollout", "sampling", "models", "parallel", "envs"},
}
UTILITIES = {"config", "aio", "stats", "progress"}  # modules any package may import
UTILITY_LAYERS = {"parallel"}  # what the utilities themselves may import
LAUNCH_IMPORTS = {"config"}  # launch.py names the modes' modules as strings and imports the one it runs
RL_LIBRARIES = {"jax", "chex", "numpy"}  # rl/ is array math: besides the standard library, only these
PROTOCOL = "agentgym_jax.envs.protocol"
SERVER_SIDE_IMPORTS = {PROTOCOL, "agentgym_jax.envs"}  # the latter: `from agentgym_jax.envs import protocol`


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute module an import statement in `path` names (`from a import b`: a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _library_modules() -> list[pathlib.Path]:
    return sorted((REPO / "agentgym_jax").rglob("*.py"))


def _part(name: str) -> str | None:
    """`agentgym_jax.<part>...` -> part (a package or a top-level module); None outside the library."""
    parts = name.split(".")
    return parts[1] if parts[0] == "agentgym_jax" and len(parts) > 1 else None


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_a_package_imports_only_the_layers_below_it(package):
    allowed = LAYERS[package] | UTILITIES | {package}
    wrong = {
        str(path.relative_to(REPO)): sorted(parts - allowed)
        for path in sorted((REPO / "agentgym_jax" / package).rglob("*.py"))
        for parts in [{p for p in map(_part, imported_modules(path)) if p}]
        if parts - allowed
    }
    assert not wrong, f"imports that go up or sideways (docs/architecture.md): {wrong}"


def test_launch_imports_no_mode():
    parts = {p for p in map(_part, imported_modules(REPO / "agentgym_jax" / "launch.py")) if p}
    assert parts <= LAUNCH_IMPORTS, parts


def test_rl_is_array_math_on_jax_chex_and_numpy():
    for path in sorted((REPO / "agentgym_jax" / "rl").rglob("*.py")):
        tops = {name.split(".")[0] for name in imported_modules(path)} - set(sys.stdlib_module_names) - {"__future__"}
        library = {_part(name) for name in imported_modules(path) if _part(name)}
        assert tops - {"agentgym_jax"} <= RL_LIBRARIES and library <= {"rl"}, (path.name, tops, library)


def test_every_package_has_its_place_in_the_layers():
    packages = {path.parent.name for path in (REPO / "agentgym_jax").glob("*/__init__.py")}
    modules = {path.stem for path in (REPO / "agentgym_jax").glob("*.py")} - {"__init__", "launch"}
    assert packages == set(LAYERS) and modules == UTILITIES, "place it in LAYERS and in docs/architecture.md"


def test_utilities_import_nothing_above_parallel():
    for name in UTILITIES:
        parts = {p for p in map(_part, imported_modules(REPO / "agentgym_jax" / f"{name}.py")) if p}
        assert parts <= UTILITY_LAYERS | {name}, (name, parts)


def test_servers_and_trainer_share_only_the_protocol():
    server_side = sorted((REPO / "environments").rglob("*.py"))
    assert len(server_side) > 20
    for path in server_side:
        library = {name for name in imported_modules(path) if name.split(".")[0] == "agentgym_jax"}
        beyond = {name for name in library if name not in SERVER_SIDE_IMPORTS and not name.startswith(PROTOCOL + ".")}
        assert not beyond, (str(path.relative_to(REPO)), sorted(beyond))
    for path in _library_modules():
        servers = {name for name in imported_modules(path) if name.split(".")[0] == "environments"}
        assert not servers, (str(path.relative_to(REPO)), sorted(servers))


def test_the_rules_checked_here_are_the_ones_the_architecture_page_draws():
    page = (REPO / "docs" / "architecture.md").read_text()
    assert "launch ──► train ──┬──► job ──► rollout ──┬──► sampling ──► models ──► parallel" in page
    for name in (*UTILITIES, *RL_LIBRARIES, "tests/test_architecture.py"):
        assert name.split("/")[-1].removesuffix(".py") in page, name


@pytest.mark.parametrize("path", [".venv/", ".venv-cpu/", "venv/", "runs/", "tests/__pycache__/x.pyc"])
def test_what_a_working_clone_adds_is_ignored(path):
    """Virtual environments, runs and caches never show up as files to commit."""
    done = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=REPO)
    assert done.returncode == 0, f"{path} is not ignored by .gitignore"
