"""Shell tasks over generated file systems: find, count, transform, fix a broken script.

Each template draws a small file tree under /work with `random.Random(f"bash/{template}/{k}")`
(string seeds hash the same in every process) and says how the result is checked:
- a question (`answer`): the agent submits a path or a number;
- a state (`check_root` + `expected`): that directory must end up holding exactly these files;
- a script (`check_files` + `check_command` + `expected_output`): the files are replaced with
  data the agent never saw, and the command must then print the expected output.
`commands` is the oracle: shell commands that find or make the result, then `submit`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Callable

PER_TEMPLATE = 25  # task ids: template = id % len(TEMPLATES), instance = id // len(TEMPLATES)

WORDS = (
    "alpha", "amber", "anchor", "apple", "arrow", "basin", "beacon", "birch", "blue", "bolt", "breeze",
    "brick", "canyon", "cedar", "chalk", "cider", "cloud", "cobalt", "comet", "copper", "coral", "delta",
    "dune", "echo", "ember", "falcon", "fern", "flint", "forest", "frost", "garnet", "glade", "granite",
    "harbor", "hazel", "indigo", "iron", "ivory", "jade", "juniper", "kettle", "lantern", "ledger", "lemon",
    "linen", "maple", "marble", "meadow", "mint", "nectar", "nickel", "oak", "onyx", "orbit", "pebble",
    "pepper", "pine", "plume", "prism", "quartz", "quill", "raven", "ridge", "river", "saffron", "sage",
    "slate", "spruce", "summit", "tide", "timber", "topaz", "tundra", "velvet", "violet", "walnut",
    "willow", "zephyr",
)
NAMES = (
    "Ada", "Alan", "Beatrice", "Boris", "Carmen", "Cyrus", "Dalia", "Dmitri", "Edith", "Emil", "Farah",
    "Felix", "Greta", "Hugo", "Ines", "Ivan", "Jonas", "Julia", "Kamal", "Kira", "Lena", "Lucas", "Mara",
    "Milo", "Nadia", "Nils", "Olga", "Omar", "Petra", "Quentin", "Rosa", "Sami", "Tara", "Umar", "Vera",
    "Wanda", "Xavier", "Yara", "Zoran",
)
REGIONS = ("north", "south", "east", "west", "central")
LEVELS = ("DEBUG", "INFO", "INFO", "INFO", "WARN", "ERROR")


@dataclasses.dataclass(frozen=True)
class Task:
    template: str
    question: str
    files: dict[str, str]  # the starting tree, paths relative to /work
    commands: tuple[str, ...]  # the oracle's actions, ending in `submit`
    answer: str | None = None  # a question's answer
    check_root: str = ""  # a state task: this directory must hold exactly `expected`
    expected: dict[str, str] = dataclasses.field(default_factory=dict)
    check_files: dict[str, str] = dataclasses.field(default_factory=dict)  # a script task: new data ...
    check_command: str = ""  # ... this command is run on it ...
    expected_output: str = ""  # ... and must print this
    executable: tuple[str, ...] = ()


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))


def _text(rng: random.Random, lines: int) -> str:
    return "".join(_sentence(rng) + "\n" for _ in range(lines))


def _names(rng: random.Random, count: int, ext: str, taken: set[str] = frozenset()) -> list[str]:
    """`count` distinct `word_word<ext>` file names, none in `taken`."""
    names: list[str] = []
    while len(names) < count:
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}{ext}"
        if name not in names and name not in taken:
            names.append(name)
    return names


def _tree(rng: random.Random, count: int, dirs: tuple[str, ...], exts: tuple[str, ...]) -> dict[str, str]:
    """`count` text files of a few lines, spread over `dirs`."""
    files: dict[str, str] = {}
    while len(files) < count:
        path = f"{rng.choice(dirs)}/{_names(rng, 1, rng.choice(exts))[0]}"
        files.setdefault(path, _text(rng, rng.randint(2, 8)))
    return files


def _insert_line(rng: random.Random, text: str, line: str) -> str:
    lines = text.splitlines(keepends=True)
    lines.insert(rng.randint(0, len(lines)), line + "\n")
    return "".join(lines)


def find_token(rng: random.Random) -> Task:
    files = _tree(rng, rng.randint(20, 35), ("docs", "notes", "src", "archive/2023", "archive/2024", "misc"),
                  (".txt", ".md", ".cfg"))
    paths = rng.sample(sorted(files), 6)
    ids = rng.sample(range(1000, 10000), len(paths))
    for path, number in zip(paths, ids):  # one target, five decoys with other ticket ids
        files[path] = _insert_line(rng, files[path], f"ticket: PRJ-{number}")
    wanted = f"PRJ-{ids[0]}"
    return Task("find_token", f"Exactly one file under /work contains the line `ticket: {wanted}`. Which file is "
                "it? Answer with its path relative to /work, e.g. `submit docs/plan.txt`.", files,
                (f"grep -rl 'ticket: {wanted}' .", f"submit {paths[0]}"), answer=paths[0])


def _log_lines(rng: random.Random, count: int) -> tuple[str, int]:
    """Log lines `2024-05-03 10:22:01 LEVEL source: message` and how many are ERROR lines."""
    lines, errors = [], 0
    for _ in range(count):
        level = rng.choice(LEVELS)
        errors += level == "ERROR"
        message = _sentence(rng) + (" after error" if rng.random() < 0.2 else "")  # a lower-case decoy
        lines.append(f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
                     f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {level} {rng.choice(WORDS)}: {message}\n")
    return "".join(lines), errors


def count_errors(rng: random.Random) -> Task:
    files, total = {}, 0
    for name in _names(rng, rng.randint(3, 6), ".log"):
        files[f"logs/{name}"], errors = _log_lines(rng, rng.randint(10, 40))
        total += errors
    for path in (f"logs/archive/{_names(rng, 1, '.log')[0]}", f"logs/{_names(rng, 1, '.log.1')[0]}"):
        files[path] = _log_lines(rng, rng.randint(10, 30))[0]  # not counted: a subfolder, a rotated file
    return Task("count_errors", "How many lines with the level ERROR are in the .log files directly inside logs/ "
                "(not in its subfolders, and not rotated files such as app.log.1)? Lines look like "
                "`2024-05-03 10:22:01 ERROR worker: message`. Answer with the number.", files,
                ("cat logs/*.log | grep -c ' ERROR '", f"submit {total}"), answer=str(total))


def count_files(rng: random.Random) -> Task:
    files = _tree(rng, rng.randint(15, 40), ("src", "src/core", "src/util", "src/core/io", "tests", "docs"),
                  (".py", ".py", ".pyc", ".txt", ".py.bak", ".md"))
    count = sum(p.startswith("src/") and p.endswith(".py") for p in files)
    return Task("count_files", "How many files with the extension .py are there under src/, counting all of its "
                "subfolders? Answer with the number.", files,
                ("find src -type f -name '*.py' | wc -l", f"submit {count}"), answer=str(count))


def largest_file(rng: random.Random) -> Task:
    data = _tree(rng, rng.randint(8, 20), ("data", "data/raw", "data/raw/2024", "data/clean"), (".csv", ".txt", ".json"))
    others = _tree(rng, 5, ("docs", "backup"), (".txt",))
    largest = max(data, key=lambda p: (len(data[p]), p))
    data[largest] += _text(rng, 3)  # strictly the largest
    big_decoy = next(iter(others))
    others[big_decoy] = _text(rng, 40)  # larger, but outside data/
    return Task("largest_file", "Which file under data/ (in any of its subfolders) is the largest, in bytes? "
                "Answer with its path relative to /work.", {**data, **others},
                ("find data -type f -printf '%s %p\\n' | sort -n | tail -n 1", f"submit {largest}"), answer=largest)


def rename_extension(rng: random.Random) -> Task:
    stems = _names(rng, rng.randint(7, 12), "")
    texts = [_text(rng, rng.randint(1, 4)) for _ in stems]
    n_txt = rng.randint(3, 6)
    files = {f"notes/{s}.txt": t for s, t in zip(stems[:n_txt], texts)}
    files[f"notes/{stems[n_txt]}.md"] = texts[n_txt]
    files[f"notes/{stems[n_txt + 1]}.txt.orig"] = texts[n_txt + 1]
    files.update({f"notes/drafts/{s}.txt": t for s, t in zip(stems[n_txt + 2:], texts[n_txt + 2:])})
    expected = {(p[:-4] + ".md" if p.endswith(".txt") and p.count("/") == 1 else p): t for p, t in files.items()}
    return Task("rename_extension", "Rename every file whose name ends in .txt directly inside notes/ (not in its "
                "subfolders) so that it ends in .md instead. Change nothing else. Reply `submit` when done.", files,
                ('cd notes && for f in *.txt; do mv -- "$f" "${f%.txt}.md"; done', "ls -R notes", "submit"),
                check_root="notes", expected=expected)


def replace_identifier(rng: random.Random) -> Task:
    a, b, c, d = rng.sample(WORDS, 4)
    old, new = f"{a}_{b}", f"{c}_{d}"
    files: dict[str, str] = {}
    for path in _tree(rng, rng.randint(4, 8), ("src", "src/app", "src/lib"), (".py",)):
        lines = [f"{rng.choice(WORDS)}_{i} = {rng.choice(WORDS)}({rng.randint(0, 99)})\n" for i in range(rng.randint(2, 6))]
        for _ in range(rng.randint(0, 3)):
            lines.insert(rng.randint(0, len(lines)), rng.choice([f"from .{rng.choice(WORDS)} import {old}\n",
                                                                 f"result = {old}(result)\n", f"def {old}(x):\n    return x\n"]))
        files[path] = "".join(lines)
    files[f"src/{_names(rng, 1, '.py', set(files))[0]}"] = f"# {old} is applied here\nvalue = {old}(1)\n"  # one always changes
    untouched = {"src/README.md": f"The function {old} is documented here.\n",
                 "src/app/notes.txt": f"{old} stays {old} in text files.\n"}
    expected = {**{p: t.replace(old, new) for p, t in files.items()}, **untouched}
    return Task("replace_identifier", f"In every .py file under src/ (in any subfolder), replace each occurrence of "
                f"`{old}` with `{new}`. Leave all other files as they are. Reply `submit` when done.",
                {**files, **untouched},
                (f"grep -rl --include='*.py' {old} src | xargs sed -i 's/{old}/{new}/g'", f"grep -rn {new} src", "submit"),
                check_root="src", expected=expected)


def sort_unique(rng: random.Random) -> Task:
    names = [rng.choice(NAMES) for _ in range(rng.randint(15, 40))]
    files = {"data/names.txt": "".join(f"{n}\n" for n in names), "data/readme.txt": _text(rng, 2)}
    expected = {**files, "data/unique_names.txt": "".join(f"{n}\n" for n in sorted(set(names)))}
    return Task("sort_unique", "data/names.txt has one name per line, with repeats. Write each distinct name once, "
                "sorted alphabetically, one per line, to data/unique_names.txt. Keep data/names.txt as it is. "
                "Reply `submit` when done.", files,
                ("sort -u data/names.txt > data/unique_names.txt", "cat data/unique_names.txt", "submit"),
                check_root="data", expected=expected)


COLUMNS = ("date", "region", "amount", "units")
BUGS = ("column", "delimiter", "path", "variable")


def _sales(rng: random.Random, columns: list[str]) -> tuple[str, int]:
    """A sales CSV with the header `columns` and the total of its amount column."""
    rows, total = [",".join(columns)], 0
    for _ in range(rng.randint(8, 20)):
        values = {"date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", "region": rng.choice(REGIONS),
                  "amount": str(rng.randint(1, 999)), "units": str(rng.randint(1, 50))}
        total += int(values["amount"])
        rows.append(",".join(values[c] for c in columns))
    return "\n".join(rows) + "\n", total


def total_script(field: int, delimiter: str = ",", path: str = "data/sales.csv", variable: str = "total") -> str:
    return ("#!/bin/bash\n# Prints the total of the amount column of data/sales.csv.\n"
            f"awk -F'{delimiter}' 'NR > 1 {{ total += ${field} }} END {{ print {variable} }}' {path}\n")


def fix_script(rng: random.Random) -> Task:
    columns = rng.sample(COLUMNS, len(COLUMNS))
    field = columns.index("amount") + 1
    bug = rng.choice(BUGS)
    broken = {"column": dict(field=field % len(COLUMNS) + 1), "delimiter": dict(field=field, delimiter=";"),
              "path": dict(field=field, path="data/sale.csv"), "variable": dict(field=field, variable="totl")}[bug]
    sales, _ = _sales(rng, columns)
    hidden_sales, hidden_total = _sales(rng, columns)
    fixed = total_script(field)
    return Task("fix_script", "The script bin/total.sh should print the total of the amount column of "
                "data/sales.csv, but it is broken. Fix the script so that `bash bin/total.sh` prints the right "
                "total; it will also be run on other sales files of the same form. Reply `submit` when done.",
                {"bin/total.sh": total_script(**broken), "data/sales.csv": sales},
                (f"cat > bin/total.sh <<'EOF'\n{fixed}EOF", "bash bin/total.sh", "submit"),
                check_files={"data/sales.csv": hidden_sales}, check_command="bash bin/total.sh",
                expected_output=f"{hidden_total}\n", executable=("bin/total.sh",))


TEMPLATES: tuple[Callable[[random.Random], Task], ...] = (
    find_token, count_errors, count_files, largest_file, rename_extension, replace_identifier, sort_unique, fix_script)


@functools.lru_cache(maxsize=None)
def all_tasks() -> tuple[Task, ...]:
    """Every task, in task-id order: the templates interleaved, so any stride of ids covers them all."""
    tasks = []
    for task_id in range(PER_TEMPLATE * len(TEMPLATES)):
        make = TEMPLATES[task_id % len(TEMPLATES)]
        tasks.append(make(random.Random(f"bash/{make.__name__}/{task_id // len(TEMPLATES)}")))
    return tuple(tasks)
