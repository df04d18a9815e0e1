"""Example agent programs for online RL through the gateway (docs/agents.md): user code that
imports nothing of agentgym_jax, each a function `(task, base_url, api_key, **kwargs) -> answer`."""
