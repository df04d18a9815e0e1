"""MiniWoB++: web tasks (click a button, fill a form, use an email inbox, ...) in a real headless Chromium.

Each session owns one Chromium (`browser.py`), started by its first reset (closed sessions leave
up to `MINIWOB_POOL_SIZE` idle ones for the next). A reset loads the task's page from the `miniwob`
package (a file:// URL), seeds MiniWoB's generator (`Math.seedrandom` in its core.js) with the
task name and seed, and starts the episode, so a task id shows the same page in every process.

Observation: the task's utterance, then the page as text (`page.RENDER_JS`): one line per
element an agent can act on or read, `[ref] tag#id "text" state`, indented by nesting. Actions
(from `Action: ...`): `click [ref]`, `type [ref] "text"` (replaces the field's content; at most
`MAX_TYPE_CHARS` characters), `press [ref] key` (Enter, Tab, Backspace, ArrowDown, ctrl+a, ...),
`scroll up|down` or `scroll [ref] up|down`. An action the page cannot take (no such ref, an
element covered by another, typing into a button) is an ordinary invalid turn whose observation
says why.

Reward and success are MiniWoB's own: the episode ends when the task's JavaScript calls
`core.endEpisode(reward)`; the reward of that step is the raw reward (in [-1, 1], without
MiniWoB's time discount), other steps give 0, and success is a raw reward > 0. MiniWoB's episode
timer is kept but set to `TIME_LIMIT_MS` (24 h) instead of its 10 s, so slow policies are not
timed out (a time-out would end the episode with reward -1).
"""

from __future__ import annotations

import logging
import re
from typing import ClassVar

from agentgym_jax.envs.protocol import ProtocolError, StepResult, TaskInfo
from environments.base import Environment
from environments.miniwob import oracle, tasks
from environments.miniwob.browser import Browser, BrowserFailure, shared_pool

log = logging.getLogger(__name__)

TIME_LIMIT_MS = 24 * 3600 * 1000  # MiniWoB's episode timer (below setTimeout's 2^31 ms ceiling)
MAX_TEXT = 120  # characters of one element's text in the observation
MAX_LINES = 150  # lines of the page in the observation; the rest is summarised as a count
# Characters one `type` action may enter; longer is an invalid turn. Chromium types ~3 a
# millisecond (100,000 took 31 s, past the driver's time-out, which broke the session).
MAX_TYPE_CHARS = 1000

INSTRUCTION = (
    "You are a web agent in a browser showing a small web page with a task (MiniWoB++). Each turn I "
    "show the task and the page: one line per element, `[ref] tag#id \"text\" state`, indented by "
    "nesting. Answer with one action:\n"
    "- click [ref]: click an element (a button, link, checkbox, list option, ...)\n"
    "- type [ref] \"text\": replace the content of a text field with the text\n"
    "- press [ref] key: press a key in an element (Enter, Tab, Backspace, ArrowDown, ctrl+a, ...)\n"
    "- scroll up / scroll down, or scroll [ref] up / scroll [ref] down: scroll the page or an element\n"
    "The episode ends when the task is done (or done wrong).\n"
    "Reply in exactly this format:\n"
    "Thought:\nyour reasoning\n\nAction:\nyour next action"
)

_REF = r"\[?(\d{1,9})\]?"  # a longer number is no element's (and int() of one past 4300 digits raises)
_CLICK = re.compile(rf"click\s+{_REF}\s*$", re.IGNORECASE)
_TYPE = re.compile(rf"type\s+{_REF}\s+(.*)$", re.IGNORECASE)
_PRESS = re.compile(rf"press\s+{_REF}\s+(\S+)\s*$", re.IGNORECASE)
_SCROLL = re.compile(rf"scroll(?:\s+{_REF})?(?:\s+(up|down))?\s*$", re.IGNORECASE)
_LINE_HEAD = re.compile(r"\[(\d+)\] (\w+)\S* ?(.*)")
_TEXT_FIELDS = ("text", "password", "email", "number", "search", "tel", "url")

# Key names an action may use (case-insensitive; any single character too) -> selenium `Keys` attributes.
KEYS = {"enter": "ENTER", "return": "RETURN", "tab": "TAB", "backspace": "BACKSPACE", "delete": "DELETE",
        "escape": "ESCAPE", "space": "SPACE", "arrowup": "ARROW_UP", "arrowdown": "ARROW_DOWN",
        "arrowleft": "ARROW_LEFT", "arrowright": "ARROW_RIGHT", "up": "ARROW_UP", "down": "ARROW_DOWN",
        "left": "ARROW_LEFT", "right": "ARROW_RIGHT", "home": "HOME", "end": "END", "pageup": "PAGE_UP",
        "pagedown": "PAGE_DOWN"}
