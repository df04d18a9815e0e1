"""Client side of the environments: protocol, async client, EnvPool, local launcher, dialects."""
