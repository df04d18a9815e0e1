"""The candidate's side of grading: a program run in the sandbox as `python3 -I -` (`grading.py`).

It defines the problem's prompt, runs /work/solution.py, then answers the grader's calls of the
entry point: a JSON line `{"args": ..., "kwargs": ...}` on fd 3 in, one JSON line on fd 4 out,
`{"value": <plain value>}`, `{"raised": "<exception>"}` or `{"not_plain": "<why>"}`. It runs in
the candidate's own process and nothing here is trusted: the grader, in another process, reads
only plain values from it and decides every test itself. A solution that fails to load prints
its traceback (from its own frames on) and ends the program, so the grader's calls go unanswered.
`PROMPT`, `ENTRY_POINT` and `SOLUTION` are defined before this text (`grading.program`).
"""

import json
import os
import sys

from plain import NotPlain, decode, encode

REASON_CHARS = 300

calls, replies = os.fdopen(3, "rb"), os.fdopen(4, "wb")
namespace = {"__name__": "__main__"}
exec(compile(PROMPT, "prompt.py", "exec"), namespace)  # noqa: F821 (defined before this text)
try:
    with open(SOLUTION) as f:  # noqa: F821
        exec(compile(f.read(), SOLUTION, "exec"), namespace)  # noqa: F821
except BaseException as e:
    import traceback  # only here: it costs milliseconds on every run
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
function = namespace.get(ENTRY_POINT)  # noqa: F821
if not callable(function):
    print(f"{SOLUTION} defines no function {ENTRY_POINT}", file=sys.stderr)  # noqa: F821
    sys.exit(1)
for line in calls:
    call = json.loads(line)
    try:
        reply = {"value": encode(function(*decode(call["args"]), **decode(call["kwargs"])))}
    except NotPlain as e:
        reply = {"not_plain": str(e)[:REASON_CHARS]}
    except BaseException as e:
        reply = {"raised": f"{type(e).__name__}: {e}"[:REASON_CHARS]}
    replies.write(json.dumps(reply).encode() + b"\n")
    replies.flush()
