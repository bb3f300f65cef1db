"""Batches of encoded rows: a shuffled stream for training, padded batches for evaluation.

Fine-tuning files fit in memory, so the rows are arrays and a batch is an
index into them. Training step s takes positions s*B .. s*B + B - 1 of the
endless stream "epoch 0's order, epoch 1's order, ...", each epoch's order a
permutation drawn from (seed, epoch): step s sees the same rows whatever
the number of processes, and a resumed run continues the same stream. Each
process builds only its share of the global batch. Numpy only.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class TrainBatches:
  """Iterator over this process's rows of each global training batch, from `start_step` on."""

  def __init__(self, arrays: dict[str, np.ndarray], global_batch: int, seed: int,
               start_step: int = 0, process_index: int = 0, process_count: int = 1):
    self._arrays = arrays
    self._n = len(arrays['input_ids'])
    self._global = global_batch
    self._local = global_batch // process_count
    self._offset = process_index * self._local
    self._seed = seed
    self._step = start_step
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
      self._orders[epoch] = np.random.default_rng([self._seed, epoch]).permutation(self._n)
    return self._orders[epoch]

  def rows(self, step: int) -> np.ndarray:
    """Indices of this process's rows of step `step`'s global batch."""
    positions = step * self._global + self._offset + np.arange(self._local)
    epochs = positions // self._n
    return np.array([self._order(e)[p % self._n] for e, p in zip(epochs, positions)])

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    index = self.rows(self._step)
    self._step += 1
    return {k: v[index] for k, v in self._arrays.items()}

  def close(self) -> None:
    """Nothing to stop (no worker processes); here so the loop treats every input alike."""


def eval_batches(arrays: dict[str, np.ndarray], global_batch: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """This process's rows of each global batch over every row, in order.

  The last batch is filled with padding rows of weight 0: copies of the
  file's first row (a well-formed row of any tokenizer, so attention sees
  real keys), which callers drop from the logits.
  """
  n = len(arrays['input_ids'])
  local = global_batch // process_count
  for start in range(0, n, global_batch):
    index = start + process_index * local + np.arange(local)
    real = index < n
    batch = {k: v[np.where(real, index, 0)] for k, v in arrays.items()}
    for k in ('targets', 'weights'):
      batch[k][~real] = 0
    yield batch
