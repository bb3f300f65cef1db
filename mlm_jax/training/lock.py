"""One run per directory: a lock file naming the run that writes there.

  DIR/run.lock   {"host", "pid", "started", "command"}: JSON, its mtime the heartbeat

Two runs in one workdir would write checkpoints into the same directory and
every metric twice. Process 0 of a run takes the lock before anything is
written and removes it when the run ends, however it ends short of a kill;
while it runs, its mtime is refreshed every HEARTBEAT_S. A second run is
refused with one line naming the holder. A lock whose run is gone is taken
over, with a warning: on the same host, when its process no longer exists;
from another host, when its heartbeat is older than STALE_AFTER_S.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from mlm_jax.errors import WorkdirLockedError

FILE_NAME = 'run.lock'
# The holder refreshes the lock's mtime this often...
HEARTBEAT_S = 30
# ...and a lock held from another host whose mtime is older than this is taken over.
STALE_AFTER_S = 300



@contextlib.contextmanager
def hold(directory: str) -> Iterator[None]:
  """Holds `directory`'s lock for the duration (process 0 takes it; every process agrees).

  Raises WorkdirLockedError on every process when another live run holds it.
  """
  lock, error = None, ''
  if jax.process_index() == 0:
    try:
      lock = _Lock.take(directory)
    except WorkdirLockedError as e:
      error = str(e)
  if jax.process_count() > 1:
    taken = bool(multihost_utils.broadcast_one_to_all(np.int32(lock is not None)))
    if not taken and not error:
      error = (f'process 0 could not take the lock of {directory}: another run holds it '
               "(process 0's error names it).")
  if error:
    raise WorkdirLockedError(error)
  try:
    yield
  finally:
    if lock is not None:
      lock.release()


class _Lock:
  """The lock file of one directory, held by this process, with its heartbeat thread."""

  def __init__(self, path: str, record: dict[str, Any], created_directory: bool = False):
    self.path, self.record = path, record
    # A directory made only to hold the lock is removed with it when the run
    # left nothing else there (bad input refused before any work).
    self._created_directory = created_directory
    self._stop = threading.Event()
    self._beat = threading.Thread(target=self._heartbeat, name='run_lock_heartbeat', daemon=True)
    self._beat.start()

  @classmethod
  def take(cls, directory: str) -> _Lock:
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE_NAME)
    now = time.time()
    record = {'host': socket.gethostname(), 'pid': os.getpid(),
              'started': datetime.datetime.fromtimestamp(now).isoformat(timespec='seconds'),
              'started_unix': now, 'command': ' '.join([os.path.basename(sys.executable)]
                                                       + sys.argv)}
    with open(path, 'a+') as f:
      # Reading, judging and writing the file is one step for every taker on
      # this host (and across hosts where the filesystem supports flock).
      with contextlib.suppress(OSError):
        import fcntl  # pylint: disable=import-outside-toplevel  # POSIX only
        fcntl.flock(f, fcntl.LOCK_EX)
      f.seek(0)
      text = f.read()
      if text.strip():
        _take_over_or_refuse(path, text, os.fstat(f.fileno()).st_mtime)
      f.seek(0)
      f.truncate()
      json.dump(record, f, indent=2)
      f.flush()
      os.fsync(f.fileno())
    return cls(path, record, created)

  def release(self) -> None:
    """Stops the heartbeat and removes the lock file, if it still names this run."""
    self._stop.set()
    with contextlib.suppress(OSError, ValueError):
      with open(self.path) as f:
        if json.load(f) == self.record:
          os.remove(self.path)
    if self._created_directory:
      with contextlib.suppress(OSError):  # Not empty: the run wrote something.
        os.rmdir(os.path.dirname(self.path))

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with contextlib.suppress(OSError):
        os.utime(self.path)


def _take_over_or_refuse(path: str, text: str, mtime: float) -> None:
  """Warns and returns when the lock in `text` is stale; raises WorkdirLockedError otherwise."""
  try:
    holder = json.loads(text)
    host, pid, started = holder['host'], int(holder['pid']), holder['started']
  except (ValueError, KeyError, TypeError):
    logging.warning('%s is not a lock this program wrote (%r...): taking it over.', path,
                    text[:80])
    return
  age = time.time() - mtime
  who = f'pid {pid} on host {host}, started {started} ({holder.get("command", "?")})'
  if host == socket.gethostname():
    gone = not _running(pid, holder.get('started_unix'))
    reason = f'process {pid} no longer exists'
  else:
    gone = age > STALE_AFTER_S
    reason = f'its heartbeat is {age:.0f} s old (stale after {STALE_AFTER_S} s)'
  if gone:
    logging.warning('Taking over the lock %s of a run that is gone: %s; %s.', path, who, reason)
    return
  directory = os.path.dirname(path)
  raise WorkdirLockedError(
      f'{directory} is in use by another run: {who}, heartbeat {age:.0f} s ago. Wait for it to '
      f'end or stop it, or use another directory; if that run is gone, delete {path}.')


def _running(pid: int, started_unix: float | None) -> bool:
  """Whether `pid` is a live process on this host that was already running at `started_unix`."""
  if pid == os.getpid():
    # This process: the same run only if it took the lock after it started (a
    # restarted container can give a new run the pid of the old one).
    start = _process_start(pid)
    return start is None or started_unix is None or started_unix >= start - 1
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Someone else's process: alive.
  start = _process_start(pid)
  # A process that started after the lock was taken reuses the pid of a dead holder.
  return start is None or started_unix is None or start <= started_unix + 1


def _process_start(pid: int) -> float | None:
  """The start time (Unix seconds) of process `pid`, from /proc; None where unknown."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/stat') as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith('btime'))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    return None
