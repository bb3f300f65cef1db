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
# each using every GPU of its node. See usage() or --help.
# The --signal line asks SLURM to send SIGTERM 5 minutes before the time limit:
# the run then writes a checkpoint and exits, and submitting again resumes it.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: sbatch [SBATCH_OPTIONS] launch/slurm_gpu.sh --workdir=DIR [options] [-- TRAIN_FLAGS...]
       launch/slurm_gpu.sh --workdir=DIR [options] [-- TRAIN_FLAGS...]

In a SLURM job (sbatch, or inside salloc) it starts one process per node:

  srun --ntasks-per-node=1 ... python -m mlm_jax.train --config=FILE --workdir=DIR TRAIN_FLAGS...

JAX's distributed runtime detects the SLURM job, so no --coordinator_address,
--num_processes or --process_id are needed. Outside a SLURM allocation, run
directly, it submits itself with sbatch (from a login node).

The #SBATCH lines at the top ask for 2 nodes x 8 GPUs for 24 hours; sbatch
options given on its command line override them, e.g.
  sbatch --nodes=4 --gpus-per-node=4 --partition=gpu --account=ACCOUNT \
      launch/slurm_gpu.sh --workdir=/shared/runs/base -- --config.train.batch_size=1024
Keep --ntasks-per-node=1: each process uses all GPUs of its node.

Options (each also read from the environment variable in brackets):
  --workdir DIR     run directory, on a filesystem every node sees [MLM_JAX_WORKDIR] (required)
  --config FILE     experiment config [MLM_JAX_CONFIG] (default: configs/base.py)
  --venv DIR        virtualenv to activate, with mlm_jax and jax[cuda12] (or
                    jax[cuda13]) installed [MLM_JAX_VENV] (default: the repository's .venv
                    if there is one, else the python on PATH)
  --cache_dir DIR   where the prepared data goes [MLM_JAX_CACHE] (default:
                    ~/.cache/mlm_jax); must be seen by every node, as must
                    --config.data.data_dir if set
  --gpu TYPE        the nodes' GPUs for the pre-flight: h100 or a100 [MLM_JAX_GPU]
                    (default: h100)
  --no_preflight    skip the pre-flight: by default the train step is first
                    compiled for the job's GPUs (python -m mlm_jax.preflight
                    --target=GPUxPER_NODExNODES, on the CPU, before sbatch and
                    again in the job before srun) and nothing runs unless it fits
  --dry_run         print the commands instead of running them (and, outside an
                    allocation, the sbatch command that would submit the job) [MLM_JAX_DRY_RUN=1]
  -h, --help        show this help
Relative paths are relative to the repository, which is found next to this script,
else in $MLM_JAX_REPO_DIR, else in the directory the job was submitted from.
Options take "--opt VALUE" or "--opt=VALUE". Everything after "--" goes to the
training command.

Set-up, once, in the repository on a filesystem every node sees:
  python3 -m venv .venv && .venv/bin/pip install -e . -U "jax[cuda12]"
EOF
}

prog=slurm_gpu.sh
die() {
  printf '%s: error: %s\n' "$prog" "$*" >&2
  exit 2
}
warn() {
  printf '%s: warning: %s\n' "$prog" "$*" >&2
}

config=${MLM_JAX_CONFIG:-configs/base.py}
workdir=${MLM_JAX_WORKDIR:-}
venv=${MLM_JAX_VENV:-}
cache_dir=${MLM_JAX_CACHE:-}
dry_run=${MLM_JAX_DRY_RUN:-0}
gpu=${MLM_JAX_GPU:-h100}
preflight=1
[[ $dry_run == 0 || $dry_run == 1 ]] || die "MLM_JAX_DRY_RUN must be 0 or 1 (got '$dry_run')"
train_flags=()

# Stores the value of an option that takes one ("--opt VALUE" or "--opt=VALUE").
# Option parsing is repeated in the other launcher on purpose: sbatch runs a
# spooled copy of a script, so a sourced helper file would not be found.
set_option() {
  local key=${1#--}
  key=${key//-/_}
  case $2 in
    -*) die "$1 needs a value (got '$2')" ;;
  esac
  case $key in
    workdir) workdir=$2 ;;
    config) config=$2 ;;
    venv) venv=$2 ;;
    cache_dir) cache_dir=$2 ;;
    gpu) gpu=$2 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
}

