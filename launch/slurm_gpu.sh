#!/usr/bin/env bash
#SBATCH --job-name=mlm_jax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=TERM@300
#
# Pretrain with mlm_jax on GPU nodes of a SLURM cluster: one process per node,
# each using every GPU of its node. See --help.
# The --signal line asks SLURM to send SIGTERM 5 minutes before the time limit:
# the run then writes a checkpoint and exits, and submitting again resumes it.
#
# Options, checks and the commands (sbatch, srun) are in mlm_jax/launch/slurm.py,
# which needs only Python's standard library and reads the #SBATCH lines above;
# this script finds the repository and a Python to run it with.
set -euo pipefail

# sbatch runs a copy of this script from its spool directory, in the directory
# the job was submitted from (or --chdir): the repository is next to the
# script, else in $MLM_JAX_REPO_DIR, else in the current directory.
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -f $script_dir/../mlm_jax/train.py ]]; then
  repo_dir=$script_dir/..
else
  repo_dir=${MLM_JAX_REPO_DIR:-$PWD}
fi
if [[ ! -f $repo_dir/mlm_jax/train.py ]]; then
  printf 'slurm_gpu.sh: error: no mlm_jax repository in %s: %s\n' "$repo_dir" \
    "submit from the repository's root, or set MLM_JAX_REPO_DIR" >&2
  exit 2
fi
repo_dir=$(cd "$repo_dir" && pwd)

# Prints the first python >= 3.11 found: a system python3 may be older (3.9 on
# RHEL 9), so versioned names and the virtualenvs come next.
find_python() {
  local python
  for python in python3 python3.14 python3.13 python3.12 python3.11 \
    "$repo_dir/.venv/bin/python" ${MLM_JAX_VENV:+"$MLM_JAX_VENV/bin/python"}; do
    if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
      printf '%s\n' "$python"
      return 0
    fi
  done
  printf 'slurm_gpu.sh: error: no python3 >= 3.11 on PATH\n' >&2
  return 1
}

python=$(find_python) || exit 2
# -I: neither PYTHON* variables nor the current directory can shadow the
# launcher's modules, which need only the standard library.
code='import sys; sys.path.insert(0, sys.argv[2]); from mlm_jax.launch import slurm'
exec "$python" -I -c "$code; sys.exit(slurm.main(sys.argv[1:]))" \
  "${BASH_SOURCE[0]}" "$repo_dir" "$@"
