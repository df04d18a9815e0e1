"""One headless Chromium, driven through chromedriver by selenium, showing one MiniWoB++ page.

Each session owns one `Browser`. The browser is tied to the server's lifetime: chromedriver is
started with PR_SET_PDEATHSIG (it is killed when the server dies, even by SIGKILL) and Chromium
through `setpriv --pdeathsig KILL` (killed when its chromedriver dies), so no browser outlives
its server. Every driver call has a time limit (`COMMAND_TIMEOUT_S`); a browser that crashed or
hangs makes the call raise `BrowserFailure`, which ends that session with a clear error.

Configuration: `MINIWOB_COMMAND_TIMEOUT_S` (default 30), `MINIWOB_PARALLEL_LAUNCHES` (browsers
starting at once, default 2), `MINIWOB_CHROMIUM` (the browser binary; default Debian's `/usr/lib/chromium/chromium`
or the first of chromium, chromium-browser, google-chrome on the PATH) and `MINIWOB_CHROMEDRIVER`
(default `chromedriver` on the PATH). Install them with `apt-get install -y chromium chromium-driver`.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import signal
import stat
import tempfile
import threading
from typing import Any

from environments.miniwob import page



def env_number(name: str, default: str, kind: type, minimum: float) -> Any:
    """The environment variable `name` as a `kind` >= `minimum`; a clear error naming the bad value."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={raw!r} is not valid: want {'an integer' if kind is int else 'a number'} >= {minimum}")
    return value


# One driver call (page load, script, click); past it the browser counts as hung. MINIWOB_COMMAND_TIMEOUT_S overrides it.
COMMAND_TIMEOUT_S = env_number("MINIWOB_COMMAND_TIMEOUT_S", "30", float, 0.1)
WINDOW = (500, 400)  # MiniWoB's pages are 160x210 px; a small window keeps the renderer's memory low
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--disable-extensions", "--disable-background-networking", "--disable-sync", "--mute-audio",
    "--disable-default-apps", "--disable-component-update", "--no-default-browser-check",
    "--disable-features=Translate,MediaRouter,OptimizationHints", f"--window-size={WINDOW[0]},{WINDOW[1]}",
    "--allow-file-access-from-files",
)
_PR_SET_PDEATHSIG = 1
try:  # loaded before any fork (loading a library in a forked child can deadlock)
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux: no PR_SET_PDEATHSIG, so a browser may outlive a killed server
    _LIBC = None
# Browsers starting at once: more only make each start slower (a start is ~0.5-1 s of CPU).
_LAUNCHES = threading.Semaphore(env_number("MINIWOB_PARALLEL_LAUNCHES", "2", int, 1))
INSTALL_HINT = "install them with `apt-get install -y chromium chromium-driver` (Debian) or set MINIWOB_CHROMIUM / MINIWOB_CHROMEDRIVER"


class BrowserFailure(RuntimeError):
    """The browser crashed, hung past `COMMAND_TIMEOUT_S`, or its driver went away."""


def _dying_with(parent: int):
    """A preexec function for chromedriver: SIGKILL it when `parent` (this server) dies."""

    def preexec() -> None:  # runs in the forked child before exec: no imports or library loading here
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died between the fork and the prctl
            os._exit(1)

    return preexec


def chromium_path() -> str:
    """The Chromium binary (the real one, not Debian's shell launcher, so a signal reaches it)."""
    candidates = [os.environ.get("MINIWOB_CHROMIUM"), "/usr/lib/chromium/chromium"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"no Chromium binary found; {INSTALL_HINT}")


def chromedriver_path() -> str:
    path = os.environ.get("MINIWOB_CHROMEDRIVER") or shutil.which("chromedriver")
    if not path or not os.access(path, os.X_OK):
        raise FileNotFoundError(f"no chromedriver found; {INSTALL_HINT}")
    return path


