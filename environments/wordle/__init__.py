"""Wordle: guess a five-letter word from per-letter feedback (LMRL-Gym format, AgentGym server)."""