while (($#)); do
  case $1 in
    --)
      shift
      train_flags=("$@")
      break
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    --dry_run | --dry-run) dry_run=1 ;;
    --no_preflight | --no-preflight) preflight=0 ;;
    --*=*) set_option "${1%%=*}" "${1#*=}" ;;
    --*)
      (($# >= 2)) || die "$1 needs a value"
      set_option "$1" "$2"
      shift
      ;;
    *) die "unexpected argument '$1' (flags for the training command go after --)" ;;
  esac
  shift
done

# sbatch runs a copy of this script from its spool directory, in the directory
# the job was submitted from (or --chdir).
script=${BASH_SOURCE[0]}
script_dir=$(cd "$(dirname "$script")" && pwd)
if [[ -f $script_dir/../mlm_jax/train.py ]]; then
  repo_dir=$(cd "$script_dir/.." && pwd)
else
  repo_dir=${MLM_JAX_REPO_DIR:-$PWD}
fi
[[ -f $repo_dir/mlm_jax/train.py ]] ||
  die "no mlm_jax repository in $repo_dir: submit from the repository's root, or set MLM_JAX_REPO_DIR"

[[ -n $workdir ]] ||
  die "missing required option --workdir (or MLM_JAX_WORKDIR): a directory every node sees"
case $workdir in
  gs://* | s3://*) die "--workdir '$workdir': use a path on a filesystem every node mounts" ;;
esac
config_file=${config%%:*} # A config may carry an argument: FILE:ARG.
if [[ $config_file != /* && ! -f $repo_dir/$config_file ]]; then
  die "--config: no file '$config_file' in $repo_dir"
fi
if [[ -z $venv && -f $repo_dir/.venv/bin/activate ]]; then
  venv=$repo_dir/.venv
fi
if [[ -n $venv && ! -f $venv/bin/activate && $dry_run == 0 ]]; then
  die "--venv: no virtualenv in '$venv' (no bin/activate)"
fi

# Prints its arguments as one line of shell words; printf %q quotes each word
# that has a character outside a set that never needs quoting.
quote_words() {
  local line='' word quoted
  for word in "$@"; do
    if [[ $word =~ ^[-A-Za-z0-9_./:=,+@%]+$ ]]; then
      quoted=$word
    else
      printf -v quoted '%q' "$word"
    fi
    line+=" $quoted"
  done
  printf '%s' "${line# }"
}

# Prints a command after "+ " (to stderr when it is also run); runs it unless
# this is a dry run.
run() {
  if ((dry_run)); then
    printf '+ %s\n' "$(quote_words "$@")"
  else
    printf '+ %s\n' "$(quote_words "$@")" >&2
    "$@"
  fi
}

note() {
  if ((dry_run)); then
    printf '# %s\n' "$*"
  else
    printf '%s: %s\n' "$prog" "$*" >&2
  fi
}

# The value of "#SBATCH --NAME=VALUE" in this script's header.
header_value() {
  sed -n "s/^#SBATCH --$1=//p" "$script" | head -n 1
}

# GPUs of this node (in a job), else those the #SBATCH header asks for.
gpus_per_node() {
  local ids
  if [[ -z ${SLURM_JOB_ID:-} ]]; then
    header_value gpus-per-node
  elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    printf '%s' "$SLURM_GPUS_ON_NODE"
  elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
    printf '%s' "${#ids[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU ' || true
  fi
}

# Nodes of this job (in a job), else those the #SBATCH header asks for.
num_nodes() {
  if [[ -n ${SLURM_JOB_ID:-} ]]; then
    printf '%s' "${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
  else
    header_value nodes
  fi
}

has_data_dir=0
config_flags=()
for flag in ${train_flags[@]+"${train_flags[@]}"}; do
  case $flag in
    --config.data.data_dir*) has_data_dir=1 ;;
  esac
  case $flag in
    --config.*) config_flags+=("$flag") ;;
  esac
done

# Compiles the train step for the job's GPUs on this machine's CPU; stops here
# unless it fits. $1: the python to run it with.
run_preflight() {
  local nodes gpus target
  nodes=$(num_nodes)
  gpus=$(gpus_per_node)
  [[ $nodes =~ ^[0-9]+$ && $gpus =~ ^[0-9]+$ ]] ||
    die "cannot tell the job's nodes ($nodes) and GPUs per node ($gpus) for the pre-flight;" \
      "pass --no_preflight"
  target=${gpu}x${gpus}
  if ((nodes > 1)); then
    target+=x$nodes
  fi
  local check=("$1" -m mlm_jax.preflight "--config=$config" "--target=$target")
  check+=(${config_flags[@]+"${config_flags[@]}"})
  note "pre-flight: compile the train step for $target here; go on only if it fits"
  if ((dry_run)); then
    run "${check[@]}"
  else
    printf '+ %s\n' "$(quote_words "${check[@]}")" >&2
    (cd "$repo_dir" && "${check[@]}") ||
      die "the pre-flight for $target failed (see above); nothing was started. Change the" \
        "config as it suggests, or pass --no_preflight to skip it"
  fi
}

# --- Outside an allocation: submit this script ---------------------------------

if [[ -z ${SLURM_JOB_ID:-} ]]; then
  if ((preflight)); then
    local_python=python3
    if [[ -n $venv ]]; then
      local_python=$venv/bin/python
    fi
    run_preflight "${MLM_JAX_PYTHON:-$local_python}"
  fi
  # The job runs the pre-flight again with the sizes sbatch gives it.
  submit=(sbatch "--chdir=$repo_dir" "$repo_dir/launch/slurm_gpu.sh" "--config=$config"
    "--workdir=$workdir" "--gpu=$gpu")
  if [[ -n $venv ]]; then
    submit+=("--venv=$venv")
  fi
  if [[ -n $cache_dir ]]; then
    submit+=("--cache_dir=$cache_dir")
  fi
  if ((!preflight)); then
    submit+=(--no_preflight)
  fi
  if ((${#train_flags[@]})); then
    submit+=(-- "${train_flags[@]}")
  fi
  if ((dry_run)); then
    note "dry run: not inside a SLURM allocation; this submits the job:"
    run "${submit[@]}"
    note "and the job runs (with the #SBATCH header's sizes):"
  else
    command -v sbatch >/dev/null 2>&1 ||
      die "not inside a SLURM allocation and no sbatch on PATH: run this on a login node"
    run "${submit[@]}"
    exit 0
  fi
fi

# --- In the job: one process per node ------------------------------------------

run cd "$repo_dir"
if [[ -n $venv ]]; then
  if ((dry_run)); then
    run source "$venv/bin/activate"
  else
    printf '+ %s\n' "$(quote_words source "$venv/bin/activate")" >&2
    set +u # Some activate scripts read unset variables.
    # shellcheck source=/dev/null  # The virtualenv is chosen at run time.
    source "$venv/bin/activate"
    set -u
  fi
elif ((!dry_run)); then
  command -v python >/dev/null 2>&1 ||
    die "no python on PATH: pass --venv (or MLM_JAX_VENV) with mlm_jax installed"
fi
if [[ -n $cache_dir ]]; then
  run export "MLM_JAX_CACHE=$cache_dir"
elif ((!has_data_dir)); then
  warn "the prepared data goes to ~/.cache/mlm_jax on each node; with several nodes" \
    "pass --cache_dir or --config.data.data_dir on storage every node sees"
fi

# JAX's SLURM detection gives each process only the GPU numbered SLURM_LOCALID
# (one process per GPU); with one process per node it must see all of them.
if [[ -z ${JAX_LOCAL_DEVICE_IDS:-} ]]; then
  gpus=$(gpus_per_node)
  if [[ $gpus =~ ^[0-9]+$ ]] && ((gpus > 0)); then
    device_ids=0
    for ((i = 1; i < gpus; i++)); do
      device_ids+=",$i"
    done
    run export "JAX_LOCAL_DEVICE_IDS=$device_ids"
  else
    warn "cannot tell how many GPUs this node has; set JAX_LOCAL_DEVICE_IDS=0,1,...,N-1" \
      "or each process sees one GPU only"
  fi
fi

if ((preflight)); then
  run_preflight "${MLM_JAX_PYTHON:-python}"
fi

srun_cmd=(srun --ntasks-per-node=1 --kill-on-bad-exit=1)
# srun does not take --cpus-per-task from the allocation in every SLURM version.
cpus=${SLURM_CPUS_PER_TASK:-}
if [[ -z ${SLURM_JOB_ID:-} ]]; then
  cpus=$(header_value cpus-per-task)
fi
if [[ -n $cpus ]]; then
  srun_cmd+=("--cpus-per-task=$cpus")
fi
srun_cmd+=(python -m mlm_jax.train "--config=$config" "--workdir=$workdir")
srun_cmd+=(${train_flags[@]+"${train_flags[@]}"})
run "${srun_cmd[@]}"
