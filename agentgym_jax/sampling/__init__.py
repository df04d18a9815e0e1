"""Jitted KV-cache generation: prefill, decode and multi-turn continuation."""
