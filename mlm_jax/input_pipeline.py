"""Grain input pipeline over the prepared rows: numpy only, no model code.

Global batch s holds the rows s*B .. s*B+B-1 of the shuffled, repeated
dataset (reshuffled every epoch by grain). Process p of n reads only its own
contiguous slice of b = B/n rows of every global batch, so the global batch
and its masks are the same whatever the number of processes or devices:

  rows of the shuffled stream:  | step s: p0 p1 ... p(n-1) | step s+1: ... |

Masks are keyed by (seed, step, global row index).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from mlm_jax import masking


def _stack(rows: list[dict[str, np.ndarray]]) -> np.ndarray:
  return np.stack([r['input_ids'] for r in rows]).astype(np.int32)


def train_batches(source: Any, masker: masking.Masker, *, global_batch: int, seed: int,
                  start_step: int = 0, process_index: int = 0, process_count: int = 1,
                  prefetch: int = 2) -> Iterator[dict[str, np.ndarray]]:
  """Yields this process's masked part of global batches start_step, start_step+1, ..."""
  if global_batch % process_count:
    raise ValueError(f'global batch {global_batch} does not divide over {process_count} processes')
  local = global_batch // process_count
  # ~1e12 rows: endless in practice, yet small enough for len() after batching.
  epochs = max(1, 2**40 // len(source))
  ds = (grain.MapDataset.source(source)
        .shuffle(seed=seed)
        .repeat(epochs)
        .batch(local, batch_fn=_stack))
  # Element c of `ds` holds stream rows c*local ...; step s of process p is c = s*n + p.
  ds = ds[start_step * process_count + process_index::process_count]

  def mask(i: int, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    step = start_step + i
    rows = step * global_batch + process_index * local + np.arange(local)
    return masker(input_ids, seed=seed, step=step, rows=rows)

  ds = ds.map_with_index(mask)
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=prefetch)))


def eval_batch_size(num_rows: int, requested: int, num_devices: int) -> int:
  """The eval batch: `requested`, but not padded past a smaller split.

  Padding rows cost as much compute as real ones; the result stays a multiple
  of the device count.
  """
  return min(requested, -(-num_rows // num_devices) * num_devices)


def eval_batches(source: Any, masker: masking.Masker, *, global_batch: int, mask_seed: int,
                 max_batches: int = 0, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """The validation split in order, with fixed masks; the last batch is padded.

  Padding rows are all [PAD]: they have no maskable token, so their
  masked_weights are 0 and they change no metric.
  """
  local = global_batch // process_count
  n = len(source)
  num_batches = -(-n // global_batch)
  if max_batches:
    num_batches = min(num_batches, max_batches)
  seq_len = len(source[0]['input_ids'])
  for b in range(num_batches):
    rows = b * global_batch + process_index * local + np.arange(local)
    ids = np.zeros((local, seq_len), np.int32)
    for j, r in enumerate(rows):
      if r < n:
        ids[j] = source[int(r)]['input_ids']
    yield masker(ids, seed=mask_seed, step=b, rows=rows)
