#!/usr/bin/env bash
# Pretrain with mlm_jax on a Cloud TPU slice (TPU VMs, one or several hosts).
# Run from a workstation with gcloud set up; see --help.
# Works with bash 3.2 (macOS) and later.
#
# Options, checks and the gcloud commands are in mlm_jax/launch/tpu.py, which
# needs only Python's standard library; this script finds the repository and
# a Python to run it with.
set -euo pipefail

repo_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Prints the first python >= 3.11 found: a system python3 may be older (3.10 on
# Ubuntu 22.04), so versioned names and the repository's .venv come next.
find_python() {
  local python
  for python in python3 python3.14 python3.13 python3.12 python3.11 "$repo_dir/.venv/bin/python"; do
    if "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
      printf '%s\n' "$python"
      return 0
    fi
  done
  printf '%s: error: no python3 >= 3.11 on PATH\n' "${0##*/}" >&2
  return 1
}

python=$(find_python) || exit 2
# -I: neither PYTHON* variables nor the current directory can shadow the
# launcher's modules, which need only the standard library.
code='import sys; sys.path.insert(0, sys.argv[2]); from mlm_jax.launch import tpu'
exec "$python" -I -c "$code; sys.exit(tpu.main(sys.argv[1:]))" "$0" "$repo_dir" "$@"
