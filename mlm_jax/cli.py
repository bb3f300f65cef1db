"""What every command (python -m mlm_jax.X) shares.

A command module defines its flags at import with absl (the experiment
config with `config_flag()`, overridable field by field as
`--config.a.b=value`) and hands a `main()` without arguments to `run()`,
which checks for stray arguments, chooses JAX's backend before anything
starts one, sets up logging, and turns errors caused by the user's input
into one line on stderr and exit status 2 (no traceback). Commands are thin:
their work lives in the library modules, which define no flags, so that
tests and other programs import them freely.
"""

from __future__ import annotations

import logging as std_logging
import sys
from collections.abc import Callable

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from mlm_jax import configuration
from mlm_jax.data import corpus
from mlm_jax.data import prepare
from mlm_jax.perf import preflight
from mlm_jax.perf import targets
from mlm_jax.runtime import backend
from mlm_jax.runtime import host_malloc
from mlm_jax.training import checkpoint

# Errors caused by the user's input: one line naming the fix, no traceback.
USER_ERRORS = (configuration.ConfigError, corpus.CorpusError, prepare.DataDirError,
               checkpoint.CheckpointMismatchError, targets.TargetError,
               preflight.PreflightError, FloatingPointError, FileNotFoundError, ImportError)


def config_flag(required: bool = True) -> flags.FlagHolder:
  """--config=FILE (a configs/*.py file), with --config.a.b=value overrides."""
  holder = config_flags.DEFINE_config_file(
      'config', None, 'Experiment config file (e.g. configs/base.py); override any field '
      'with --config.a.b=value.', lock_config=True)
  if required:
    flags.mark_flags_as_required(['config'])
  return holder


def overrides(holder: flags.FlagHolder) -> list[str]:
  """The config fields given on the command line ('train.batch_size', ...), in order."""
  return list(config_flags.get_override_values(flags.FLAGS[holder.name]))


class _OwnInfoOnly:
  """Shows INFO lines of this package only; warnings and errors of any."""

  def filter(self, record) -> bool:
    return record.levelno >= std_logging.WARNING or '/mlm_jax/' in record.pathname.replace('\\', '/')


def run(main: Callable[..., int | None], *, backend_choice: str = 'local',
        tune_host_malloc: bool = False, info: bool = False, positional: str = '') -> None:
  """Runs `main()` as a command (`main(args)` when it takes positional arguments).

  backend_choice: 'local' runs JAX on this host's accelerator, or its CPU
  when it has none; 'compile_only' runs JAX on the CPU and compiles for
  targets through their own compilers (mlm_jax.perf.targets).
  tune_host_malloc: apply host_malloc (CPU training; must come before other
  threads allocate). info: log this package's INFO lines (else warnings).
  positional: what the positional arguments are, for the usage error when
  they are missing ('' when the command takes none).
  """

  def command(argv: list[str]) -> None:
    if not positional and len(argv) > 1:
      raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
    if positional and len(argv) < 2:
      raise app.UsageError(f'Give {positional}.')
    if backend_choice == 'compile_only':
      targets.use_cpu_backend()
    else:
      backend.choose_platform()
    malloc = host_malloc.tune() if tune_host_malloc else None
    logging.set_verbosity(logging.INFO if info else logging.WARNING)
    logging.get_absl_handler().addFilter(_OwnInfoOnly())
    if malloc:
      logging.info('Host malloc: %s', malloc)
    try:
      status = main(argv[1:]) if positional else main()
    except USER_ERRORS as e:
      print(f'error: {e}', file=sys.stderr, flush=True)
      sys.exit(2)
    sys.exit(status or 0)

  app.run(command)
