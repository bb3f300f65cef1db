"""Logits of every row of a file, and the evaluation scores they give against its labels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mlm_jax.finetuning import batches as batches_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import scores
from mlm_jax.runtime import sharding


def all_logits(logits_fn: Callable[[dict], jax.Array], encoded: data_lib.Encoded,
               global_batch: int, mesh=None) -> np.ndarray:
  """[N, K] or [N, T, K] float32: `logits_fn` over every row, in order, padding dropped.

  With a mesh, each batch is placed on it (every process feeding its rows)
  and `logits_fn` must return them replicated; without, it runs on the
  default device.
  """
  process_index, process_count = (jax.process_index(), jax.process_count()) if mesh else (0, 1)
  out = []
  for host in batches_lib.eval_batches(encoded.arrays(), global_batch, process_index,
                                       process_count):
    batch = sharding.to_global(host, mesh) if mesh is not None else host
    out.append(np.asarray(jax.device_get(logits_fn(batch)), np.float32))
  return np.concatenate(out)[:len(encoded)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """Log-probabilities over the last axis, computed stably."""
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def loss(task: str, logits: np.ndarray, encoded: data_lib.Encoded) -> float:
  """The mean loss over the targets (cross-entropy, or squared error for regress)."""
  w = encoded.weights
  if task == 'regress':
    return float(np.sum(w * (logits[:, 0] - encoded.targets) ** 2) / max(w.sum(), 1.0))
  picked = np.take_along_axis(log_softmax(logits), encoded.targets[..., None], -1)[..., 0]
  return float(-np.sum(w * picked) / max(w.sum(), 1.0))


def word_tags(logits: np.ndarray, encoded: data_lib.Encoded) -> list[np.ndarray]:
  """Each row's predicted tag index per word kept ([words kept]), from [N, T, K] logits."""
  out = []
  for row, starts in zip(logits, encoded.word_starts):
    kept = starts[starts >= 0]
    out.append(np.argmax(row[kept], -1))
  return out


def score(task: str, logits: np.ndarray, encoded: data_lib.Encoded,
          labels: list | None) -> dict[str, Any]:
  """Loss and the task's scores (see scores.py) of `logits` against the file's targets."""
  result = {'loss': loss(task, logits, encoded)}
  if task == 'regress':
    return result | scores.regression(logits[:, 0], encoded.targets)
  if task != 'tag':
    return result | scores.classification(np.argmax(logits, -1), encoded.targets, len(labels))
  predicted = [[labels[i] for i in tags] for tags in word_tags(logits, encoded)]
  gold = [[labels[i] for i in row[starts[starts >= 0]]]
          for row, starts in zip(encoded.targets, encoded.word_starts)]
  return result | scores.tagging(predicted, gold, labels)
