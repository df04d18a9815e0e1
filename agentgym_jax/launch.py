"""Entry point: `python -m agentgym_jax.launch --config=configs/<name>.py [--config.key=value ...]`.

Reads an ml_collections config and dispatches on `config.mode`; each mode lives in its own
module and exposes `run(config)`.
"""

from __future__ import annotations

import importlib
import logging as py_logging
import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from agentgym_jax.config import ConfigError, check_override_keys, check_renamed, flat_keys, load_config_file, override_keys

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)

# mode -> module with `run(config)`. Modules are imported on demand: `serve` never loads JAX.
MODES: dict[str, str] = {
    "serve": "agentgym_jax.envs.launcher",
    "rl": "agentgym_jax.train.rl_loop",
    "eval": "agentgym_jax.eval.runner",
    "collect": "agentgym_jax.eval.collect",
    "sft": "agentgym_jax.train.sft_job",
    "dpo": "agentgym_jax.train.dpo_job",
    "agentevol": "agentgym_jax.train.agentevol",
    "gateway": "agentgym_jax.gateway.server",
}


def _precheck(argv: list[str]) -> None:
    """Fails fast, with the valid keys, on `--config.<typo>` (or a renamed key) before absl sees it."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None:
        raise ConfigError("missing --config=configs/<name>.py")
    config = load_config_file(spec)
    check_renamed(flat_keys(config))  # a config file of one's own, written with an old key
    check_override_keys(config, override_keys(argv))


_OWN_CODE = tuple(str(pathlib.Path(__file__).resolve().parents[1] / d) for d in ("agentgym_jax", "environments"))


class _QuietLibraries(py_logging.Filter):
    """Keeps the job's own INFO lines and every library's warnings: orbax and JAX log each
    checkpoint manager option and backend probe at INFO, dozens of lines a run."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        return record.levelno >= py_logging.WARNING or record.pathname.startswith(_OWN_CODE)


def main(argv: list[str]) -> None:
    """Runs the config's mode. A `ConfigError` a job finds once it is open (a curriculum key the
    environment lacks, an update value out of range) ends like one found before: one line, exit 1,
    its servers and processes already closed by the job's context managers."""
    del argv
    if logging.get_verbosity() <= logging.INFO and not flags.FLAGS["verbosity"].present:  # -v 1 shows everything
        logging.get_absl_handler().addFilter(_QuietLibraries())
    config = _CONFIG.value
    try:
        if config.get("mode") not in MODES:
            raise ConfigError(f"unknown mode {config.get('mode')!r}; valid: {', '.join(sorted(MODES))}")
        logging.info("mode=%s", config.mode)
        importlib.import_module(MODES[config.mode]).run(config)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def cli() -> None:
    # transformers advises at import, when PyTorch is not installed, that its models are
    # unavailable; jobs use only its tokenizers. This documented switch turns its advisory
    # warnings off (that one alone in transformers 5), before any config or mode imports it.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        _precheck(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    app.run(main)


if __name__ == "__main__":
    cli()
