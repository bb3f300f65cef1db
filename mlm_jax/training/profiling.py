"""A jax.profiler trace of a few train steps, set by config.profile.

With config.profile.start_step=s and num_steps=n > 0, the steps logged as
s, ..., s+n-1 (step 1 is the first update of a run; step 1 includes
compilation) are traced into WORKDIR/profile:

  WORKDIR/profile/plugins/profile/<timestamp>/<host>.xplane.pb
  WORKDIR/profile/plugins/profile/<timestamp>/<host>.trace.json.gz

To look at it, either
  - pip install tensorboard-plugin-profile (or xprof), then
    `tensorboard --logdir WORKDIR/profile` and open the PROFILE tab (trace
    viewer, per-op statistics, memory), or
  - open <host>.trace.json.gz (Chrome trace format) at https://ui.perfetto.dev
    (timeline only).

Python calls are traced only with config.profile.trace_python: a host-side
stall (e.g. in the input pipeline) then shows, but the trace grows by orders
of magnitude, and the trace viewer stops at a million events.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import ml_collections
from absl import logging


class StepProfiler:
  """Starts the trace before step `start`, stops it after step `start + num - 1`."""

  def __init__(self, workdir: str, profile: ml_collections.ConfigDict, *, resumed_at: int = 0):
    """`profile`: config.profile (start_step, num_steps, trace_python)."""
    start_step, num_steps = profile.start_step, profile.num_steps
    self.directory = os.path.join(workdir, 'profile')
    self._options = jax.profiler.ProfileOptions()
    self._options.python_tracer_level = 1 if profile.trace_python else 0
    self._first = start_step
    self._last = start_step + num_steps - 1
    self._enabled = num_steps > 0
    self._active = False
    if self._enabled and start_step <= resumed_at:
      logging.warning('config.profile.start_step=%d is not after step %d this run resumes '
                      'from: nothing will be profiled.', start_step, resumed_at)
      self._enabled = False

  def step_context(self, step: int):
    """Enter around train step `step` (1-based): starts the trace at the first one."""
    if not self._enabled or not self._first <= step <= self._last:
      return contextlib.nullcontext()
    if not self._active:
      logging.info('Profiling steps %d-%d into %s', self._first, self._last, self.directory)
      jax.profiler.start_trace(self.directory, profiler_options=self._options)
      self._active = True
    # Marks step boundaries for the profile plugin's step-time views.
    return jax.profiler.StepTraceAnnotation('train', step_num=step)

  def after_step(self, step: int, outputs: Any) -> bool:
    """Stops the trace after the last profiled step, once its work is done.

    Returns whether it stopped one (writing it takes a while: not train time).
    """
    if self._active and step >= self._last:
      # Dispatch is asynchronous: without this the trace would end before
      # the device finished the steps it should show.
      jax.block_until_ready(outputs)
      self.stop()
      return True
    return False

  def stop(self) -> None:
    """Ends a running trace (also on an early exit); writes the files."""
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
      logging.info('Profile written to %s', self.directory)
