#!/usr/bin/env bash
# Pretrain with mlm_jax on a Cloud TPU slice (TPU VMs, one or several hosts).
# Run from a workstation with gcloud set up; see usage() or --help.
# Works with bash 3.2 (macOS) and later.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh --name NAME --zone ZONE --accelerator_type TYPE --workdir DIR
                         [options] [-- TRAIN_FLAGS...]

Creates a Cloud TPU VM slice (or reuses the one called NAME), copies this
repository to every worker, installs it there with JAX for TPU, then starts the
same command on every worker:

  python -m mlm_jax.train --config=CONFIG --workdir=DIR TRAIN_FLAGS...

JAX finds the other workers of the slice by itself: no --coordinator_address,
--num_processes or --process_id. Each worker runs training under nohup and
writes REPO_DIR/train.log; this script then follows worker 0's log until the
run ends. Ctrl-C stops following, not the run.

Required:
  --name NAME              TPU VM name (with --queued, also the queued resource's name)
  --zone ZONE              e.g. us-central2-b, europe-west4-b
  --accelerator_type TYPE  e.g. v4-32, v5litepod-16, v5p-64, v6e-16
  --workdir DIR            run directory, on storage every worker sees (an NFS or
                           Filestore mount, a bucket mounted with gcsfuse); gs:// URLs
                           are not supported. A relative path is under REPO_DIR.

Options:
  --config FILE            experiment config, relative to the repository
                           (default: configs/base.py)
  --cache_dir DIR          shared directory for the prepared data (sets MLM_JAX_CACHE
                           on the workers); default: ~/.cache/mlm_jax on each worker.
                           With several workers, set it (or --config.data.data_dir)
                           to storage every worker sees
  --version VERSION        TPU VM runtime; default by generation: tpu-ubuntu2204-base
                           (v2, v3, v4), v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p),
                           v2-alpha-tpuv6e (v6e)
  --project PROJECT        Google Cloud project (default: gcloud's configured one)
  --preemptible            create a preemptible slice
  --spot                   create a Spot slice
  --queued                 request the slice as a queued resource (gcloud compute tpus
                           queued-resources create) and wait until it is ACTIVE;
                           add --spot for Spot capacity
  --repo_dir DIR           where the repository goes on the workers (default: ~/mlm_jax)
  --python VERSION         Python of the workers' virtualenv REPO_DIR/.venv, made with
                           uv (default: 3.12; the TPU images' python3 is 3.10, older
                           than this project needs)
  --no_preflight           skip the pre-flight: by default the train step is first
                           compiled here for TYPE (python -m mlm_jax.preflight, which
                           needs pip install -e '.[aot]') and nothing is created
                           unless it fits
  --dry_run                print the commands, one per line after "+ ", instead of
                           running them; gcloud is not called at all
  -h, --help               show this help

Options take "--opt VALUE" or "--opt=VALUE"; dashes work too (--accelerator-type).
Everything after "--" goes to the training command, e.g.
  -- --config.train.batch_size=1024 --config.train.num_steps=100000

Example:
  launch/tpu_pod.sh --name=bert-v4 --zone=us-central2-b --accelerator_type=v4-32 \
      --workdir=/mnt/shared/runs/base --cache_dir=/mnt/shared/cache \
      -- --config.train.batch_size=1024

Later (NAME, ZONE and REPO_DIR as above):
  follow the log:  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=0 \
                       --command='tail -n 50 -F ~/mlm_jax/train.log'
  stop the run:    gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all \
                       --command='kill $(cat ~/mlm_jax/train.pid)'
                   (SIGTERM: it writes a checkpoint, then exits; the same launch
                   command resumes it)
  delete:          gcloud compute tpus tpu-vm delete NAME --zone=ZONE
                   (--queued: gcloud compute tpus queued-resources delete NAME
                    --zone=ZONE --force)
EOF
}

