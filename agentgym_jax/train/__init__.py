"""Train state, jitted updates, training loops and checkpoints."""
