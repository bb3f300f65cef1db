"""The end-of-run summary: WORKDIR/summary.json.

Losses and accuracies come from metrics.jsonl, so they cover a run resumed
over several invocations; speed and MFU are this invocation's (its compile
step and evaluations left out).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.model import flops as flops_lib
from mlm_jax.training import metrics as metrics_lib


@dataclasses.dataclass
class Counters:
  """Tokens (real, non-padding) and timed seconds of this invocation."""

  tokens: int = 0
  timed_tokens: int = 0
  timed_seconds: float = 0.0

  def add_interval(self, metrics: Sequence[dict[str, np.ndarray]], untimed: int,
                   seconds: float) -> dict[str, float]:
    """Counts a log interval whose first `untimed` steps are not in `seconds`.

    Returns the interval's speed (tokens_per_sec, step_time_s), or nothing
    when no step of it was timed (the compile step alone, say).
    """
    tokens = [int(m['num_tokens']) for m in metrics]
    self.tokens += sum(tokens)
    timed = tokens[untimed:]
    if not timed:
      return {}
    self.timed_tokens += sum(timed)
    self.timed_seconds += seconds
    return {'tokens_per_sec': sum(timed) / seconds, 'step_time_s': seconds / len(timed)}

  @property
  def tokens_per_sec(self) -> float | None:
    return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else None


def tokens_before(series: dict[str, dict[int, float]], start_step: int) -> int | None:
  """Tokens seen up to `start_step` by earlier invocations, if they logged that step."""
  if start_step == 0:
    return 0
  seen = series.get('tokens_seen', {}).get(start_step)
  return None if seen is None else int(seen)


def _last(values: dict[int, float] | None) -> tuple[int | None, float | None]:
  if not values:
    return None, None
  step = max(values)
  return step, values[step]


def build(*, step: int, start_step: int, wall_time_s: float, counters: Counters,
          earlier_tokens: int | None, series: dict[str, dict[int, float]],
          flops_per_token: float, peak_flops_per_device: float | None, num_devices: int,
          device_kind: str, mfu: float | None) -> dict[str, Any]:
  """The summary dict; None where a value is unknown (never a guess)."""
  train_step, train_loss = _last(series.get('loss'))
  _, train_acc = _last(series.get('mlm_accuracy'))
  eval_step, eval_loss = _last(series.get('eval_loss'))
  _, eval_acc = _last(series.get('eval_mlm_accuracy'))
  _, eval_mask_acc = _last(series.get('eval_mask_accuracy'))
  _, eval_context = _last(series.get('eval_context_ratio'))
  accs = series.get('eval_mlm_accuracy') or {}
  best_step = max(accs, key=lambda s: (accs[s], -s)) if accs else None
  whole_run = earlier_tokens is not None
  return {
      'step': step,
      'start_step': start_step,
      'steps_this_invocation': step - start_step,
      # Real (non-padding) tokens from step tokens_seen_from_step on: 0 when
      # the count covers the whole run, start_step when earlier invocations
      # did not log the step this one resumed from.
      'tokens_seen': (earlier_tokens if whole_run else 0) + counters.tokens,
      'tokens_seen_from_step': 0 if whole_run else start_step,
      'wall_time_s': wall_time_s,
      'final_train_step': train_step,
      'final_train_loss': train_loss,
      'final_train_mlm_accuracy': train_acc,
      'final_eval_step': eval_step,
      'final_eval_loss': eval_loss,
      'final_eval_mlm_accuracy': eval_acc,
      # At slots that showed [MASK], and that over the most frequent token's rate there.
      'final_eval_mask_accuracy': eval_mask_acc,
      'final_eval_context_ratio': eval_context,
      'best_eval_mlm_accuracy': accs[best_step] if accs else None,
      'best_eval_step': best_step,
      'mean_tokens_per_sec': counters.tokens_per_sec,
      'flops_per_token': flops_per_token,
      'num_devices': num_devices,
      'device_kind': device_kind,
      'peak_flops_per_device': peak_flops_per_device,
      'mfu': mfu,
  }


def for_run(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig, workdir: str,
            *, step: int, start_step: int, wall_time_s: float, counters: Counters,
            earlier_tokens: int | None, is_main: bool) -> dict[str, Any]:
  """summary.json's content for a run; losses and accuracies from metrics.jsonl (process 0)."""
  flops_per_token = flops_lib.model_flops_per_token(model_cfg, config.data.seq_len,
                                                    config.masking.max_predictions)
  device_kind = jax.devices()[0].device_kind
  peak = flops_lib.peak_flops_per_device(device_kind, config.profile.peak_tflops)
  return build(
      step=step, start_step=start_step, wall_time_s=wall_time_s, counters=counters,
      earlier_tokens=earlier_tokens,
      series=metrics_lib.read_metrics(workdir) if is_main else {},
      flops_per_token=flops_per_token, peak_flops_per_device=peak,
      num_devices=jax.device_count(), device_kind=device_kind,
      mfu=flops_lib.mfu(counters.tokens_per_sec, flops_per_token, peak, jax.device_count()))


# The last evaluation's figures that summary.json keeps (as eval_<name>).
EVAL_FIGURES = ('baseline_token', 'baseline_accuracy', 'mask_accuracy', 'mask_baseline_accuracy',
                'context_ratio', 'random_accuracy', 'kept_accuracy')


def eval_figures(result: dict[str, Any]) -> dict[str, Any]:
  """The figures of an evaluation that summary.json keeps, as eval_<name>: EVAL_FIGURES, a
  mixture's [MASK]-slot accuracy per source, and those of the weights' average (ema_<name>,
  config.train.ema_decay), with its loss and accuracy."""
  ema = {f'ema_{k}' for k in EVAL_FIGURES + ('loss', 'mlm_accuracy')}
  return {f'eval_{k}': v for k, v in result.items()
          if k in EVAL_FIGURES or k in ema or k.startswith('mask_accuracy/')}


def eval_line(step: int, result: dict[str, Any]) -> str:
  """The line a run ends with: held-out accuracy, and at [MASK] slots the context ratio.

  Accuracy over all masked slots is flattered by the slots that kept their
  token (the model copies them); at slots that showed [MASK] only context
  helps, so that accuracy is set against always answering the most frequent
  token there.
  """
  line = (f'step {step}: eval MLM accuracy {result["mlm_accuracy"]:.4f} (the most frequent '
          f'token {result["baseline_token"]!r}: {result["baseline_accuracy"]:.4f}), '
          f'eval loss {result["loss"]:.4f}')
  if 'context_ratio' in result:
    line += (f'; at [MASK] slots {result["mask_accuracy"]:.4f} vs '
             f'{result["mask_baseline_accuracy"]:.4f}: context ratio '
             f'{result["context_ratio"]:.2f}x')
  by_source = {k.split('/', 1)[1]: v for k, v in result.items() if k.startswith('mask_accuracy/')}
  if by_source:
    line += '; by source at [MASK] slots: ' + ', '.join(f'{n} {v:.4f}'
                                                        for n, v in by_source.items())
  return line


def dumps(summary: dict[str, Any]) -> str:
  return json.dumps(summary, indent=2)


def write(workdir: str, summary: dict[str, Any]) -> str:
  path = os.path.join(workdir, 'summary.json')
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(summary, f, indent=2)
  os.replace(tmp, path)
  return path
