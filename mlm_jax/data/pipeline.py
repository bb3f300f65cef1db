"""Grain input pipeline over the prepared rows: numpy only, no model code.

Global batch s holds the rows s*B .. s*B+B-1 of the repeated dataset,
shuffled anew every epoch (grain's index_shuffle, see stream_to_source).
Process p of n reads only its own contiguous slice of b = B/n rows of every
global batch, so the global batch and its masks are the same whatever the
number of processes or devices:

  rows of the shuffled stream:  | step s: p0 p1 ... p(n-1) | step s+1: ... |

Masks are keyed by (seed, step, global row index). A worker reads the rows
of several consecutive steps at once, masks them in one vectorised call (so
numpy's fixed cost per call is paid once per chunk, not once per step) and
the main process splits the chunk back into steps. With `worker_count` > 0
grain runs that in worker processes, chunk c in worker c mod worker_count,
interleaved back in order, so the batches are the same for any worker count.

Sentence pairs (NSP/SOP) are built by data/sentence_pairs.py before masking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import flags

from mlm_jax.data import index_shuffle
from mlm_jax.data import masking
from mlm_jax.data import packed_rows
from mlm_jax.data import sentence_pairs
from mlm_jax.errors import one_of
from mlm_jax.errors import require

# Rows read and masked per call in a worker (rounded to whole steps).
CHUNK_ROWS = 1024


class RowReader:
  """Reads rows by index: `reader(indices: [n]) -> input_ids [n, T] int32`; index -1: a row of
  `pad_id` (the tokenizer's [PAD]).

  `source`: a split's prepared rows (packed_rows.DenseRows), read in one call
  per batch, or any sequence of {'input_ids': [T]} rows (such as rows built in
  memory), read one at a time.
  """

  def __init__(self, source: packed_rows.DenseRows | Sequence[dict[str, np.ndarray]],
               pad_id: int):
    self.source = source
    self.pad_id = pad_id
    self.seq_len = len(source[0]['input_ids'])
    self._dense = source if isinstance(source, packed_rows.DenseRows) else None

  def __call__(self, indices: np.ndarray) -> np.ndarray:
    indices = np.asarray(indices)
    out = np.full((len(indices), self.seq_len), self.pad_id, np.int32)
    real = indices >= 0
    if not real.any():
      return out
    if self._dense is not None:
      out[real] = self._dense.read(indices[real])
    else:
      out[real] = np.stack([self.source[int(k)]['input_ids'] for k in indices[real]])
    return out

  def __len__(self) -> int:
    return len(self.source)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchBuilder:
  """Source row indices -> a masked batch; pickled into grain's worker processes."""

  reader: RowReader
  masker: masking.Masker
  seed: int
  sentence_pair: str = 'none'

  def __post_init__(self):
    one_of('sentence_pair', 'task', self.sentence_pair, sentence_pairs.TASKS)

  def __call__(self, indices: np.ndarray, *, step: int | np.ndarray,
               rows: np.ndarray) -> dict[str, np.ndarray]:
    """indices [n] into the source (-1: a padding row); step: one or [n]; rows: [n] global."""
    input_ids = self.reader(indices)
    if self.sentence_pair == 'none':
      return self.masker(input_ids, seed=self.seed, step=step, rows=rows)
    pairs = sentence_pairs.build(input_ids, task=self.sentence_pair,
                                 specials=self.masker.specials, seed=self.seed, step=step,
                                 rows=rows, read_other=self.reader, own_indices=indices,
                                 num_source_rows=len(self.reader))
    batch = self.masker(pairs['input_ids'], seed=self.seed, step=step, rows=rows)
    batch['segment_ids'] = pairs['segment_ids']
    # A pair is one document: its segments must see each other.
    batch['document_ids'] = (pairs['input_ids'] != self.masker.specials.pad).astype(np.int32)
    batch['sentence_pair_labels'] = pairs['sentence_pair_labels']
    batch['sentence_pair_weights'] = pairs['sentence_pair_weights']
    return batch


def stream_to_source(rows: np.ndarray, num_rows: int, seed: int) -> np.ndarray:
  """Global stream positions [n] -> source row indices [n]: a new permutation every epoch.

  Position r is row index_shuffle(r mod N) of epoch r // N, with grain's
  bijective index_shuffle (the permutation behind grain's own shuffle) seeded
  by seed + epoch, computed for all rows of an epoch at once
  (data/index_shuffle.py, bit for bit grain's).
  """
  epochs, within = np.divmod(np.asarray(rows, np.int64), num_rows)
  out = np.empty_like(within)
  for e in np.unique(epochs):
    here = epochs == e
    out[here] = index_shuffle.index_shuffle(within[here], num_rows - 1,
                                            seed=int((seed + e) % 2**32), rounds=4)
  return out


def _split_chunks(chunks: Iterator[dict[str, np.ndarray]],
                  local: int) -> Iterator[dict[str, np.ndarray]]:
  """Chunks of several steps' rows -> one batch of `local` rows per step."""
  try:
    for chunk in chunks:
      for start in range(0, len(chunk['input_ids']), local):
        yield {k: v[start:start + local] for k, v in chunk.items()}
  finally:
    close = getattr(chunks, 'close', None)
    if close is not None:
      close()  # Stops grain's worker processes.


def train_batches(source: Any, masker: masking.Masker, *, global_batch: int, seed: int,
                  start_step: int = 0, process_index: int = 0, process_count: int = 1,
                  prefetch: int = 2, worker_count: int = 0, sentence_pair: str = 'none',
                  chunk_rows: int = CHUNK_ROWS,
                  order: Callable[[np.ndarray], np.ndarray] | None = None,
                  positions: Callable[[np.ndarray], np.ndarray] | None = None
                  ) -> Iterator[dict[str, np.ndarray]]:
  """Yields this process's masked part of global batches start_step, start_step+1, ...

  worker_count: grain worker processes (0: threads of this process); prefetch:
  chunks of about `chunk_rows` rows computed ahead per worker. order: global
  stream positions [n] -> source row indices [n] (a mixture's draw,
  data/mixture.py); None: the source's rows, shuffled anew every epoch.
  positions: steps [n] -> [n, global_batch] global stream positions of their
  rows, -1 for a padding row (a batch that is not full: phases.Plan.positions);
  None: step s holds positions s*B .. s*B+B-1.
  """
  if global_batch % process_count:
    raise ValueError(f'global batch {global_batch} does not divide over {process_count} processes')
  local = global_batch // process_count
  builder = BatchBuilder(RowReader(source, masker.specials.pad), masker, seed, sentence_pair)
  steps_per_chunk = max(1, chunk_rows // local)

  if positions is None:
    def positions(steps: np.ndarray) -> np.ndarray:
      return steps[:, None] * global_batch + np.arange(global_batch)

  def build(c: int) -> dict[str, np.ndarray]:
    steps = start_step + c * steps_per_chunk + np.arange(steps_per_chunk)
    rows = positions(steps)[:, process_index * local:(process_index + 1) * local].ravel()
    real = rows >= 0
    indices = np.full(rows.shape, -1, np.int64)
    indices[real] = (order(rows[real]) if order is not None
                     else stream_to_source(rows[real], len(source), seed))
    return builder(indices, step=np.repeat(steps, local), rows=rows)

  # ~1e12 rows: endless in practice.
  ds = grain.MapDataset.range(2**40 // (steps_per_chunk * global_batch)).map(build)
  chunks = ds.to_iter_dataset(
      grain.ReadOptions(num_threads=1 if worker_count else 2, prefetch_buffer_size=prefetch))
  if worker_count:
    if not flags.FLAGS.is_parsed():
      # grain 0.2.18 reads an absl flag when it starts workers, which fails
      # outside absl.app (grain issue #1355, fixed in later releases).
      flags.FLAGS.mark_as_parsed()
    chunks = chunks.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=worker_count, per_worker_buffer_size=prefetch))
  return _split_chunks(iter(chunks), local)


def eval_batch_size(num_rows: int, requested: int, num_devices: int) -> int:
  """The eval batch: `requested`, but not padded past a smaller split.

  Padding rows cost as much compute as real ones; the result stays a multiple
  of the device count.
  """
  return min(requested, -(-num_rows // num_devices) * num_devices)


def eval_batches(source: Any, masker: masking.Masker, *, global_batch: int, mask_seed: int,
                 max_batches: int = 0, process_index: int = 0, process_count: int = 1,
                 sentence_pair: str = 'none') -> Iterator[dict[str, np.ndarray]]:
  """The validation split in order, with fixed masks; the last batch is padded.

  Padding rows are all [PAD] (the masker's): they have no maskable token, so their
  masked_weights (and sentence_pair_weights) are 0 and they change no metric.
  """
  local = global_batch // process_count
  builder = BatchBuilder(RowReader(source, masker.specials.pad), masker, mask_seed, sentence_pair)
  n = len(source)
  num_batches = -(-n // global_batch)
  if max_batches:
    num_batches = min(num_batches, max_batches)
  for b in range(num_batches):
    rows = b * global_batch + process_index * local + np.arange(local)
    yield builder(np.where(rows < n, rows, -1), step=b, rows=rows)


def check_config(input_config: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.input."""
  require(input_config.worker_count >= 0,
          f'config.input.worker_count={input_config.worker_count} must be >= 0 '
          '(0: no worker processes).')
  require(input_config.prefetch >= 1,
          f'config.input.prefetch={input_config.prefetch} must be at least 1.')
