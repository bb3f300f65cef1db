"""What a training run reports as it goes: one record per log interval, timed.

`TrainingLog` gathers the step metrics of a log interval (left on the
devices until the interval ends, so the loop never waits for them), and at
each log step writes their means, tokens/s and the share of time spent
waiting for input. Tokens/s counts training steps only: the compile step,
evaluations and writing a profile happen between steps, and each one
`restart()`s the interval clock, marking the steps before it as untimed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from mlm_jax.training import feed as feed_lib
from mlm_jax.training import metrics as metrics_lib
from mlm_jax.training import objective
from mlm_jax.training import summary


class IntervalLog:
  """What pretraining's and fine-tuning's logs share: step metrics kept on the devices
  until their log interval ends, the interval's clock, a progress bar, the writer."""

  def __init__(self, writer: metrics_lib.MetricsWriter, *, start_step: int, num_steps: int,
               show: bool, checkpoint_dir: str):
    self.writer = writer
    self._checkpoint_dir = checkpoint_dir
    self._pending: list[dict[str, jax.Array]] = []
    self._untimed = 0   # Steps at the head of `_pending` whose time is not in the interval.
    self._start = time.perf_counter()
    self._progress = tqdm(total=num_steps, initial=start_step, unit='step', dynamic_ncols=True,
                          disable=not (show and sys.stderr.isatty()))

  def add(self, metrics: dict[str, jax.Array]) -> None:
    """Records one train step's metrics (still on the devices).

    Waits for the step before it: at most one step is queued behind the
    running one. A deeper queue gains nothing, and several devices of one
    process (XLA:CPU's) can deadlock in their collectives with many steps in
    flight.
    """
    if self._pending:
      jax.block_until_ready(self._pending[-1])
    self._pending.append(metrics)
    self._progress.update(1)

  def restart(self) -> None:
    """Leaves the time since the interval began (and its steps) out of the speed."""
    self._untimed = len(self._pending)
    self._start = time.perf_counter()

  def _take_interval(self) -> tuple[list[dict[str, Any]], int, float]:
    """(the interval's metrics on the host, its untimed steps, its seconds); a new interval."""
    host = jax.device_get(self._pending)
    seconds = max(time.perf_counter() - self._start, 1e-9)
    untimed = self._untimed
    self._pending.clear()
    self._untimed = 0
    self._start = time.perf_counter()
    return host, untimed, seconds

  def close(self) -> None:
    self._progress.close()
    self.writer.close()


class TrainingLog(IntervalLog):
  """Metrics of each log interval -> metrics.jsonl / TensorBoard, a progress bar, counters."""

  def __init__(self, writer: metrics_lib.MetricsWriter, feed: feed_lib.DeviceFeed, *,
               start_step: int, num_steps: int, earlier_tokens: int | None, show: bool,
               checkpoint_dir: str, figures: Callable[[int], dict[str, Any]] | None = None):
    super().__init__(writer, start_step=start_step, num_steps=num_steps, show=show,
                     checkpoint_dir=checkpoint_dir)
    self.counters = summary.Counters()
    self.earlier_tokens = earlier_tokens  # Seen before this invocation, if known.
    self._feed = feed
    self._figures = figures  # More figures of the run at a step (a mixture's, per source).

  def restart(self) -> None:
    super().restart()
    self._feed.take_wait()

  def first_step_done(self) -> float:
    """Waits for the first step (it compiles); returns its seconds, which stay untimed."""
    jax.block_until_ready(self._pending[-1])
    seconds = time.perf_counter() - self._start
    self.restart()
    return seconds

  def write(self, step: int) -> dict[str, float]:
    """Writes the interval's record (loss, accuracy, lr, grad norm, speed, input wait)."""
    host_metrics, untimed, seconds = self._take_interval()
    record = interval_means(host_metrics)
    record.update(self.counters.add_interval(host_metrics, untimed, seconds))
    # Near 0 when the host pipeline keeps up with the devices.
    record['input_wait_fraction'] = min(self._feed.take_wait() / seconds, 1.0)
    if self.earlier_tokens is not None:
      record['tokens_seen'] = self.earlier_tokens + self.counters.tokens
    if self._figures is not None:
      record.update(self._figures(step))
    check_finite(record['loss'], step, self._checkpoint_dir)
    self.writer.write(step, record)
    self._progress.set_postfix(loss=f'{record["loss"]:.3f}', acc=f'{record["mlm_accuracy"]:.3f}')
    return record

  def write_eval(self, step: int, result: dict[str, Any]) -> None:
    self.writer.write(step, {f'eval_{k}': v for k, v in result.items()})
    self.restart()


def interval_means(metrics: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """A log interval's record: loss and accuracy weighted by masked tokens, the last
  learning rate, the mean gradient norm, and accuracies by kind of slot next to the most
  frequent token's rate (step.slot_metrics)."""
  masked = np.array([m['num_masked'] for m in metrics], np.float64)
  weights = masked / max(masked.sum(), 1.0)
  sums = {k: float(sum(m[k] for m in metrics)) for k in metrics[0] if k.endswith('_sum')}
  record = {
      'loss': float(sum(w * m['loss'] for w, m in zip(weights, metrics))),
      'mlm_accuracy': float(sum(w * m['mlm_accuracy'] for w, m in zip(weights, metrics))),
      'learning_rate': float(metrics[-1]['learning_rate']),
      'grad_norm': float(np.mean([m['grad_norm'] for m in metrics])),
  }
  record |= objective.slot_metrics(sums | {'weight_sum': float(masked.sum())})
  for name in ('sentence_pair_loss', 'sentence_pair_accuracy'):
    if name in metrics[0]:
      record[name] = float(np.mean([m[name] for m in metrics]))
  return record


def check_finite(loss: float, step: int, checkpoint_dir: str) -> None:
  """Stops a diverged run (before it can save NaN parameters), naming the fix."""
  if not math.isfinite(loss):
    raise FloatingPointError(
        f'loss is {loss} at step {step}; stopping. The last good checkpoint is kept in '
        f'{checkpoint_dir}. Try a lower config.train.learning_rate.')
