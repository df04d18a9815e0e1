"""An OpenAI-compatible gateway over the JAX sampler that records conversations as trajectories (docs/gateway.md)."""
