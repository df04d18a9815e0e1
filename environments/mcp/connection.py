"""A stdio MCP server process and a client session to it, driven from synchronous code.

The `mcp` SDK is asynchronous; environments are called synchronously (from the server's thread
pool), so the session lives on an anyio event loop in a thread of its own (a blocking portal)
and each call waits for its answer, up to `timeout_s`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import anyio
import anyio.from_thread
import mcp_types
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


class MCPError(RuntimeError):
    """The MCP server could not be started or did not answer."""


class MCPConnection:
    """One MCP server process (started by `command`) and an initialized client session."""

    def __init__(self, command: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 timeout_s: float = 30.0):
        if not command:
            raise ValueError("an MCP server command is needed, e.g. ['python', '-m', 'my_server']")
        self.timeout_s = timeout_s
        # The SDK passes only a few variables (HOME, PATH, ...) to the server; a Python server needs PYTHONPATH too.
        variables = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "LANG", "LC_ALL")}
        params = StdioServerParameters(command=command[0], args=list(command[1:]), env={**variables, **(env or {})},
                                       cwd=cwd)
        self._contexts: list[Any] = []
        try:
            portal_cm = anyio.from_thread.start_blocking_portal()
            self._portal = portal_cm.__enter__()
            self._contexts.append(portal_cm)
            transport_cm = self._portal.wrap_async_context_manager(stdio_client(params, errlog=sys.stderr))
            read, write = transport_cm.__enter__()
            self._contexts.append(transport_cm)
            session_cm = self._portal.wrap_async_context_manager(ClientSession(read, write))
            self._session = session_cm.__enter__()
            self._contexts.append(session_cm)
            self._call(self._session.initialize)
        except BaseException as e:
            self.close()
            raise MCPError(f"could not start the MCP server {' '.join(command)!r}: {type(e).__name__}: {e}") from e

    def _call(self, fn: Any, *args: Any) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(self.timeout_s):
                return await fn(*args)
        try:
            return self._portal.call(bounded)
        except TimeoutError:
            raise MCPError(f"the MCP server did not answer within {self.timeout_s:g} s") from None

    def list_tools(self) -> list[mcp_types.Tool]:
        return list(self._call(self._session.list_tools).tools)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        return self._call(self._session.call_tool, name, arguments)

    def close(self) -> None:
        """Ends the session and the process (idempotent)."""
        while self._contexts:
            context = self._contexts.pop()
            try:
                context.__exit__(None, None, None)
            except Exception:  # the process may already be gone; closing must not fail
                pass

    def __enter__(self) -> MCPConnection:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def result_text(result: mcp_types.CallToolResult) -> str:
    """The text parts of a tool result, joined (other content is named by its type)."""
    parts = [c.text if isinstance(c, mcp_types.TextContent) else f"[{c.type} content]" for c in result.content]
    return "\n".join(parts)
