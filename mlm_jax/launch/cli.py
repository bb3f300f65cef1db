"""The launchers' command line: options in; messages and an exit status out.

Both launchers take "--opt VALUE" or "--opt=VALUE", with dashes or
underscores in the name (--accelerator-type), a few flags without a value,
and everything after "--" for the training command.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Sequence

from mlm_jax.launch import runner


class LaunchError(Exception):
  """Stops the launcher: printed as "PROG: error: MESSAGE", exit status 2."""


@dataclasses.dataclass
class Arguments:
  values: dict[str, str]        # Option name (with underscores) -> value, for those given.
  flags: set[str]               # Flags given, by name (with underscores).
  train_flags: list[str]        # Everything after "--".
  help: bool = False            # -h or --help came before anything wrong.


def parse(args: Sequence[str], options: Collection[str], flags: Collection[str]) -> Arguments:
  """Reads `args` in order; the first wrong one raises LaunchError, as -h stops reading."""
  parsed = Arguments({}, set(), [])
  i = 0
  while i < len(args):
    arg = args[i]
    if arg == '--':
      parsed.train_flags = list(args[i + 1:])
      break
    if arg in ('-h', '--help'):
      parsed.help = True
      break
    flag = _flag(arg, flags)
    if flag:
      parsed.flags.add(flag)
    elif arg.startswith('--') and '=' in arg[2:]:
      name, value = arg.split('=', 1)
      _store(parsed, name, value, options)
    elif arg.startswith('--'):
      if i + 1 == len(args):
        raise LaunchError(f'{arg} needs a value')
      _store(parsed, arg, args[i + 1], options)
      i += 1
    else:
      raise LaunchError(f"unexpected argument '{arg}' (flags for the training command go after --)")
    i += 1
  return parsed


def check_config(config: str, repo: str) -> None:
  """A relative config file must be in the repository; a config may carry an argument (FILE:ARG)."""
  config_file = config.split(':', 1)[0]
  if not config_file.startswith('/') and not os.path.isfile(f'{repo}/{config_file}'):
    raise LaunchError(f"--config: no file '{config_file}' in {repo}")


def prefixed(train_flags: Sequence[str], prefix: str) -> list[str]:
  """The training flags that start with `prefix` (such as --config.)."""
  return [flag for flag in train_flags if flag.startswith(prefix)]


def report(prog: str, launch: Callable[[], int]) -> int:
  """Runs `launch`; its exit status, after printing why it stopped if it did."""
  try:
    return launch()
  except LaunchError as e:
    print(f'{prog}: error: {e}', file=sys.stderr, flush=True)
    return 2
  except runner.CommandFailed as e:
    return e.returncode  # The command has said why.
  except KeyboardInterrupt:
    return 130


def _flag(arg: str, flags: Collection[str]) -> str | None:
  for flag in flags:
    if arg in ('--' + flag, '--' + flag.replace('_', '-')):
      return flag
  return None


def _store(parsed: Arguments, name: str, value: str, options: Collection[str]) -> None:
  # A value that looks like an option means the real value was forgotten.
  if value.startswith('-'):
    raise LaunchError(f"{name} needs a value (got '{value}')")
  key = name[2:].replace('-', '_')
  if key not in options:
    raise LaunchError(f'unknown option {name} (see --help)')
  parsed.values[key] = value
