"""Token-exact trajectories and the multi-turn rollout engine."""
