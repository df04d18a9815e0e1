"""The trajectory viewer's index of a large run: how long indexing takes and what it holds, side
by side with the bare parse of the same file and with reading every record whole.

    python bench/view_index.py                      # 100k episodes shaped like a room RL run's
    python bench/view_index.py --episodes 10000 --turns 8

A synthetic run (`write_synthetic_run`: `--turns` policy turns of `--turn_tokens` ids with an
environment answer of as many after each, a prompt of 100 ids, statuses, rewards, steps and task ids
cycling) is written to a temporary file, then:
- `index`: `RunIndex` over the file (json.loads of each line, the record checked, its failure
  patterns found, a row of numpy columns kept), best of `--rounds`;
- `parse`: json.loads of every line, nothing kept (the floor any reader of the file pays);
- `read all`: every record as a `Trajectory` held in a list, what reading the file by hand
  gives, on at most `--read_all` episodes (its memory grows with the tokens);
- memory: peak traced allocations (tracemalloc: Python objects and numpy arrays) of a separate
  pass, per episode; `page`: a filter over every row plus one page of 50 summaries; `open`: one
  episode read from its byte offset (median of 200).
Times are CPU seconds of this process (`time.process_time`; everything runs in one thread), so
neighbours on a shared machine do not inflate them; on an idle machine wall time is the same.
Last line: `summary: episodes=... index_s=... parse_s=... index_over_parse=... index_bytes_per_episode=...
read_all_bytes_per_episode=... page_ms=... open_ms=...`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import tracemalloc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from agentgym_jax.envs.protocol import EpisodeStatus  # noqa: E402
from agentgym_jax.rollout.trajectory import read_jsonl  # noqa: E402
from agentgym_jax.view.index import Filter, RunIndex  # noqa: E402

STATUSES = [s.value for s in EpisodeStatus]
END_OF_TURN = 2


def synthetic_record(i: int, *, turns: int, turn_tokens: int, prompt_tokens: int, steps: int, episodes: int) -> dict:
    """Episode `i` of a synthetic run: env `("room", "maze")[i % 2]`, task `i % 1000`, sampled and
    trained in the RL step `i * steps // episodes + 1` (as an RL run records it: `policy_version`
    and `train_step` one less, the viewer's step as `metrics.jsonl` numbers it), status `STATUSES[i % 7]`, reward `(i % 5) / 4`, `i % 4` invalid
    actions (at most `turns`); every policy turn ends with END_OF_TURN except when `i % 6 == 1`
    (the last turn is cut), and when `i % 3 == 0` every turn samples the same ids."""
    ids = [1 + (i + k) % 500 for k in range(prompt_tokens)]
    spans = []
    for t in range(turns):
        start = len(ids)
        body = [3 + (i + k + t * (i % 3 != 0)) % 400 for k in range(turn_tokens - 1)]
        last = 7 if (i % 6 == 1 and t == turns - 1) else END_OF_TURN
        ids += body + [last]
        spans.append([start, len(ids)])
        ids += [3 + (i + t + k) % 400 for k in range(turn_tokens)]  # the environment's answer
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = [-0.25] * (end - start)
    return dict(
        task_id=i % 1000, env=("room", "maze")[i % 2], group_id=i % 1000, token_ids=ids, loss_mask=mask,
        logprobs=logprobs, turn_spans=spans, turn_rewards=[0.0] * turns, reward=(i % 5) / 4,
        status=STATUSES[i % len(STATUSES)], invalid_actions=min(i % 4, turns), sample_idx=0, attempt=0,
        policy_version=i * steps // episodes, train_step=i * steps // episodes, timings={}, text="",
    )


def write_synthetic_run(path: pathlib.Path, episodes: int, *, turns: int = 4, turn_tokens: int = 20,
                        prompt_tokens: int = 100, steps: int = 100) -> None:
    """`episodes` records of `synthetic_record` in a JSONL file."""
    shape = dict(turns=turns, turn_tokens=turn_tokens, prompt_tokens=prompt_tokens, steps=steps, episodes=episodes)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(episodes):
            f.write(json.dumps(synthetic_record(i, **shape)) + "\n")


def peak_bytes(fn) -> int:
    tracemalloc.start()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del result
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn_tokens", type=int, default=20)
    parser.add_argument("--read_all", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "trajectories.jsonl"
        part = pathlib.Path(folder) / "part.jsonl"
        write_synthetic_run(path, args.episodes, turns=args.turns, turn_tokens=args.turn_tokens)
        write_synthetic_run(part, min(args.episodes, args.read_all), turns=args.turns, turn_tokens=args.turn_tokens)
        file_mb = path.stat().st_size / 2**20

        def index():
            return RunIndex("bench", [path], end_of_turn_ids={END_OF_TURN})

        def parse():
            with open(path, "rb") as f:
                for line in f:
                    json.loads(line)

        index_s = min(_seconds(index) for _ in range(args.rounds))
        parse_s = min(_seconds(parse) for _ in range(args.rounds))
        read_n = min(args.episodes, args.read_all)
        read_s = _seconds(lambda: list(read_jsonl(str(part))))
        index_bytes = peak_bytes(index) / args.episodes
        read_bytes = peak_bytes(lambda: list(read_jsonl(str(part)))) / read_n

        built = index()
        flt = Filter(status="max_turns", step=(10, 60))
        def page():
            rows = built.select(flt)
            return built.summaries(rows[len(rows) // 2:len(rows) // 2 + 50])

        page_ms = 1e3 * min(_seconds(page) for _ in range(20))
        open_ms = 1e3 * statistics.median(
            _seconds(lambda r=r: built.read(r)) for r in range(0, len(built), max(1, len(built) // 200)))

    print(f"synthetic run: {args.episodes} episodes, {file_mb:.0f} MB, {args.turns} turns of {args.turn_tokens} ids\n")
    print("| what | episodes | CPU seconds | peak bytes / episode |")
    print("| --- | --- | --- | --- |")
    print(f"| index (RunIndex) | {args.episodes} | {index_s:.2f} | {index_bytes:.0f} |")
    print(f"| parse only (json.loads per line) | {args.episodes} | {parse_s:.2f} | - |")
    print(f"| read all (list of Trajectory) | {read_n} | {read_s:.2f} | {read_bytes:.0f} |")
    print(f"\npage (filter + 50 summaries): {page_ms:.1f} ms; open one episode: {open_ms:.2f} ms")
    print(f"summary: episodes={args.episodes} file_mb={file_mb:.0f} index_s={index_s:.2f} parse_s={parse_s:.2f} "
          f"index_over_parse={index_s / parse_s:.2f} index_bytes_per_episode={index_bytes:.0f} "
          f"read_all_bytes_per_episode={read_bytes:.0f} page_ms={page_ms:.1f} open_ms={open_ms:.2f}")


def _seconds(fn) -> float:
    """CPU seconds of `fn` (all of it runs in this thread): on a machine shared with other jobs,
    wall time measures them too."""
    start = time.process_time()
    fn()
    return time.process_time() - start


if __name__ == "__main__":
    main()
