"""Stopping a run cleanly: a signal becomes a checkpoint at a step every process agrees on.

Test hook: MLM_JAX_TEST_SIGNAL='SIGTERM@3' makes a run send itself SIGTERM
right after step 3; 'SIGSTOP@save:6' as the save of step 6 is about to
write (its room checked, nothing written); 'SIGKILL@saving:6' once the
asynchronous save of step 6 is under way. Read once, at import; tests use it
to interrupt a run at an exact point instead of racing a live one.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from absl import logging
from jax.experimental import multihost_utils


class StopRequest:
  """Turns the first SIGINT/SIGTERM into a request to checkpoint and stop.

  One process: the signal sets the request, honoured after the current step.
  Several processes must all save the same step, whichever of them got the
  signal and whenever: SIGTERM is left to JAX's preemption service (installed
  by jax.distributed.initialize), which propagates the notice to every
  process and names a step all of them reach; `poll(step)` asks it every
  step. SIGINT is turned into a SIGTERM to this process, so Ctrl-C takes the
  same path. A second signal interrupts at once (the last complete checkpoint
  remains).
  """

  def __init__(self, multi_process: bool = False):
    self.requested = False
    self.signal_name = ''
    self._multi_process = multi_process
    self._previous: dict[int, Any] = {}

  def poll(self, step: int) -> None:
    """Call once per step on every process, after the step."""
    signal_hook_for_tests('step', step)
    if self._multi_process and multihost_utils.reached_preemption_sync_point(step):
      self.requested = True
      self.signal_name = self.signal_name or 'SIGTERM'

  def _handle(self, signum, frame):
    if self.requested or (self._multi_process and self.signal_name):
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    if self._multi_process:
      logging.warning('%s received: all processes will save a checkpoint at a step they agree '
                      'on (send again to abort).', self.signal_name)
      os.kill(os.getpid(), signal.SIGTERM)  # To JAX's preemption notifier.
      return
    self.requested = True
    logging.warning('%s received: saving a checkpoint after this step (send again to abort).',
                    self.signal_name)

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self  # Signals are delivered to the main thread only.
    signals = (signal.SIGINT,) if self._multi_process else (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    return False


def _test_signal_from_env() -> tuple[int, str, int] | None:
  """(signal, event, step) of MLM_JAX_TEST_SIGNAL ('NAME@STEP', 'NAME@EVENT:STEP'), or None."""
  value = os.environ.get(TEST_SIGNAL_ENV, '')
  if not value:
    return None
  try:
    name, when = value.split('@')
    event, _, step = when.rpartition(':')
    if event not in ('', 'save', 'saving'):
      raise ValueError(event)
    return signal.Signals[name].value, event or 'step', int(step)
  except (ValueError, KeyError) as e:
    raise ValueError(f'{TEST_SIGNAL_ENV}={value!r}: use NAME@STEP, NAME@save:STEP or '
                     'NAME@saving:STEP, e.g. SIGTERM@3') from e


def signal_hook_for_tests(event: str, step: int) -> None:
  """The test hook: signals this process when (event, step) is the one the environment names."""
  if _TEST_SIGNAL is not None and _TEST_SIGNAL[1:] == (event, step):
    os.kill(os.getpid(), _TEST_SIGNAL[0])


TEST_SIGNAL_ENV = 'MLM_JAX_TEST_SIGNAL'
_TEST_SIGNAL = _test_signal_from_env()
