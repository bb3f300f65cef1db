"""Printing commands as shell lines, and running them as a shell script would.

Every command is printed after "+ " before it runs (on stderr), or instead of
running (on stdout, in a dry run). The runner keeps the working directory and
the environment the commands get, so that `cd`, `export` and `source` print
as shell lines and act on the commands that follow, as in a shell script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from collections.abc import Sequence

from mlm_jax.launch import shell

# Sources a virtualenv's activate script in bash, then prints the environment
# it leaves as JSON (the script's own output goes to stderr).
_ACTIVATE = ('source "$1" >&2 && exec "$2" -I -c '
             '"import json, os, sys; json.dump(dict(os.environ), sys.stdout)"')


class CommandFailed(Exception):
  """A command exited with `returncode`; the launcher stops with it, as under `set -e`."""

  def __init__(self, returncode: int) -> None:
    super().__init__(returncode)
    self.returncode = returncode


class Runner:
  """Prints and runs commands for launcher `prog`, or only prints them in a dry run."""

  def __init__(self, prog: str, dry_run: bool, env: Mapping[str, str] | None = None,
               cwd: str | None = None) -> None:
    self.prog = prog
    self.dry_run = dry_run
    self.env = dict(os.environ if env is None else env)
    self.cwd = cwd

  def show(self, argv: Sequence[str]) -> None:
    """Prints a command after "+ ": on stdout in a dry run, else on stderr."""
    _print('+ ' + shell.quote_words(argv), stderr=not self.dry_run)

  def note(self, message: str) -> None:
    """A comment: "# ..." between the commands of a dry run, else on stderr."""
    if self.dry_run:
      _print('# ' + message)
    else:
      _print(f'{self.prog}: {message}', stderr=True)

  def warn(self, message: str) -> None:
    _print(f'{self.prog}: warning: {message}', stderr=True)

  def status(self, argv: Sequence[str], cwd: str | None = None) -> int:
    """Prints and runs a command; its exit status (0 in a dry run)."""
    self.show(argv)
    if self.dry_run:
      return 0
    return self._call(argv, cwd or self.cwd)

  def run(self, argv: Sequence[str], cwd: str | None = None) -> None:
    """Prints and runs a command; raises CommandFailed if it fails."""
    returncode = self.status(argv, cwd)
    if returncode:
      raise CommandFailed(returncode)

  def output(self, argv: Sequence[str], quiet: bool = False) -> tuple[int, str]:
    """Runs a command without printing it: (exit status, its stdout).

    quiet: discard its stderr too.
    """
    try:
      done = subprocess.run(argv, check=False, cwd=self.cwd, env=self.env, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL if quiet else None)
    except OSError as e:
      return _not_started(e), ''
    return done.returncode, done.stdout

  def which(self, command: str) -> str | None:
    """Where `command` is on the commands' PATH."""
    return shutil.which(command, path=self.env.get('PATH', os.defpath))

  def cd(self, path: str) -> None:
    self.show(['cd', path])
    self.cwd = path

  def export(self, name: str, value: str) -> None:
    self.show(['export', f'{name}={value}'])
    self.env[name] = value

  def source(self, script: str) -> None:
    """Sources a virtualenv's activate script; later commands get its environment."""
    self.show(['source', script])
    if self.dry_run:
      return
    returncode, printed = self.output(['bash', '-c', _ACTIVATE, 'bash', script, sys.executable])
    if returncode:
      raise CommandFailed(returncode)
    self.env = json.loads(printed)

  def _call(self, argv: Sequence[str], cwd: str | None) -> int:
    try:
      process = subprocess.Popen(argv, cwd=cwd, env=self.env)
    except OSError as e:
      reason = 'command not found' if isinstance(e, FileNotFoundError) else e.strerror
      _print(f'{self.prog}: {argv[0]}: {reason}', stderr=True)
      return _not_started(e)
    return _wait(process)


def _wait(process: subprocess.Popen) -> int:
  """The exit status as a shell reports it (128 + N if killed by signal N).

  Ctrl-C reaches the command too; as a shell does, wait for it to end rather
  than leave it behind (Ctrl-C while following a TPU log stops following).
  """
  while True:
    try:
      returncode = process.wait()
      break
    except KeyboardInterrupt:
      continue
  return 128 - returncode if returncode < 0 else returncode


def _not_started(error: OSError) -> int:
  # The shell's statuses for a command it cannot find or cannot execute.
  return 127 if isinstance(error, FileNotFoundError) else 126


def _print(line: str, stderr: bool = False) -> None:
  print(line, file=sys.stderr if stderr else sys.stdout, flush=True)
