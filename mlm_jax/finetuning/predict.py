"""Predictions of a fine-tuned model for every row of a file, written as JSON lines.

One output line per input row, in order, with the input's line number:

  classify, pair  {"line": 3, "label": "pos", "probabilities": {"neg": 0.02, "pos": 0.98}}
  regress         {"line": 3, "value": 0.71}
  tag             {"line": 3, "tokens": [...], "tags": ["B-PER", "O", ...],
                   "probabilities": [0.97, 0.99, ...]}  (each chosen tag's probability)

Labels in the file are not needed (and not read). FILE may be a tfds split
(tfds:NAME:SPLIT); its records are read with the fine-tuning's field names
and tfds data dir, and each output line has the record's index ("record")
in place of "line". A tag row longer than the sequence length gets null
for the words past it; rows truncated are counted in the log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from absl import logging

from mlm_jax.data import tfds_source
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import task_eval
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import step as step_lib


def predict(model_path: str, data_path: str, out_path: str, batch_size: int = 64) -> int:
  """Writes `out_path` (JSON lines) with the predictions of `model_path` for `data_path`.

  The model is the fine-tuning's best evaluation (OUT/best). Returns the
  number of rows written.
  """
  model = model_dir.load(model_path)
  fields = data_lib.Fields.from_config(model.data_config)
  examples = data_lib.read_examples(data_path, model.task, labelled=False, fields=fields,
                                    tfds_data_dir=model.data_config.get('tfds_data_dir'))
  encoded = data_lib.encode(examples, model.task, model.tokenizer, model.seq_len, path=data_path,
                            fields=fields, row_format=model.row_format)
  message = data_lib.describe_truncation(encoded, data_path, model.seq_len)
  if message:
    logging.warning('%s', message)
  logits = task_eval.all_logits(_logits_fn(model), encoded, batch_size)
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  with open(out_path, 'w') as f:
    where = 'record' if tfds_source.is_spec(data_path) else 'line'
    f.writelines(json.dumps(r) + '\n' for r in records(model, examples, encoded, logits, where))
  return len(examples)


def _logits_fn(model: model_dir.FineTunedModel):
  """batch -> logits, jitted on the default device."""
  module = step_lib.fine_tuned_model(model.model_cfg, model.task, len(model.labels or [0]),
                                     model.classifier_dropout)
  apply = jax.jit(lambda params, batch: module.apply({'params': params}, batch))
  params = jax.device_put(model.params)
  return lambda batch: apply(params, batch)


def softmax(logits: np.ndarray) -> np.ndarray:
  return np.exp(task_eval.log_softmax(logits))


def records(model: model_dir.FineTunedModel, examples: list[data_lib.Example],
            encoded: data_lib.Encoded, logits: np.ndarray,
            where: str = 'line') -> Iterator[dict[str, Any]]:
  """One output record per example (see the module's docstring); `where`: 'line' or 'record'."""
  for i, example in enumerate(examples):
    record: dict[str, Any] = {where: example.line}
    if model.task == 'regress':
      record['value'] = float(logits[i, 0])
    elif model.task == 'tag':
      record |= _word_tags(model.labels, example, encoded.word_starts[i], softmax(logits[i]))
    else:
      probs = softmax(logits[i])
      record['label'] = model.labels[int(np.argmax(probs))]
      record['probabilities'] = {str(label): float(p) for label, p in zip(model.labels, probs)}
    yield record


def _word_tags(labels: list, example: data_lib.Example, starts: np.ndarray,
               probs: np.ndarray) -> dict[str, Any]:
  """probs [T, K] -> the tag of each word at its first piece (None where truncation cut it)."""
  tags, chosen = [], []
  for start in starts:
    if start < 0:
      tags.append(None)
      chosen.append(None)
      continue
    best = int(np.argmax(probs[start]))
    tags.append(labels[best])
    chosen.append(float(probs[start, best]))
  return {'tokens': list(example.texts), 'tags': tags, 'probabilities': chosen}
