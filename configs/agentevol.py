r"""AgentEvol on the Room environment, CPU-sized: behaviour cloning on a few oracle demonstrations,
then explore / keep successes / merge with the demonstrations / re-train, for a few iterations.

    python -m agentgym_jax.launch --config=configs/agentevol.py
    python -m agentgym_jax.launch --config=configs/agentevol.py:maze    # on a CPU recipe's env (configs/cpu.py)

Each iteration's training set, held-out evaluation and checkpoint land in `config.workdir`
(`iter_<i>/data.jsonl`, `iter_<i>/eval.json`, `checkpoints/<i>`, `progress.json`); re-running the
same command resumes at the first unfinished iteration. The environment, tokenizer, model,
rollout and optimizer settings are the quickstart's (configs/quickstart.py), or with an environment
argument those of its CPU recipe (configs/cpu.py: turn length, episode budget, final horizon);
`algo` is unused except `agg_mode` and micro-batching.
"""

import ml_collections

from configs import cpu, quickstart


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """`arg`: an environment of configs/cpu.py; empty: the quickstart's room."""
    config = cpu.get_config(arg) if arg else quickstart.get_config()
    config.mode = "agentevol"
    config.workdir = f"runs/agentevol_{arg}" if arg else "runs/agentevol"
    del config.horizon_schedule, config.train  # no RL steps here

    config.sft.num_tasks = 16  # base demonstrations (AgentTraj's role): oracle episodes of training tasks
    config.sft.epochs = 10
    config.sft.batch_size = 16
    config.sft.lr = 3e-3

    config.agentevol = ml_collections.ConfigDict()
    config.agentevol.iterations = 3  # exploration + training rounds after behaviour cloning (iteration 0)
    config.agentevol.explore_tasks = 64  # training tasks explored each iteration (0: the whole train split)
    config.agentevol.group_size = 4  # K: sampled episodes per exploration task (the paper's sample_num)
    config.agentevol.temperature = 1.0  # exploration temperature
    config.agentevol.horizon = config.eval.horizon  # turns per exploration episode: the held-out horizon (room: 12)
    config.agentevol.from_base = True  # True: each iteration trains the base model (the paper); False: continue
    config.agentevol.epochs = 0  # training epochs of iterations >= 1 (0: sft.epochs, the behaviour-cloning epochs)
    return config
