"""agentgym_jax: train and evaluate LLM agents with multi-turn RL in JAX/Flax.

Kept import-light: environment servers import `agentgym_jax.envs.protocol` without loading JAX.
"""
