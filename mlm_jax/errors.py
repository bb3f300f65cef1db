"""The errors a user's input or a run's disk can cause, and the checks most config fields need.

Every command prints one of these as one `error:` line (cli.py): USER_ERRORS
with status 2 (change the input), RUN_ERRORS with status 1 (free the disk or
mend the checkpoints, then run the same command). They live here, below every
package, so that the command line imports this small module and not the
packages that raise them (the pre-flight's compilers, Orbax, grain).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
  """A config value is invalid; the message names the field and the fix."""


class CorpusError(ValueError):
  """The corpus options do not name any usable text."""


class DataDirError(ValueError):
  """The data dir holds something other than what this config would make."""


class CheckpointMismatchError(ValueError):
  """The checkpoint was written by a run with other model or vocab settings."""


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (a full or failing disk); the message names the
  directory and its free space."""


class CheckpointReadError(RuntimeError):
  """No checkpoint of the directory reads; the message names each and why."""


class WorkdirLockedError(RuntimeError):
  """Another run holds the directory's lock; the message names it and the way out."""


class TargetError(ValueError):
  """A target name that is unknown or impossible, or a missing compiler; says the fix."""


class PreflightError(ValueError):
  """Bad input for a pre-flight: the message names the field and the fix."""


# Errors caused by the user's input: one line naming the fix, no traceback, status 2.
USER_ERRORS = (ConfigError, CorpusError, DataDirError, CheckpointMismatchError, TargetError,
               PreflightError, FloatingPointError, FileNotFoundError, ImportError,
               WorkdirLockedError)
# A run stopped by its disk or its checkpoints: one line naming the path, status 1.
RUN_ERRORS = (CheckpointWriteError, CheckpointReadError)


def require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def one_of(section: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
  """ConfigError unless config.<section>.<field> is one of `allowed`, listing them."""
  if value not in allowed:
    names = [repr(a) for a in allowed]
    choices = names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' or ' + names[-1]
    raise ConfigError(f'config.{section}.{field}={value!r}: use {choices}.')


# A full disk, a quota, a file size limit, a read-only or failing device.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def disk_error(error: OSError) -> str | None:
  """One line for an OSError of a full or failing disk (its path and free space), else None."""
  if error.errno not in _DISK_ERRNOS:
    return None
  path = os.fsdecode(error.filename) if error.filename else ''
  free = ''
  if path:
    with contextlib.suppress(OSError):
      free = f' ({human_bytes(shutil.disk_usage(os.path.dirname(path) or ".").free)} free there)'
  what = f'{path}: {error.strerror}' if path else f'a write failed: {error.strerror}'
  return (f'{what}{free}. Free space (or fix the disk) and run the same command to resume '
          'from the last checkpoint.')


def human_bytes(n: float) -> str:
  """A byte count for a message: '512 bytes', '3.2 GiB'."""
  if n < 1024:
    return f'{n:.0f} bytes'
  exponent = min(int(math.log(n, 1024)), 4)
  return f'{n / 1024**exponent:.1f} {("KiB", "MiB", "GiB", "TiB")[exponent - 1]}'