@functools.cache
def _launcher() -> str:
    """A script that execs Chromium under `setpriv --pdeathsig KILL` (the binary itself when setpriv is missing)."""
    binary = chromium_path()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return binary
    folder = tempfile.mkdtemp(prefix="agentgym-miniwob-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "chromium")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec {setpriv} --pdeathsig KILL {binary} "$@"\n')
    os.chmod(path, stat.S_IRWXU)
    return path


class Browser:
    """A live Chromium with one tab; every method raises `BrowserFailure` when the browser is gone."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = _launcher()
        for flag in FLAGS:
            options.add_argument(flag)
        service = Service(chromedriver_path(), popen_kw={"preexec_fn": _dying_with(os.getpid())} if _LIBC else {})
        try:
            with _LAUNCHES:
                self.driver = webdriver.Chrome(options=options, service=service)
        except WebDriverException as e:
            raise BrowserFailure(f"Chromium did not start: {e.msg or e}") from e
        # The HTTP time-out of each driver command, read per request by selenium's connection.
        self.driver.command_executor._client_config.timeout = COMMAND_TIMEOUT_S
        self.driver.set_page_load_timeout(COMMAND_TIMEOUT_S)
        self.driver.set_script_timeout(COMMAND_TIMEOUT_S)
        self.service = service
        self.failed = False  # a call raised BrowserFailure: never ask this driver anything again

    def call(self, fn, *args: Any) -> Any:
        """Runs a driver call; a dead or hung browser becomes `BrowserFailure`."""
        from selenium.common.exceptions import InvalidSessionIdException, WebDriverException
        from urllib3.exceptions import HTTPError

        if self.failed:
            raise BrowserFailure("the browser failed earlier")
        try:
            return fn(*args)
        except (InvalidSessionIdException, HTTPError, ConnectionError, TimeoutError) as e:
            self.failed = True
            raise BrowserFailure(f"the browser is gone or hung ({type(e).__name__}: {e})") from e
        except WebDriverException as e:
            message = (e.msg or str(e)).lower()
            if any(s in message for s in ("not reachable", "disconnected", "crash", "timeout", "session deleted", "no such window")):
                self.failed = True
                raise BrowserFailure(f"the browser is gone or hung: {e.msg or e}") from e
            raise

    def script(self, source: str, *args: Any) -> Any:
        return self.call(self.driver.execute_script, source, *args)

    def open(self, url: str, seed: str, time_limit_ms: int) -> None:
        """Loads the task page afresh and, once it is ready, starts an episode with MiniWoB's generator seeded."""
        self.call(self.driver.get, url)
        self.call(self.driver.execute_async_script, page.START_JS, seed, time_limit_ms)

    def render(self, max_text: int) -> tuple[str, list[tuple[int, str]]]:
        """(utterance, [(depth, line)]) of the page now; see `page.RENDER_JS`."""
        utterance, lines = self.script(page.RENDER_JS, max_text)
        return utterance, [(int(depth), str(line)) for depth, line in lines]

    def status(self) -> tuple[bool, float, str | None]:
        done, reward, reason = self.script(page.STATUS_JS)
        return bool(done), float(reward), reason

    def find(self, ref: int):
        """The WebElement rendered as `[ref]`, or None."""
        return self.script(page.FIND_JS, str(ref))

    def alive(self) -> bool:
        try:
            self.call(lambda: self.driver.current_url)
            return True
        except Exception:
            return False

    def close(self) -> None:
        """Quits the browser; a failed one (or one whose driver does not answer) by killing chromedriver,
        which Chromium follows."""
        if not self.failed:
            try:
                self.driver.quit()
            except Exception:
                pass
        process = self.service.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=COMMAND_TIMEOUT_S)


class BrowserPool:
    """Idle browsers kept for the next session: starting Chromium costs 0.5-2 s of CPU, and clients
    such as `EnvPool` open a session per episode. A reset loads its page afresh, so a reused
    browser shows the same episode as a new one. At most `size` stay idle (each ~400 MB)."""

    def __init__(self, size: int):
        self.size = size
        self._idle: list[Browser] = []
        self._lock = threading.Lock()

    def acquire(self) -> Browser:
        while True:
            with self._lock:
                browser = self._idle.pop() if self._idle else None
            if browser is None:
                return Browser()
            if browser.alive():
                return browser
            browser.close()

    def release(self, browser: Browser) -> None:
        with self._lock:
            keep = len(self._idle) < self.size
            if keep:
                self._idle.append(browser)
        if not keep:
            browser.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for browser in idle:
            browser.close()


@functools.cache
def shared_pool() -> BrowserPool:
    """The process's pool, sized by `MINIWOB_POOL_SIZE` (0 closes every browser with its session).

    The default, 8, keeps the browsers of up to 8 sessions that were open at once: idle ones hold
    memory that was in use anyway, and a client running C episodes at a time with C <= the size
    (e.g. `EnvPool` with `max_concurrency` C) starts no browser after its first C episodes."""
    return BrowserPool(env_number("MINIWOB_POOL_SIZE", "8", int, 0))
