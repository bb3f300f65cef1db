"""Where logged metrics go: WORKDIR/metrics.jsonl and TensorBoard event files.

Each record is one JSON line {'step': s, ...values, 'time': unix seconds};
eval records have their keys prefixed 'eval_'. The numeric values are also
TensorBoard scalars under WORKDIR/tb, tagged 'train/<key>' and 'eval/<key>'
(no TensorFlow needed: tensorboardX writes the files). View them with

  tensorboard --logdir WORKDIR/tb          (or several runs: --logdir_spec)

After a resume, metrics.jsonl can hold a step twice; `read_metrics` keeps the
later record, as TensorBoard does (a resumed writer purges later steps).
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from absl import logging
from flax import traverse_util

# Scalars that tell how a run did, declared to TensorBoard's hparams dashboard.
_HPARAM_METRICS = ('eval/mlm_accuracy', 'eval/context_ratio', 'eval/loss', 'train/loss')


def tensorboard_tag(key: str) -> str:
  """'eval_loss' -> 'eval/loss'; 'loss' -> 'train/loss'."""
  if key.startswith('eval_'):
    return 'eval/' + key[len('eval_'):]
  return 'train/' + key


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


class MetricsWriter:
  """Appends records to metrics.jsonl and, if asked, to TensorBoard; logs them.

  Only the process that is `enabled` (process 0) writes. `hparams` (e.g. the
  resolved config, nested) are recorded in TensorBoard once, flattened to
  'section.field' names, by the first writer of WORKDIR/tb. `start_step`: the step a resumed run continues from; TensorBoard
  hides what an earlier attempt logged after it.
  """

  def __init__(self, workdir: str, *, enabled: bool, tensorboard: bool = True,
               hparams: Mapping[str, Any] | None = None, start_step: int = 0):
    self._path = os.path.join(workdir, 'metrics.jsonl')
    self._enabled = enabled
    self._tb = None
    if enabled and tensorboard:
      flat = traverse_util.flatten_dict(dict(hparams or {}), sep='.')
      self._tb = _TensorBoard(os.path.join(workdir, 'tb'), flat, start_step)

  def write(self, step: int, record: Mapping[str, Any]) -> None:
    if not self._enabled:
      return
    record = {'step': step, **record, 'time': time.time()}
    logging.info('step %d: %s', step, ', '.join(
        f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}'
        for k, v in record.items() if k not in ('step', 'time')))
    with open(self._path, 'a') as f:
      f.write(json.dumps(record) + '\n')
    if self._tb:
      self._tb.write(step, {k: v for k, v in record.items()
                            if k not in ('step', 'time') and _is_number(v)})

  def close(self) -> None:
    if self._tb:
      self._tb.close()
      self._tb = None


def _import_tensorboardx() -> None:
  """Imports tensorboardX without torch where torch is not loaded already.

  tensorboardX's writer imports torch whenever it is installed, only to accept torch tensors
  as values (seconds of start-up and hundreds of MB for a run that logs floats). Hidden
  while tensorboardX loads, torch stays importable by anything after it.
  """
  if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
    import tensorboardX  # noqa: F401  pylint: disable=import-outside-toplevel
    return
  sys.modules['torch'] = None  # An import of it raises ImportError meanwhile.
  try:
    import tensorboardX  # noqa: F401,F811  pylint: disable=import-outside-toplevel
  finally:
    del sys.modules['torch']


class _TensorBoard:
  """Scalars (and hparams) as event files, created on the first write."""

  def __init__(self, logdir: str, hparams: Mapping[str, Any], start_step: int):
    _import_tensorboardx()  # Now rather than at the first write, inside the training loop.
    self._logdir = logdir
    self._hparams = hparams
    self._start_step = start_step
    self._writer = None

  def _open(self):
    from tensorboardX import SummaryWriter  # Imported only where it writes.
    from tensorboardX.summary import hparams as hparams_summary
    first = not glob.glob(os.path.join(self._logdir, 'events.out.tfevents.*'))
    # Event files are named by the second they were opened in: the suffix
    # keeps two invocations within one second apart, in order of start step.
    # purge_step: TensorBoard drops what an interrupted attempt logged past
    # the step this one resumes from (it logs again from start_step + 1).
    self._writer = SummaryWriter(
        self._logdir, purge_step=self._start_step + 1 if self._start_step else None,
        flush_secs=30, filename_suffix=f'.{self._start_step:010d}.{os.getpid()}')
    if first and self._hparams:
      values = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                for k, v in self._hparams.items()}
      # The metric values themselves are the scalars written as the run goes.
      experiment, session_start, _ = hparams_summary(values, dict.fromkeys(_HPARAM_METRICS, 0.0))
      for summary in (experiment, session_start):
        self._writer.file_writer.add_summary(summary)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if self._writer is None:
      self._open()
    for key, value in scalars.items():
      self._writer.add_scalar(tensorboard_tag(key), value, step)
    self._writer.flush()  # Once per log interval: visible in TensorBoard at once.

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


def start_from(source_workdir: str, workdir: str, step: int) -> None:
  """Starts WORKDIR/metrics.jsonl with the records of `source_workdir` up to `step`, in order:
  a branch of that run (config.init.branch) goes on from its history (its tokens seen, its
  curves). Nothing when WORKDIR already has metrics, or the source none.

  Written whole under a temporary name, then renamed.
  """
  source, path = (os.path.join(source_workdir, 'metrics.jsonl'),
                  os.path.join(workdir, 'metrics.jsonl'))
  if os.path.exists(path) or not os.path.exists(source):
    return
  with open(source) as f:
    lines = [line for line in f if line.strip() and int(json.loads(line)['step']) <= step]
  os.makedirs(workdir, exist_ok=True)
  with open(f'{path}.tmp', 'w') as f:
    f.writelines(line if line.endswith('\n') else line + '\n' for line in lines)
  os.replace(f'{path}.tmp', path)


def read_metrics(workdir: str) -> dict[str, dict[int, float]]:
  """{key: {step: value}} of the numeric values in WORKDIR/metrics.jsonl.

  A record whose step is not past the last one of its kind (train or eval)
  starts a resumed attempt: values an earlier attempt logged from that step
  on are dropped, so the later record for a step wins.
  """
  series: dict[str, dict[int, float]] = {}
  last = {'train': -1, 'eval': -1}
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return series
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      record = json.loads(line)
      step = int(record['step'])
      kind = 'eval' if any(k.startswith('eval_') for k in record) else 'train'
      if step <= last[kind]:
        for values in series.values():
          for s in [s for s in values if s >= step]:
            del values[s]
        last = {k: min(v, step - 1) for k, v in last.items()}
      last[kind] = step
      for k, v in record.items():
        if k not in ('step', 'time') and _is_number(v) and math.isfinite(v):
          series.setdefault(k, {})[step] = float(v)
  return series
