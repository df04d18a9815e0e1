"""MiniWoB++ task ids: (task name, seed) pairs over a fixed list of tasks, split by seed.

`TASKS` lists the tasks of the `miniwob` package that load and run in headless Chromium with
this environment's text observation and actions (click, type, press, scroll): every one was
checked to start, to render the same page for the same seed in two browsers, and to render
different pages for different seeds. Left out: tasks drawn on a canvas or in SVG (click-shape,
count-shape, drag-*, draw-*, ...), tasks that need dragging or hovering (resize-textarea,
highlight-text, use-slider, hover-shape), tasks that read the clock (choose-date, enter-date,
enter-time: not deterministic), tasks with timed animations or delays (button-delay,
chase-circle, moving-items, simon-says, stock-market, terminal and the non-`nodelay` twins),
pictures read by eye (text-transform, visual-addition, number-checkboxes) and the flight
booking tasks (they need an HTTP server, not file://).

Task id `i` is task `TASKS[i % len(TASKS)]` with seed `i // len(TASKS)`: ids run through every
task before the next seed, so the first ids of a split (what `eval.task_ids=N` and benchmarks
take) cover many tasks. Seeds divisible by `TEST_EVERY` form the test split, the rest the train
split (the same tasks in both).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

SEEDS_PER_TASK = 50  # episodes per task; MiniWoB's generator is seeded with the task name and seed
TEST_EVERY = 5  # seeds 0, 5, 10, ... are the test split (10 per task)

TASKS: tuple[str, ...] = (
    "choose-list", "click-button", "click-button-sequence", "click-checkboxes", "click-checkboxes-large",
    "click-checkboxes-soft", "click-checkboxes-transfer", "click-collapsible-2-nodelay", "click-collapsible-nodelay",
    "click-dialog", "click-dialog-2", "click-link", "click-menu", "click-option", "click-scroll-list", "click-tab",
    "click-tab-2", "click-tab-2-easy", "click-tab-2-hard", "click-tab-2-medium", "click-test", "click-test-2",
    "click-widget", "copy-paste", "copy-paste-2", "email-inbox", "email-inbox-delete", "email-inbox-forward-nl",
    "email-inbox-important", "email-inbox-nl-turk", "email-inbox-noscroll", "email-inbox-reply",
    "email-inbox-star-reply", "enter-password", "enter-text", "enter-text-2", "enter-text-dynamic", "find-word",
    "focus-text", "focus-text-2", "form-sequence-2", "form-sequence-3", "generate-number", "guess-number",
    "login-user", "login-user-popup", "multi-layouts", "multi-orderings", "navigate-tree", "odd-or-even",
    "order-food", "phone-book", "read-table", "read-table-2", "scroll-text", "scroll-text-2", "search-engine",
    "sign-agreement", "simple-algebra", "simple-arithmetic", "social-media", "social-media-all",
    "social-media-some", "tic-tac-toe", "unicode-test", "use-autocomplete-nodelay", "use-spinner",
)


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    seed: int

    @property
    def js_seed(self) -> str:
        """The string given to MiniWoB's `Math.seedrandom`."""
        return f"{self.name}/{self.seed}"


def num_tasks() -> int:
    return len(TASKS) * SEEDS_PER_TASK


def task(data_idx: int) -> Task:
    if not 0 <= data_idx < num_tasks():
        raise ValueError(f"MiniWoB task id {data_idx} out of range [0, {num_tasks()})")
    return Task(TASKS[data_idx % len(TASKS)], data_idx // len(TASKS))


def task_id(name: str, seed: int) -> int:
    """The id of (task, seed); the inverse of `task`."""
    if name not in TASKS or not 0 <= seed < SEEDS_PER_TASK:
        raise ValueError(f"no MiniWoB task id for ({name!r}, seed {seed}): tasks are {', '.join(TASKS)}, "
                         f"seeds 0..{SEEDS_PER_TASK - 1}")
    return seed * len(TASKS) + TASKS.index(name)


def splits() -> dict[str, list[int]]:
    ids = range(num_tasks())
    return {"train": [i for i in ids if task(i).seed % TEST_EVERY],
            "test": [i for i in ids if task(i).seed % TEST_EVERY == 0]}


@functools.cache
def html_dir() -> str:
    """The `miniwob` package's folder of task pages, found without importing the package (and gymnasium)."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the MiniWoB++ environment needs the `miniwob` package: pip install miniwob", name="miniwob")
    folder = os.path.join(os.path.dirname(spec.origin), "html", "miniwob")
    missing = [name for name in TASKS if not os.path.exists(os.path.join(folder, f"{name}.html"))]
    if missing:
        raise FileNotFoundError(f"the installed miniwob package lacks task pages {missing} in {folder}")
    return folder


def url(name: str) -> str:
    return "file://" + os.path.join(html_dir(), f"{name}.html")
