"""What every command (python -m mlm_jax.X) shares.

A command module defines its flags at import with absl (the experiment
config with `config_flag()`, overridable field by field as
`--config.a.b=value`) and hands a `main()` without arguments to `run()`,
which checks for stray arguments, chooses JAX's backend before anything
starts one, sets up logging, and turns errors caused by the user's input
(any flag or config field the command line gets wrong included) into one
line on stderr and exit status 2, and a run stopped by its disk or its
checkpoints into one line and status 1 (no traceback). Commands are thin:
their work lives in the library modules, which define no flags, so that
tests and other programs import them freely.
"""

from __future__ import annotations

import logging as std_logging
import re
import sys
from collections.abc import Callable
from typing import Any
from typing import NoReturn

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from mlm_jax import errors
from mlm_jax.config import run_plan
from mlm_jax.runtime import backend
from mlm_jax.runtime import host_malloc


def config_flag(required: bool = True, default: str | None = None) -> flags.FlagHolder:
  """--config=FILE (a configs/*.py file), with --config.a.b=value overrides; `default`: the
  file read when none is given (a path from the repository's root)."""
  holder = config_flags.DEFINE_config_file(
      'config', default, 'Experiment config file (e.g. configs/base.py); override any field '
      'with --config.a.b=value.', lock_config=True)
  if required and default is None:
    flags.mark_flags_as_required(['config'])
  _CONFIG_FILE_FLAGS.append(holder.name)
  return holder


def config_dict_flag(config: Any, help_string: str) -> flags.FlagHolder:
  """--config.a.b=value overrides of a config defined in code (a ConfigDict).

  ml_collections reads these overrides from the command line as the flag is
  defined, at import: a mistake in one is one `error:` line there too.
  """
  try:
    return config_flags.DEFINE_config_dict('config', config, help_string, lock_config=True)
  except (AttributeError, KeyError) as e:
    _usage_error(_unknown_field(e, sys.argv))
  except flags.Error as e:
    _usage_error(str(e))


# The config file flags of this command: ml_collections reports one that failed to load only
# when it is read.
_CONFIG_FILE_FLAGS: list[str] = []


def overrides(holder: flags.FlagHolder) -> list[str]:
  """The config fields given on the command line ('train.batch_size', ...), in order."""
  return list(config_flags.get_override_values(flags.FLAGS[holder.name]))


def resolved_config(holder: flags.FlagHolder, num_devices: int | None,
                    workdir: str | None = None) -> run_plan.RunPlan:
  """The --config of the command line as the run uses it (run_plan.resolve): checked once, a
  checkpoint's architecture filled in, planned; the command hands it to the library.
  `workdir`: the run's directory, for a command that trains (it names the later phases'
  tokenizer)."""
  return run_plan.resolve(holder.value, num_devices, overrides(holder), workdir)


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
      _usage_error(f'unexpected arguments: {" ".join(argv[1:])} (flags are --name=value).')
    if positional and len(argv) < 2:
      _usage_error(f'give {positional}.')
    if backend_choice == 'compile_only':
      backend.use_cpu_backend()
    else:
      backend.choose_platform()
    malloc = host_malloc.tune() if tune_host_malloc else None
    if not flags.FLAGS['verbosity'].present:  # --verbosity=1 shows everything.
      logging.set_verbosity(logging.INFO if info else logging.WARNING)
    logging.get_absl_handler().addFilter(_OwnInfoOnly())
    if malloc:
      logging.info('Host malloc: %s', malloc)
    try:
      status = main(argv[1:]) if positional else main()
    except errors.USER_ERRORS as e:
      _error_line(str(e), 2)
    except errors.RUN_ERRORS as e:
      _error_line(str(e), 1)
    except OSError as e:
      line = errors.disk_error(e)  # A full or failing disk, wherever the run met it.
      if line is None:
        raise
      _error_line(line, 1)
    sys.exit(status or 0)

  app.run(command, flags_parser=_parse_flags)


def _error_line(message: str, status: int) -> NoReturn:
  print(f'error: {" ".join(message.split())}', file=sys.stderr, flush=True)
  sys.exit(status)


def _usage_error(message: str) -> NoReturn:
  message = message.strip()
  _error_line(f'{message}{"" if message.endswith((".", "?")) else "."} See --help.', 2)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every mistake on the command line one `error:` line and status 2.

  An unknown or misspelt flag or config field (with absl's and
  ml_collections' suggestion), a value of the wrong type, a config file that
  does not load.
  """
  try:
    args = flags.FLAGS(argv)
    for name in _CONFIG_FILE_FLAGS:
      if flags.FLAGS[name].value is not None:
        _ = flags.FLAGS[name].value.keys  # Raises for a config file that did not load.
  except flags.Error as e:
    _usage_error(str(e))
  except (AttributeError, KeyError) as e:  # ml_collections: an override naming no field.
    _usage_error(_unknown_field(e, argv))
  except OSError as e:  # ml_collections: the config file did not load.
    while e.__cause__ is not None:
      e = e.__cause__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    given = [a for a in argv if re.match(r'--?config=', a)]
    _usage_error(f'{given[-1] if given else "--config"}: {lines[-1] if lines else e}')
  return args


def _unknown_field(error: Exception, argv: list[str]) -> str:
  """`--config.a.b=x: no field 'b' in config.a. Did you mean ...?`, from ml_collections' error."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]
  lines = [line.strip() for line in str(error.args[0] if error.args else error).splitlines()]
  name = lines[0].strip('\'"') if lines else ''
  for arg in argv:
    path = re.split(r'[=\s]', arg.lstrip('-'), maxsplit=1)[0].split('.')
    if arg.startswith('-') and len(path) > 1 and name in path[1:]:
      section = '.'.join(path[:path.index(name, 1)])
      return ' '.join([f'{arg}: no field {name!r} in {section}.'] + lines[1:])
  return ' '.join(lines)
