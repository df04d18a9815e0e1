"""The job setup every mode (rl, sft, dpo, agentevol, eval, collect) assembles itself from."""
