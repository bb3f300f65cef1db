"""A task's metrics from logits, and a fine-tuned model scored on a task's dev splits.

One function turns logits and gold labels into the measures of tasks.MEASURES
(accuracy, MCC, the positive label's F1, macro F1, Pearson, Spearman; tag
tasks: word accuracy and entity F1), for ours and for transformers' runs
alike (hf_peer.py calls it), so that the two columns of a table differ only
by the fine-tuning. The model scored is the run's kept evaluation (OUT/best:
its best on dev, or its last under a protocol whose runs count their last).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mlm_jax.evaluation import tasks as tasks_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import scores
from mlm_jax.finetuning import step as step_lib
from mlm_jax.finetuning import task_eval


def binary_f1(predicted: Sequence[Any], gold: Sequence[Any], positive: Any) -> float:
  """F1 of the `positive` label (0 when it is neither predicted nor gold)."""
  p, g = np.asarray(predicted) == positive, np.asarray(gold) == positive
  hit, n = float(np.sum(p & g)), float(np.sum(p) + np.sum(g))
  return 2 * hit / n if n else 0.0


def measures(task: tasks_lib.Task, logits: np.ndarray, gold: Sequence[Any],
             labels: Sequence[Any] | None, names: Sequence[str]) -> dict[str, float]:
  """`names` (measures of tasks.MEASURES) of logits [N, K] against gold labels [N] (label
  values; floats for regress). Tag tasks go through measures_of_tags."""
  out = {}
  if task.kind == 'regress':
    got = scores.regression(logits[:, 0].astype(np.float64), np.asarray(gold, np.float64))
    return {n: got[n] for n in names}
  predicted = [labels[i] for i in np.argmax(logits, -1)]
  for name in names:
    if name == 'accuracy':
      out[name] = float(np.mean([p == g for p, g in zip(predicted, gold)]))
    elif name == 'mcc':
      positive = task.positive if task.positive is not None else labels[-1]
      out[name] = scores.matthews_corrcoef(np.asarray(predicted) == positive,
                                           np.asarray(gold) == positive)
    elif name == 'f1':
      out[name] = binary_f1(predicted, gold, task.positive)
    elif name == 'macro_f1':
      out[name] = scores.macro_f1(predicted, list(gold), labels)
  return out


def score_model(out_dir: str, task: tasks_lib.Task, dev_files: dict[str, str],
                batch_size: int = 64) -> dict[str, float]:
  """Every metric of `task` for the model kept in fine-tuning output `out_dir`, on the dev
  splits' files ({split: path}, read as the fine-tuning read its files)."""
  model = model_dir.load(out_dir)
  logits_fn = _logits_fn(model)
  fields = data_lib.Fields.from_config(model.data_config)
  out = {}
  for split in task.dev_splits:
    path = dev_files[split]
    examples = data_lib.read_examples(path, task.kind, fields=fields,
                                      tfds_data_dir=model.data_config.get('tfds_data_dir'))
    data_lib.check_labels(examples, model.labels, task.kind, path, fields)
    encoded = data_lib.encode(examples, task.kind, model.tokenizer, model.seq_len,
                              model.labels, path, fields, model.row_format)
    logits = task_eval.all_logits(logits_fn, encoded, batch_size)
    wanted = [m for m in task.metrics if m.split == split]
    if task.kind == 'tag':
      got = task_eval.score('tag', logits, encoded, model.labels)
    else:
      got = measures(task, logits, [e.label for e in examples], model.labels,
                     [m.measure for m in wanted])
    out |= {m.name: float(got[m.measure]) for m in wanted}
  return out


def _logits_fn(model: model_dir.FineTunedModel):
  """batch -> logits on the default device (scoring is a small share of a cell's time)."""
  apply = _jitted_apply(model.model_cfg, model.task, len(model.labels or [0]),
                        model.classifier_dropout)
  params = jax.device_put(model.params)
  return lambda batch: apply(params, batch)


@functools.lru_cache(maxsize=16)
def _jitted_apply(cfg: Any, kind: str, num_outputs: int, classifier_dropout: float):
  """The jitted forward pass of a model of this shape, made once for every cell that has it
  (the cells of a sweep share a few shapes; tracing each again would cost more than scoring)."""
  module = step_lib.fine_tuned_model(cfg, kind, num_outputs, classifier_dropout)
  return jax.jit(lambda params, batch: module.apply({'params': params}, batch))
