"""Environment servers: one aiohttp framework plus one folder per environment."""
