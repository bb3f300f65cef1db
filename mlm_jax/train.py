"""Command line: python -m mlm_jax.train --config=configs/base.py --workdir=DIR.

--eval_only evaluates the starting weights (config.init's) instead of training.

Any config field can be overridden, e.g. --config.train.batch_size=64.
Running the same command again in the same workdir resumes. Several
processes (one per host) run the same command; see docs/scaling.md.
"""

from __future__ import annotations

import jax
from absl import flags

from mlm_jax import cli
from mlm_jax.runtime import sharding
from mlm_jax.training import loop

_CONFIG = cli.config_flag()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and config.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes '
    '(default: $JAX_COORDINATOR_ADDRESS; auto-detected on TPU slices and in SLURM jobs).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, "This process's index in [0, num_processes).")
_EVAL_ONLY = flags.DEFINE_bool(
    'eval_only', False, "Evaluate the weights the run would start from (config.init's model, "
    "e.g. a published checkpoint on a new domain's held-out text) and exit; --workdir is not "
    'written.')
flags.register_multi_flags_validator(
    ['workdir', 'eval_only'], lambda f: bool(f['workdir'] or f['eval_only']),
    '--workdir is required (the run directory), unless --eval_only.')


def main() -> None:
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  run = cli.resolved_config(_CONFIG, num_devices=jax.device_count(), workdir=_WORKDIR.value)
  if _EVAL_ONLY.value:
    loop.evaluate_start(run.config)
    return
  loop.train_and_evaluate(run, _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True, info=True)
