"""The prepared rows as training reads them: each split's .npy shards, memory-mapped.

Prepare (data/packing.py) writes shard k of n of a split as
DATA_DIR/rows/SPLIT-KKKKK-of-NNNNN.npy, an array [rows, T] of ids (uint16
while the vocabulary fits, else int32): the one format of the rows on disk
(the tfds dataset of data/tfds_export.py is an export of them). Reading a
row is an index into a mapped array, with nothing to decompress or parse,
so that reading stays a small part of the input pipeline's work
(docs/benchmarks.md times it). Numpy only: grain's worker
processes import this module.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

import numpy as np

# The rows as .npy arrays, one per shard, under the data dir.
DENSE_DIR = 'rows'


def dense_path(dense_dir: str, split: str, k: int, num_shards: int) -> str:
  """Where shard k of `num_shards` of a split is, in `dense_dir` (DATA_DIR/rows)."""
  return os.path.join(dense_dir, f'{split}-{k:05d}-of-{num_shards:05d}.npy')


def split_paths(data_dir: str, split: str) -> list[str]:
  """The .npy shards of a split in a data dir, in order; [] if it has none."""
  return sorted(glob.glob(os.path.join(data_dir, DENSE_DIR, f'{split}-*-of-*.npy')))


class DenseRows:
  """A split's rows from its .npy shards, memory-mapped: `read(indices [n]) -> int32 [n, T]`.

  Also a random-access source like tfds's (`len`, `source[i]['input_ids']`).
  Pickles as its paths (for grain's worker processes); each process maps the
  files itself, so the rows are read through the OS page cache, not copied.
  """

  def __init__(self, paths: Sequence[str]):
    self.paths = list(paths)
    lengths = [np.load(p, mmap_mode='r').shape[0] for p in self.paths]
    self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    self._arrays: list[np.ndarray] | None = None

  def __getstate__(self) -> dict:
    return {'paths': self.paths, 'starts': self.starts, '_arrays': None}

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < len(self):
      raise IndexError(f'row {i} of {len(self)}')
    return {'input_ids': self.read(np.array([i]))[0]}

  def read(self, indices: np.ndarray) -> np.ndarray:
    """indices [n] (each in [0, len)) -> input_ids [n, T] int32."""
    if self._arrays is None:
      self._arrays = [np.load(p, mmap_mode='r') for p in self.paths]
    indices = np.asarray(indices, np.int64)
    shard = np.searchsorted(self.starts, indices, side='right') - 1
    out = np.empty((len(indices), self._arrays[0].shape[1]), np.int32)
    for k in np.unique(shard):
      here = shard == k
      out[here] = self._arrays[k][indices[here] - self.starts[k]]
    return out
