"""A small MCP server of notes (a stand-in for a user's own server), run by the MCP tests:
`python -m tests.mcp_notes_server`. State lives in the process: add, list and delete notes."""

from __future__ import annotations

import json

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

NOTES: dict[str, str] = {}
TOOLS = [
    types.Tool(name="add_note", description="Save a note under a title (replacing one of that title).",
               input_schema={"type": "object", "properties": {"title": {"type": "string"}, "text": {"type": "string"}},
                             "required": ["title", "text"]}),
    types.Tool(name="list_notes", description="List every note as a JSON object title -> text.",
               input_schema={"type": "object", "properties": {}}),
    types.Tool(name="delete_note", description="Delete the note with this title.",
               input_schema={"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}),
]


def text(value: str, error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=value)], is_error=error)


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
    arguments = dict(params.arguments or {})
    if params.name == "add_note":
        NOTES[arguments["title"]] = arguments["text"]
        return text(f"Saved the note {arguments['title']!r}.")
    if params.name == "list_notes":
        return text(json.dumps(NOTES, sort_keys=True))
    if params.name == "delete_note":
        if NOTES.pop(arguments["title"], None) is None:
            return text(f"There is no note titled {arguments['title']!r}.", error=True)
        return text(f"Deleted the note {arguments['title']!r}.")
    return text(f"Unknown tool {params.name!r}.", error=True)


async def main() -> None:
    server = Server("notes", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
