"""Command line: python -m mlm_jax.train --config=configs/base.py --workdir=DIR.

Any config field can be overridden, e.g. --config.train.batch_size=64.
Running the same command again in the same workdir resumes.
"""

from __future__ import annotations

import logging as std_logging
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from mlm_jax import backend
from mlm_jax import checkpoint
from mlm_jax import config_lib
from mlm_jax import corpus
from mlm_jax import host_malloc
from mlm_jax import prepare
from mlm_jax import sharding
from mlm_jax import trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and config.')
flags.mark_flags_as_required(['config', 'workdir'])
# Several processes (one per host) run the same command; see README "Multi-host".
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes '
    '(default: $JAX_COORDINATOR_ADDRESS; auto-detected on TPU slices and in SLURM jobs).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, 'This process\'s index in [0, num_processes).')

# Errors caused by the user's input: shown as one line, without a traceback.
_USER_ERRORS = (config_lib.ConfigError, corpus.CorpusError, prepare.DataDirError,
                checkpoint.CheckpointMismatchError, FloatingPointError)


class _QuietLibraries:
  """Shows INFO lines of this package only; warnings and errors of any."""

  def filter(self, record) -> bool:
    return record.levelno >= std_logging.WARNING or '/mlm_jax/' in record.pathname.replace('\\', '/')


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  backend.choose_platform()  # Before JAX starts a backend.
  # Before any other thread allocates: see host_malloc.py.
  malloc = host_malloc.tune()
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_QuietLibraries())
  logging.info('Host malloc: %s', malloc)
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  try:
    trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except _USER_ERRORS as e:
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  app.run(main)
