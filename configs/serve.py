"""Start the local environment servers and keep them up until Ctrl-C.

    python -m agentgym_jax.launch --config=configs/serve.py --config.envs=maze,wordle

Each environment gets its own server process on a free port of 127.0.0.1; the URLs are logged.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.mode = "serve"
    config.envs = "textcraft,babyai,maze,wordle"  # comma-separated names from environments/registry.py
    config.host = "127.0.0.1"
    config.base_port = 0  # 0: free ports chosen by the OS
    config.max_sessions = 0  # per server; past it /create answers 503; 0: the environment's own (1024; sciworld, miniwob: from memory)
    config.session_idle_timeout_s = 600.0  # abandoned sessions are reaped after this
    config.auth_token = ""  # when set, every request must carry `Authorization: Bearer <token>`
    config.perturbation = ""  # e.g. "noise=0.05,tool_failure=0.1": every server perturbed (docs/tools.md)
    config.play_oracle_episode = True  # after start-up, play one oracle episode per environment
    config.serve_forever = True  # False: stop after the oracle episodes (tests, the README's main job)
    return config
