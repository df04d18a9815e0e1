"""Maze: an LMRL-Gym style text maze (AgentGym's `agentenv-lmrlgym` maze task)."""
