"""The MCP bridge: any environment served as an MCP server, and MCP servers' tools as environments."""
