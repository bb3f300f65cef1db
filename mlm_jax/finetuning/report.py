"""What a fine-tuning run reports as it goes: a progress bar, one record per log interval.

The step metrics of an interval stay on the devices until the interval ends
(the loop never waits for them); then their loss and accuracy, weighted by
the targets each step had, go to metrics.jsonl and TensorBoard through
training/metrics.MetricsWriter, as pretraining's do.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from mlm_jax.finetuning import scores
from mlm_jax.training import metrics as metrics_lib
from mlm_jax.training import report as report_lib


class FinetuneLog(report_lib.IntervalLog):
  """Step metrics -> interval records, evaluation records and a progress bar."""

  def __init__(self, writer: metrics_lib.MetricsWriter, *, start_step: int, num_steps: int,
               show: bool, checkpoint_dir: str):
    super().__init__(writer, start_step=start_step, num_steps=num_steps, show=show,
                     checkpoint_dir=checkpoint_dir)
    self._show = show

  def restart(self) -> None:
    """Leaves the time since the interval began out of the speed (compile, evaluation)."""
    jax.block_until_ready(self._pending)
    super().restart()

  def write(self, step: int) -> dict[str, float]:
    """The interval's loss, accuracy, last learning rate, mean gradient norm and rows/s."""
    host, untimed, seconds = self._take_interval()
    weight = max(sum(float(m['weight_sum']) for m in host), 1.0)
    timed_tokens = sum(float(m['num_tokens']) for m in host[untimed:])
    record = {'loss': sum(float(m['loss_sum']) for m in host) / weight,
              'learning_rate': float(host[-1]['learning_rate']),
              'grad_norm': sum(float(m['grad_norm']) for m in host) / len(host),
              'tokens_per_sec': timed_tokens / seconds}
    if 'correct_sum' in host[0]:
      record['accuracy'] = sum(float(m['correct_sum']) for m in host) / weight
    report_lib.check_finite(record['loss'], step, self._checkpoint_dir)
    self.writer.write(step, record)
    self._progress.set_postfix(loss=f'{record["loss"]:.4f}')
    return record

  def write_eval(self, step: int, result: dict[str, Any]) -> None:
    """Records an evaluation and prints its line (e.g. 'step 40: eval accuracy 0.9375')."""
    self.writer.write(step, {f'eval_{k}': v for k, v in result.items()})
    if self._show:
      self._progress.write(scores.describe(step, result), file=sys.stdout)
      sys.stdout.flush()
    self.restart()
