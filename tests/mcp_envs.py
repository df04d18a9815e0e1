"""An environment over `tests/mcp_notes_server.py` with a user-written verifier (served by the
MCP tests as `tests.mcp_envs:NotesEnv`)."""

from __future__ import annotations

import json
import sys

from environments.mcp.env import Episode, mcp_environment
from tests.servers import REPO


def notes_as_asked(episode: Episode) -> bool:
    """The server's notes are exactly the ones the task wants (read from the live server)."""
    return json.loads(episode.call_tool("list_notes", {})) == episode.task["notes"]


TASKS = [
    {"goal": "Save a note titled 'milk' that says 'buy 2 litres'.", "notes": {"milk": "buy 2 litres"},
     "solution": [{"name": "add_note", "arguments": {"title": "milk", "text": "buy 2 litres"}}]},
    {"goal": "Save a note 'a' saying '1' and a note 'b' saying '2'.", "notes": {"a": "1", "b": "2"},
     "solution": [{"name": "add_note", "arguments": {"title": "a", "text": "1"}},
                  {"name": "add_note", "arguments": {"title": "b", "text": "2"}}]},
    {"goal": "Save a note 'x' saying 'draft', then delete it; how many notes are left?", "notes": {}, "answer": 0,
     "solution": [{"name": "add_note", "arguments": {"title": "x", "text": "draft"}},
                  {"name": "delete_note", "arguments": {"title": "x"}}]},
]

NotesEnv = mcp_environment(name="notes", command=[sys.executable, "-m", "tests.mcp_notes_server"], tasks=TASKS,
                           verifier=notes_as_asked, cwd=str(REPO), env={"PYTHONPATH": str(REPO)})
