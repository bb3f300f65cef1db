"""The one boundary from the host pipeline to the devices, a batch ahead of the step."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator

import jax
import numpy as np

from mlm_jax.runtime import sharding


class DeviceFeed:
  """Keeps the next global batch on the devices ahead of the step that needs it.

  `fill()` right after dispatching a step builds the next batch (host
  pipeline, then transfer) while the devices compute; `take_wait()` returns
  the seconds spent blocked on the host pipeline since the last call.
  """

  def __init__(self, host_batches: Iterator[dict[str, np.ndarray]], mesh, ahead: int = 1):
    self._host_batches = host_batches
    self._mesh = mesh
    self._ahead = ahead
    self._queue: collections.deque = collections.deque()
    self._wait = 0.0

  def fill(self) -> None:
    while len(self._queue) < self._ahead:
      start = time.perf_counter()
      host = next(self._host_batches)
      self._wait += time.perf_counter() - start
      self._queue.append(sharding.to_global(host, self._mesh))

  def pop(self) -> dict[str, jax.Array]:
    self.fill()
    return self._queue.popleft()

  def take_wait(self) -> float:
    wait, self._wait = self._wait, 0.0
    return wait
