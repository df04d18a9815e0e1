"""Advantages, losses, KL and horizon schedules: pure functions on arrays."""
