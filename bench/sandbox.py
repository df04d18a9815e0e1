"""The sandbox's cost per command, before (a git revision: today's main by default) and after (this tree).

    python bench/sandbox.py                          # before = 3a31f6a, 30 rounds
    python bench/sandbox.py --before=<rev> --rounds=50

Each round runs every operation once in a "before" sandbox (`environments/sandbox/` and
`environments/code/problems.py` of the revision, loaded from git into a temporary folder) and
once in an "after" sandbox (this tree), interleaved, so a neighbour's load hits both alike:
start and close a sandbox; `true`; `echo` of 1 KiB; `python3 -c pass`; write a file and read it
back; the hidden tests of a canonical HumanEval solution (HumanEval/2; before: HumanEval's
program run in the sandbox, in the candidate's process; after: `grading.grade`, the tests run
here and the function called in the sandbox). Columns: median and 90th-percentile wall ms of
each, and the after/before ratio of the medians. Needs bubblewrap and root or user namespaces.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from environments.code import grading, problems  # noqa: E402
from environments.code.env import LIMITS  # noqa: E402
from environments.sandbox import Sandbox  # noqa: E402

DEFAULT_BEFORE = "3a31f6a"  # main before issue 45
TASK = 2  # HumanEval/2 truncate_number


def load_before(revision: str, folder: pathlib.Path):
    """The revision's sandbox module and code problems module, imported from files written out of git."""
    modules = []
    for path in ("environments/sandbox/sandbox.py", "environments/sandbox/runner.py", "environments/code/problems.py"):
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        (folder / pathlib.Path(path).name).write_text(text)
    for name in ("sandbox", "problems"):
        spec = importlib.util.spec_from_file_location(f"before_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def operations(box, make: Callable, hidden: Callable) -> dict[str, Callable[[], object]]:
    """Name -> one timed operation on `box` (or a new sandbox from `make`); the same names for both sides."""
    problem = problems.all_problems()[TASK]
    box.write({"solution.py": problem.prompt + problem.canonical_solution})
    return {
        "start + close": lambda: make().close(),
        "true": lambda: box.run("true"),
        "echo 1 KiB": lambda: box.run("head -c 1024 /dev/zero | tr '\\0' x"),
        "python3 -c pass": lambda: box.run("python3 -c pass"),
        "write + read a file": lambda: (box.write({"data/a.txt": "x" * 1000}), box.read(["data"])),
        "hidden tests (HumanEval/2)": lambda: hidden(box),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="git revision of the 'before' sandbox")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    problem = problems.all_problems()[TASK]
    with tempfile.TemporaryDirectory() as folder:
        old_sandbox, old_problems = load_before(args.before, pathlib.Path(folder))
        old_limits = old_sandbox.Limits(**{k: getattr(LIMITS, k) for k in old_sandbox.Limits.__dataclass_fields__})

        def old_hidden(box):
            run = box.run("python3 -", stdin=old_problems.hidden_test_program(old_problems.all_problems()[TASK], "t0ken"))
            assert run.stdout.rstrip().endswith("t0ken"), run

        def new_hidden(box):
            assert grading.grade(box, problem, "hidden").passed == 1

        with old_sandbox.Sandbox(old_limits) as old_box, Sandbox(LIMITS) as new_box:
            sides = {"before": operations(old_box, lambda: old_sandbox.Sandbox(old_limits), old_hidden),
                     "after": operations(new_box, lambda: Sandbox(LIMITS), new_hidden)}
            seconds: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.rounds):
                for name in sides["before"]:
                    for side, ops in sides.items():
                        start = time.perf_counter()
                        ops[name]()
                        seconds.setdefault((side, name), []).append(time.perf_counter() - start)

    def ms(side: str, name: str, q: float) -> float:
        values = sorted(seconds[side, name])
        return 1000 * (statistics.median(values) if q == 50 else values[int(q / 100 * (len(values) - 1))])

    print(f"before = {args.before}, after = this tree; {args.rounds} rounds, wall ms")
    print(f"{'operation':<28} {'before p50':>10} {'p90':>7} {'after p50':>10} {'p90':>7} {'after/before':>12}")
    for name in sides["before"]:
        b50, b90, a50, a90 = ms("before", name, 50), ms("before", name, 90), ms("after", name, 50), ms("after", name, 90)
        print(f"{name:<28} {b50:>10.1f} {b90:>7.1f} {a50:>10.1f} {a90:>7.1f} {a50 / b50:>11.2f}x")
    true_b, true_a = ms("before", "true", 50), ms("after", "true", 50)
    start_b, start_a = ms("before", "start + close", 50), ms("after", "start + close", 50)
    hidden_b, hidden_a = ms("before", "hidden tests (HumanEval/2)", 50), ms("after", "hidden tests (HumanEval/2)", 50)
    print(f"summary: a command costs {true_a:.1f} ms after vs {true_b:.1f} ms before ({true_a / true_b:.2f}x); "
          f"a sandbox {start_a:.0f} vs {start_b:.0f} ms to start and close; hidden tests {hidden_a:.0f} vs {hidden_b:.0f} ms")


if __name__ == "__main__":
    main()
