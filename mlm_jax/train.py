"""Command line: python -m mlm_jax.train --config=configs/base.py --workdir=DIR.

Any config field can be overridden, e.g. --config.train.batch_size=64.
Running the same command again in the same workdir resumes. Several
processes (one per host) run the same command; see docs/scaling.md.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.runtime import sharding
from mlm_jax.training import loop

_CONFIG = cli.config_flag()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and config.')
flags.mark_flags_as_required(['workdir'])
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes '
    '(default: $JAX_COORDINATOR_ADDRESS; auto-detected on TPU slices and in SLURM jobs).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, "This process's index in [0, num_processes).")


def main() -> None:
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True, info=True)