prog=${0##*/}
die() {
  printf '%s: error: %s\n' "$prog" "$*" >&2
  exit 2
}
warn() {
  printf '%s: warning: %s\n' "$prog" "$*" >&2
}

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

name='' zone='' accelerator_type='' version='' project='' workdir=''
config='configs/base.py' repo_dir=\~/mlm_jax python_version='3.12' cache_dir=''
preemptible=0 spot=0 queued=0 dry_run=0 preflight=1
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
    name) name=$2 ;;
    zone) zone=$2 ;;
    accelerator_type) accelerator_type=$2 ;;
    version) version=$2 ;;
    project) project=$2 ;;
    workdir) workdir=$2 ;;
    config) config=$2 ;;
    cache_dir) cache_dir=$2 ;;
    repo_dir) repo_dir=$2 ;;
    python) python_version=$2 ;;
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
    --preemptible) preemptible=1 ;;
    --spot) spot=1 ;;
    --queued) queued=1 ;;
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

# --- Validation -------------------------------------------------------------

[[ -n $name ]] || die "missing required option --name (the TPU VM's name)"
[[ -n $zone ]] || die "missing required option --zone (e.g. us-central2-b)"
[[ -n $accelerator_type ]] ||
  die "missing required option --accelerator_type (e.g. v4-32, v5litepod-16, v5p-64)"
[[ -n $workdir ]] || die "missing required option --workdir (a directory every worker sees)"

