#!/usr/bin/env bash
# Runs one agentgym_jax config on every worker of a Cloud TPU VM pod slice.
#
#   TPU=my-v5p-64 ZONE=us-east5-a launch/tpu_pod.sh configs/textcraft_grpo.py --config.train.steps=200
#
# What it does, from the repository root of this machine:
#   1. packs the committed tree (`git archive HEAD`) and copies it to every worker;
#   2. on every worker at once (`--worker=all`): unpacks it into $REMOTE_DIR, installs the package
#      with the tested pins (`pip install -e ".[tpu,envs]" -c constraints.txt`), and runs
#      `python -m agentgym_jax.launch --config=<config> <overrides...>`.
# Every worker runs the same program (SPMD). Multi-host start-up needs nothing set here: each
# process finds the pod's hosts from the TPU VM metadata and joins `jax.distributed`
# (agentgym_jax/parallel/distributed.py). Each worker starts its own local environment servers
# unless the config names shared ones (`--config.env.urls=...`, e.g. from launch/ray_env_servers.py).
# Keep `--config.workdir` on storage every worker sees (e.g. a gcsfuse mount) for checkpoints.
#
# Compilation: every worker keeps JAX's persistent compilation cache (`jax_compilation_cache_dir`)
# in JAX_COMPILATION_CACHE_DIR (default: ~/.cache/agentgym_jax/jax on each worker; a gs:// path
# shares one across the slice), so a rerun or a resumed run loads its compiled steps. Memory:
# the TPU runtime owns all of each chip's HBM (the XLA_PYTHON_CLIENT_* fraction and preallocation
# settings are the GPU client's; nothing to set here). See docs/scale.md.
#
# Set: TPU (the TPU VM name), ZONE. Optional: PROJECT (gcloud project), REMOTE_DIR (default
# agentgym_jax, relative to the workers' home), EXTRAS (default tpu,envs), PYTHON (the workers'
# interpreter, default python3), INSTALL=0 to skip copying and installing (re-runs),
# DRY_RUN=1 to print the commands instead of running them.
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: TPU=<name> ZONE=<zone> $0 configs/<name>.py [--config.key=value ...]" >&2
  exit 2
fi
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU VM zone}"
CONFIG=$1
shift
REMOTE_DIR=${REMOTE_DIR:-agentgym_jax}
EXTRAS=${EXTRAS:-tpu,envs}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

# Prints (DRY_RUN=1) or runs a command; printed words are shell-quoted, so a line can be pasted.
run() {
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$ZONE" ${PROJECT:+--project="$PROJECT"})

# The command each worker runs, every word quoted for the worker's shell.
launch=$(printf '%q ' "$PYTHON" -m agentgym_jax.launch --config="$CONFIG" "$@")
if [[ -n ${JAX_COMPILATION_CACHE_DIR:-} ]]; then
  cache_dir=$(printf '%q' "$JAX_COMPILATION_CACHE_DIR")
else
  cache_dir='"$HOME/.cache/agentgym_jax/jax"'  # expanded by each worker's shell
fi
remote="cd $(printf '%q' "$REMOTE_DIR")"
if [[ ${INSTALL:-1} == 1 ]]; then
  if ! git rev-parse --verify -q HEAD >/dev/null; then
    echo "error: $(pwd) is not a git checkout with a commit (the workers get its committed tree)" >&2
    exit 1
  fi
  if [[ -n $(git status --porcelain --untracked-files=no) ]]; then
    echo "warning: uncommitted changes are not shipped (the workers get HEAD $(git rev-parse --short HEAD))" >&2
  fi
  ARCHIVE=${TMPDIR:-/tmp}/agentgym_jax-$$.tar.gz
  trap 'rm -f "$ARCHIVE"' EXIT
  run git archive --format=tar.gz -o "$ARCHIVE" HEAD
  run "${gcloud_tpu[@]}" scp "$ARCHIVE" "$TPU:agentgym_jax.tar.gz" --worker=all "${where[@]}"
  remote="mkdir -p $(printf '%q' "$REMOTE_DIR") && tar -xzf agentgym_jax.tar.gz -C $(printf '%q' "$REMOTE_DIR") && $remote"
  remote+=" && $(printf '%q' "$PYTHON") -m pip install -q -e $(printf '%q' ".[$EXTRAS]") -c constraints.txt"
fi
run "${gcloud_tpu[@]}" ssh "$TPU" --worker=all "${where[@]}" --command="export JAX_COMPILATION_CACHE_DIR=$cache_dir && $remote && ${launch% }"
