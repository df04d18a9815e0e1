"""Blocking calls into async code that also work where an event loop already runs.

Jupyter and Colab run the user's cells inside an event loop, where `asyncio.run` and
`loop.run_until_complete` refuse to start ("cannot be called from a running event loop"). The
library's blocking entry points (the rollout engine, oracle play, task info) go through these
two helpers instead, so the same call works in a script, a test and a notebook cell.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`; inside a running event loop, the same on a fresh worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="run_sync") as executor:
        return executor.submit(asyncio.run, coro).result()


class LoopThread:
    """A private event loop on a daemon thread, for objects that keep async state across calls.

    The rollout engine's `EnvPool` holds aiohttp sessions bound to one loop, so every `run` must
    use the same loop; running that loop on its own thread makes `run` callable from anywhere,
    notebooks included.
    """

    def __init__(self, name: str = "event-loop"):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the loop and blocks until it is done; an interrupt cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt while waiting: do not leave it running
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedules `coro` on the loop and returns at once; `.result()` waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def close(self) -> None:
        """Shuts down the loop's default executor, stops the loop and joins its thread."""
        if self.closed:
            return
        self.run(self._loop.shutdown_default_executor())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