[[ $name =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] ||
  die "--name '$name': use lower-case letters, digits and dashes, starting with a letter"
[[ $accelerator_type =~ ^[a-z0-9]+-[0-9]+$ ]] ||
  die "--accelerator_type '$accelerator_type' is not of the form GENERATION-SIZE (e.g. v4-32)"
case $workdir in
  gs://*)
    die "--workdir '$workdir': gs:// URLs are not supported; use a path on storage every" \
      "worker mounts (NFS/Filestore, or the bucket mounted with gcsfuse)"
    ;;
esac
[[ -n $repo_dir ]] || die "--repo_dir must not be empty"
config_file=${config%%:*} # A config may carry an argument: FILE:ARG.
if [[ $config_file != /* && ! -f $repo_root/$config_file ]]; then
  die "--config: no file '$config_file' in $repo_root"
fi
((preemptible + spot < 2)) || die "--preemptible and --spot exclude each other"
if ((queued && preemptible)); then
  die "--preemptible does not apply to --queued; use --queued --spot"
fi

if [[ -z $version ]]; then
  case $accelerator_type in
    v2-* | v3-* | v4-*) version=tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) version=v2-alpha-tpuv5-lite ;;
    v5p-*) version=v2-alpha-tpuv5 ;;
    v6e-*) version=v2-alpha-tpuv6e ;;
    *) die "no default runtime for --accelerator_type=$accelerator_type; pass --version" ;;
  esac
fi

# --- Helpers ------------------------------------------------------------------

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

# Prints a command as one line after "+ ".
show() {
  printf '+ %s\n' "$(quote_words "$@")"
}

# Prints a command; runs it unless this is a dry run.
run() {
  if ((dry_run)); then
    show "$@"
  else
    show "$@" >&2
    "$@"
  fi
}

# A comment line: on stdout in a dry run (between the commands), else on stderr.
note() {
  if ((dry_run)); then
    printf '# %s\n' "$*"
  else
    printf '%s: %s\n' "$prog" "$*" >&2
  fi
}

# Quotes a word for the workers' shell.
q() {
  printf '%q' "$1"
}

# Quotes a path for the workers' shell, leaving a leading ~ to expand there.
remote_path() {
  case $1 in
    \~) printf '%s' "~" ;;
    \~/*) printf '%s/%s' "~" "$(q "${1#\~/}")" ;;
    *) q "$1" ;;
  esac
}

gcloud_flags=("--zone=$zone")
if [[ -n $project ]]; then
  gcloud_flags+=("--project=$project")
fi

create_slice() {
  local create
  if ((queued)); then
    create=(gcloud compute tpus queued-resources create "$name" "--node-id=$name"
      "${gcloud_flags[@]}" "--accelerator-type=$accelerator_type"
      "--runtime-version=$version")
  else
    create=(gcloud compute tpus tpu-vm create "$name" "${gcloud_flags[@]}"
      "--accelerator-type=$accelerator_type" "--version=$version")
    if ((preemptible)); then
      create+=(--preemptible)
    fi
  fi
  if ((spot)); then
    create+=(--spot)
  fi
  run "${create[@]}"
}

tpu_state() {
  gcloud compute tpus tpu-vm describe "$name" "${gcloud_flags[@]}" \
    --format='value(state)' 2>/dev/null
}

queued_state() {
  gcloud compute tpus queued-resources describe "$name" "${gcloud_flags[@]}" \
    --format='value(state.state)' 2>/dev/null
}

wait_until_active() {
  local state last='' failures=0
  while :; do
    if state=$(queued_state); then
      failures=0
    else
      state=''
      failures=$((failures + 1))
      ((failures < 5)) ||
        die "cannot describe queued resource $name (gcloud compute tpus queued-resources" \
          "describe $name ${gcloud_flags[*]})"
    fi
    case $state in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDING | SUSPENDED)
        die "queued resource $name is $state; see gcloud compute tpus queued-resources" \
          "describe $name ${gcloud_flags[*]}"
        ;;
    esac
    if [[ $state != "$last" ]]; then
      note "queued resource $name is ${state:-not visible yet}; waiting until it is ACTIVE"
      last=$state
    fi
    sleep 30
  done
}

# --- 0. Pre-flight --------------------------------------------------------------

# The local Python with mlm_jax[aot]: MLM_JAX_PYTHON, else the repository's .venv.
local_python=${MLM_JAX_PYTHON:-}
if [[ -z $local_python ]]; then
  local_python=python3
  [[ -x $repo_root/.venv/bin/python ]] && local_python=$repo_root/.venv/bin/python
fi
if ((preflight)); then
  check=("$local_python" -m mlm_jax.preflight "--config=$config" "--target=$accelerator_type")
  for flag in ${train_flags[@]+"${train_flags[@]}"}; do
    case $flag in
      --config.*) check+=("$flag") ;;
    esac
  done
  note "0. pre-flight: compile the train step for $accelerator_type here; go on only if it fits"
  if ((dry_run)); then
    show "${check[@]}"
  else
    show "${check[@]}" >&2
    (cd "$repo_root" && "${check[@]}") ||
      die "the pre-flight for $accelerator_type failed (see above); nothing was created." \
        "Change the config as it suggests, or pass --no_preflight to skip it"
  fi
fi

# --- 1. The slice -------------------------------------------------------------

if ((dry_run)); then
  note "dry run: gcloud is not called, so whether TPU $name exists is not checked;" \
    "the commands assume it must be created"
  note "1. create the slice"
  create_slice
  if ((queued)); then
    note "wait until this prints ACTIVE:" \
      "$(quote_words gcloud compute tpus queued-resources describe "$name" "${gcloud_flags[@]}" \
        '--format=value(state.state)')"
  fi
else
  state=$(tpu_state) || state=''
  if [[ -n $state ]]; then
    [[ $state == READY ]] ||
      die "TPU $name exists but is $state, not READY; delete it (gcloud compute tpus" \
        "tpu-vm delete $name ${gcloud_flags[*]}) or choose another --name"
    note "1. reusing TPU $name (READY)"
  elif ((queued)); then
    if state=$(queued_state) && [[ -n $state ]]; then
      note "1. queued resource $name exists ($state)"
    else
      note "1. request the slice"
      create_slice
    fi
    wait_until_active
  else
    note "1. create the slice"
    create_slice
  fi
fi

# --- 2. Copy this repository to every worker -----------------------------------

if ((dry_run)); then
  tmp_dir=/tmp/mlm_jax-launch
else
  tmp_dir=$(mktemp -d)
  trap 'rm -rf "$tmp_dir"' EXIT
fi
tarball=$tmp_dir/mlm_jax-src.tar.gz
note "2. copy the working tree (without .git, .venv, runs and build outputs) to every worker"
# COPYFILE_DISABLE keeps macOS tar from adding ._* files.
run env COPYFILE_DISABLE=1 tar -czf "$tarball" --exclude=.git --exclude=.venv \
  --exclude=__pycache__ --exclude='*.egg-info' --exclude=.pytest_cache --exclude=./runs \
  --exclude=./exported --exclude=./build --exclude=./dist -C "$repo_root" .
run gcloud compute tpus tpu-vm scp "$tarball" "$name:mlm_jax-src.tar.gz" --worker=all \
  "${gcloud_flags[@]}"

# --- 3. Install on every worker ------------------------------------------------

rdir=$(remote_path "$repo_dir")
install_command="set -e; mkdir -p $rdir; cd $rdir"
install_command+="; if [ -f train.pid ] && kill -0 \"\$(cat train.pid)\" 2>/dev/null; then"
install_command+=" echo \"error: a run is still going on \$(hostname) (pid \$(cat train.pid));"
install_command+=" stop it first (see launch/tpu_pod.sh --help)\" >&2; exit 1; fi"
install_command+="; tar -xzf ~/mlm_jax-src.tar.gz; rm -f ~/mlm_jax-src.tar.gz"
install_command+="; if [ ! -x .venv/bin/python ]; then"
install_command+=" python3 -m pip install --user --quiet --upgrade uv"
install_command+="; python3 -m uv venv --seed --python $(q "$python_version") .venv; fi"
install_command+="; .venv/bin/pip install --quiet -e . 'jax[tpu]'"
note "3. install on every worker (virtualenv $repo_dir/.venv, Python $python_version)"
run gcloud compute tpus tpu-vm ssh "$name" --worker=all "${gcloud_flags[@]}" \
  "--command=$install_command"

# --- 4. Train on every worker --------------------------------------------------

has_data_dir=0
for flag in ${train_flags[@]+"${train_flags[@]}"}; do
  case $flag in
    --config.data.data_dir*) has_data_dir=1 ;;
  esac
done
if [[ -z $cache_dir && $has_data_dir == 0 ]]; then
  warn "the prepared data goes to ~/.cache/mlm_jax on each worker; on a slice of" \
    "several hosts pass --cache_dir or --config.data.data_dir on storage every worker sees"
fi

train=(python -m mlm_jax.train "--config=$config" "--workdir=$workdir")
train+=(${train_flags[@]+"${train_flags[@]}"})
train_words=''
for word in "${train[@]:1}"; do
  train_words+=" $(q "$word")"
done
start_command="set -e; cd $rdir; "
if [[ -n $cache_dir ]]; then
  start_command+="MLM_JAX_CACHE=$(remote_path "$cache_dir") "
fi
start_command+="setsid nohup .venv/bin/python$train_words > train.log 2>&1 < /dev/null &"
start_command+=" echo \$! > train.pid"
note "4. start on every worker: $(quote_words "${train[@]}")"
run gcloud compute tpus tpu-vm ssh "$name" --worker=all "${gcloud_flags[@]}" \
  "--command=$start_command"

# --- 5. Follow worker 0's log --------------------------------------------------

note "5. follow worker 0's log until the run ends (Ctrl-C stops following, not the run);" \
  "stop the run: $(quote_words gcloud compute tpus tpu-vm ssh "$name" --worker=all \
    "${gcloud_flags[@]}" "--command=kill \$(cat $rdir/train.pid)")"
run gcloud compute tpus tpu-vm ssh "$name" --worker=0 "${gcloud_flags[@]}" \
  "--command=cd $rdir && tail --pid=\"\$(cat train.pid)\" -n +1 -F train.log"
if ((!dry_run)); then
  note "the run on worker 0 has ended; the other workers' logs are in $repo_dir/train.log" \
    "(gcloud compute tpus tpu-vm ssh $name ${gcloud_flags[*]} --worker=N)"
fi
