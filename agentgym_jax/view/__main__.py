"""`python -m agentgym_jax.view runs/<job> [runs/<other> ...] [--port=8765] [--tokenizer=<dir or policy>]`

Indexes each run's trajectories (an eval, collect, rl or gateway folder's `trajectories*.jsonl`,
or any trajectory JSONL file), then serves the viewer on http://127.0.0.1:<port> until Ctrl-C.
Prints `serving viewer on http://127.0.0.1:<port>` once it accepts connections (`--port=0`: a
free port). `--tokenizer` takes a folder or any policy a job takes (`pretrained:<name>`,
`hf:<dir>`, `hf:<org>/<name>`, `checkpoint:<dir>`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
import socket
import sys
import time

from aiohttp import web

from agentgym_jax.models.fetch import FetchError
from agentgym_jax.models.tokenizer import TokenizerError
from agentgym_jax.view.index import RunIndex, run_files
from agentgym_jax.view.server import Run, make_app
from agentgym_jax.view.tokens import TokenText, find_tokenizer, policy_tokenizer

HOST = "127.0.0.1"  # trajectories stay on this machine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m agentgym_jax.view", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (eval, collect, rl) or trajectory JSONL files")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--tokenizer", default=None,
                        help="for every run: a tokenizer folder, or a policy as jobs take it (pretrained:<name>, "
                             "hf:<dir>, hf:<org>/<name>, checkpoint:<dir>); default: each run's own, see docs/viewer.md")
    return parser.parse_args(argv)


def open_runs(paths: list[str], tokenizer: str | None = None) -> list[Run]:
    """Indexes each run with its tokenizer (one load per tokenizer folder)."""
    if len(set(paths)) != len(paths):
        raise ValueError(f"a run is given twice: {paths}")
    given = None  # --tokenizer's folder, for every run
    if tokenizer:
        try:
            given = policy_tokenizer(tokenizer, build=True) or pathlib.Path(tokenizer)
        except FetchError as e:
            raise ValueError(f"--tokenizer={tokenizer}: {e}") from e
    loaded: dict[pathlib.Path, TokenText] = {}
    runs = []
    for name in paths:
        path = pathlib.Path(name)
        files = run_files(path)
        folder, note = (given, f"{given} (--tokenizer={tokenizer})") if given else find_tokenizer(path)
        text = None
        if folder is not None:
            key = folder.resolve()
            if key not in loaded:
                try:
                    loaded[key] = TokenText.load(folder)
                except TokenizerError as e:
                    if tokenizer:
                        raise TokenizerError(f"--tokenizer={tokenizer}: {e}") from e
                    note = f"{note} could not be loaded: {e}"
            text = loaded.get(key)
        start = time.perf_counter()
        index = RunIndex(name, files, None if text is None else text.end_of_turn_ids)
        print(f"indexed {name}: {len(index)} episodes from {len(files)} file(s) in {time.perf_counter() - start:.1f} s; "
              f"tokenizer: {note}" + (f"; {index.num_bad_lines} unreadable lines skipped" if index.num_bad_lines else ""),
              flush=True)
        runs.append(Run(name, index, text, note))
    return runs


async def serve(runs: list[Run], port: int) -> None:
    runner = web.AppRunner(make_app(runs), access_log=None)
    await runner.setup()
    sock = socket.create_server((HOST, port))
    await web.SockSite(runner, sock).start()
    print(f"serving viewer on http://{HOST}:{sock.getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        runs = open_runs(args.runs, args.tokenizer)
    except (FileNotFoundError, ValueError) as e:  # TokenizerError is a ValueError
        sys.exit(f"error: {e}")
    try:
        asyncio.run(serve(runs, args.port))
    except OSError as e:  # the port is taken
        sys.exit(f"error: cannot serve on {HOST}:{args.port}: {e.strerror or e}; pick another --port (0: a free one)")


if __name__ == "__main__":
    main()