MODIFIERS = {"ctrl": "CONTROL", "control": "CONTROL", "shift": "SHIFT", "alt": "ALT", "meta": "META"}


class InvalidAction(Exception):
    """The action names something the page does not have or cannot do; the turn is invalid."""


def _selenium_key(name: str) -> str:
    from selenium.webdriver.common.keys import Keys

    attribute = KEYS.get(name.lower()) or MODIFIERS.get(name.lower())
    if attribute is not None:
        return getattr(Keys, attribute)
    if len(name) == 1:
        return name
    raise InvalidAction(f"unknown key {name!r}; keys: a single character or one of {', '.join(KEYS)}, "
                        "optionally after modifiers (ctrl+a, shift+Tab, ...)")


def parse_text_argument(raw: str) -> str:
    """`"text"` -> text (a JSON-style quoted string, or the rest of the line when unquoted)."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw


class MiniWoBEnv(Environment):
    """One MiniWoB++ episode in a Chromium of its own."""

    name: ClassVar[str] = "miniwob"
    instruction: ClassVar[str] = INSTRUCTION
    success_threshold: ClassVar[float] = 1.0
    blocking: ClassVar[bool] = True  # every call waits on the browser
    # One Chromium each (started by the first reset; idle ones are earlier sessions' browsers, so
    # they never outnumber the cap): the default cap follows from memory. EnvPool waits for a free one.
    session_memory_mb: ClassVar[float] = 400
    # The shared suite's sweep: each session starts a browser (0.5-2 s of CPU, ~400 MB), so few
    # at a time; tests/test_miniwob.py covers every oracle task.
    oracle_sweep_episodes: ClassVar[int] = 16
    oracle_sweep_concurrency: ClassVar[int] = 2

    def __init__(self) -> None:
        # Started by the first reset, not here: a /create that a client timed out and sent again
        # would otherwise leave a browser behind in a session nobody uses.
        self.browser: Browser | None = None
        self.task: tasks.Task | None = None
        self._observation = ""
        self._lines: list[str] = []  # the page lines the current observation shows (without indentation)
        self._done = False
        self._raw_reward = 0.0

    @classmethod
    def task_info(cls) -> TaskInfo:
        tasks.html_dir()  # fails here, at server start, when the miniwob package is missing
        oracle_ids = [i for i in range(tasks.num_tasks()) if tasks.task(i).name in oracle.SOLVERS]
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=tasks.splits(),
            num_tasks=tasks.num_tasks(),
            has_oracle=cls.has_oracle,
            metadata={
                "task_names": list(tasks.TASKS),  # task id i is task_names[i % len(task_names)], seed i // len(task_names)
                "seeds_per_task": tasks.SEEDS_PER_TASK,
                "oracle_tasks": sorted(oracle.SOLVERS),
                "oracle_task_ids": oracle_ids,
                "time_limit_ms": TIME_LIMIT_MS,
            },
        )

    def reset(self, data_idx: int) -> str:
        """Loads the task's page; a browser that crashed, or failed to start or load the page (e.g.
        starved of CPU past `COMMAND_TIMEOUT_S`), is replaced by a new one, once."""
        self.task = tasks.task(data_idx)
        for attempt in range(2):
            if self.browser is not None and (self.browser.failed or not self.browser.alive()):
                self.browser.close()
                self.browser = None
            try:
                if self.browser is None:
                    self.browser = shared_pool().acquire()
                self.browser.open(tasks.url(self.task.name), self.task.js_seed, TIME_LIMIT_MS)
                break
            except BrowserFailure as e:
                if attempt:
                    raise
                log.warning("miniwob reset of %s: %s; starting a new browser", self.task, e)
        self._done, self._raw_reward = False, 0.0
        self._observation = self._render()
        return self._observation

    def _render(self) -> str:
        utterance, lines = self.browser.render(MAX_TEXT)
        self._lines = [line for _, line in lines[:MAX_LINES]]
        shown = ["  " * depth + line for depth, line in lines[:MAX_LINES]]
        if len(lines) > MAX_LINES:
            shown.append(f"... ({len(lines) - MAX_LINES} more elements)")
        return f"Task: {utterance}\nPage:\n" + "\n".join(shown)

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise ProtocolError("no episode yet: POST /reset first", 409)
        try:
            self._act(action)
        except InvalidAction as e:
            self._observation = f"Invalid action: {e}.\n\n{self._render()}"
            return self.result(self._observation, 0.0, False, invalid=True)
        done, raw_reward, reason = self.browser.status()
        if done:
            self._done, self._raw_reward = True, raw_reward
            self._observation = f"The episode is over: the task gave reward {raw_reward:g}" + (f" ({reason})." if reason else ".")
            return self.result(self._observation, raw_reward, True, invalid=False, raw_reward=raw_reward)
        self._observation = self._render()
        return self.result(self._observation, 0.0, False, invalid=False)

    def _element(self, ref: str):
        element = self.browser.find(int(ref))
        if element is None:
            raise InvalidAction(f"there is no element [{ref}] on the page now")
        return element

    def _act(self, action: str) -> None:
        """Performs one action in the browser; `InvalidAction` when the page cannot take it."""
        from selenium.common.exceptions import (ElementClickInterceptedException, ElementNotInteractableException,
                                                InvalidElementStateException)
        from selenium.webdriver.common.action_chains import ActionChains

        browser = self.browser
        try:
            if m := _CLICK.match(action):
                browser.call(self._element(m[1]).click)
            elif m := _TYPE.match(action):
                text = parse_text_argument(m[2])
                if len(text) > MAX_TYPE_CHARS:
                    raise InvalidAction(f"the text to type is {len(text)} characters long; type at most "
                                        f"{MAX_TYPE_CHARS} at a time")
                element = self._element(m[1])
                browser.call(element.clear)
                browser.call(element.send_keys, text)
            elif m := _PRESS.match(action):
                element = self._element(m[1])
                *mods, key = m[2].split("+")
                if not key or any(mod.lower() not in MODIFIERS for mod in mods):
                    raise InvalidAction(f"cannot read the key {m[2]!r}; write e.g. Enter, ctrl+a or shift+Tab")
                codes, key_code = [_selenium_key(mod) for mod in mods], _selenium_key(key)
                chain = ActionChains(browser.driver)
                browser.script("arguments[0].focus();", element)
                for code in codes:
                    chain.key_down(code)
                chain.send_keys(key_code)
                for code in reversed(codes):
                    chain.key_up(code)
                browser.call(chain.perform)
            elif m := _SCROLL.match(action):
                sign = -1 if (m[2] or "down").lower() == "up" else 1
                if m[1]:
                    browser.script("arguments[0].scrollBy(0, arguments[1] * arguments[0].clientHeight * 0.8);",
                                   self._element(m[1]), sign)
                else:
                    browser.script("window.scrollBy(0, arguments[0] * window.innerHeight * 0.8);", sign)
            else:
                raise InvalidAction(f"unknown action {action!r}; use click [ref], type [ref] \"text\", "
                                    "press [ref] key or scroll up/down")
        except ElementClickInterceptedException:
            raise InvalidAction(f"{action!r} did not happen: the element is covered by another one") from None
        except (ElementNotInteractableException, InvalidElementStateException) as e:
            raise InvalidAction(f"{action!r} did not happen: the element cannot take it ({e.msg.splitlines()[0]})") from None

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """One action per element of the page: `type` for text fields, `click` for the rest, plus scrolling."""
        actions = []
        for line in self._lines:
            m = _LINE_HEAD.match(line)
            if m is None:
                continue
            ref, tag, rest = m.groups()
            editable = tag == "textarea" or (tag == "input" and rest.split(" ", 1)[0] in _TEXT_FIELDS)
            actions.append(f'type [{ref}] "text"' if editable else f"click [{ref}]")
        return actions + ["scroll down", "scroll up"]

    def verify(self) -> bool:
        return self._done and self._raw_reward > 0

    def oracle_action(self) -> str:
        if self.task is None:
            raise ProtocolError("no episode yet: POST /reset first", 409)
        solver = oracle.SOLVERS.get(self.task.name)
        if solver is None:
            raise ProtocolError(f"MiniWoB task {self.task.name!r} has no oracle; tasks with one: "
                                f"{', '.join(sorted(oracle.SOLVERS))}", 501)
        return solver(oracle.Page(self.browser))

    @classmethod
    def on_server_stop(cls) -> None:
        shared_pool().close()

    def close(self) -> None:
        if self.browser is not None:
            shared_pool().release(self.browser)
