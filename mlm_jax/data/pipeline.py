"""Grain input pipeline over the prepared rows: numpy only, no model code.

Global batch s holds the rows s*B .. s*B+B-1 of the repeated dataset,
shuffled anew every epoch (grain's index_shuffle, see stream_to_source). Process p of n reads only its own
contiguous slice of b = B/n rows of every global batch, so the global batch
and its masks are the same whatever the number of processes or devices:

  rows of the shuffled stream:  | step s: p0 p1 ... p(n-1) | step s+1: ... |

Masks are keyed by (seed, step, global row index). A worker reads the rows of several consecutive steps at once, masks them
in one vectorised call (numpy's per-call cost is ~0.3 ms, a batch of 16 rows
alone would pay it 16 times over) and the main process splits the chunk back
into steps. With `worker_count` > 0 grain runs that in worker processes, chunk
c in worker c mod worker_count, interleaved back in order, so the batches are
the same for any worker count.

Sentence pairs (NSP/SOP, optional): a packed row [CLS] content [SEP] is cut at
a hashed point into A and B and rebuilt as [CLS] A [SEP] B [SEP] [PAD]...
(content that no longer fits is dropped from the end), with segment ids 0 on
[CLS] A [SEP] and 1 on B [SEP] and labels in Hugging Face's convention:

  nsp  0: B is the true continuation; 1: B is random text, read from another
       row of the split chosen by the hash (so every process agrees);
  sop  0: A then B; 1: swapped, [CLS] B [SEP] A [SEP].

The cut, the label and the random row are functions of (seed, step, global
row index), like the masks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import grain
import grain.experimental as grain_experimental
import numpy as np
from absl import flags
from tensorflow_datasets.proto import tf_example_pb2

from mlm_jax.data import masking
from mlm_jax.data import tokenizer as tok_lib

SENTENCE_PAIR_TASKS = ('none', 'nsp', 'sop')
# Hash streams of the sentence-pair draws (masking uses streams below 100).
_PAIR_CUT, _PAIR_LABEL, _PAIR_OTHER = 101, 102, 103
# Rows read and masked per call in a worker (rounded to whole steps).
CHUNK_ROWS = 1024


class RowReader:
  """Reads rows by index: `reader(indices: [n]) -> input_ids [n, T] int32`; index -1: [PAD]s.

  For the prepared tfds array_record source it reads the records in one call
  and parses the tf.Example protos itself, ~3x faster than tfds's generic
  per-feature decoding; any other source (anything with `source[i]['input_ids']`)
  is read row by row.
  """

  def __init__(self, source: Any):
    self.source = source
    first = np.asarray(source[0]['input_ids'], np.int32)
    self.seq_len = len(first)
    self._raw = self._raw_records(source)
    if self._raw is not None and not np.array_equal(self._parse(self._raw.__getitems__([0])),
                                                     first[None]):
      self._raw = None  # Not the layout we know: use the source's own decoding.

  @staticmethod
  def _raw_records(source: Any):
    info = getattr(source, 'dataset_info', None)
    raw = getattr(source, 'data_source', None)
    if info is None or raw is None or getattr(source, 'decoders', None) is not None:
      return None
    if set(info.features.keys()) != {'input_ids'} or not hasattr(raw, '__getitems__'):
      return None
    return raw

  @staticmethod
  def _parse(records: Sequence[bytes]) -> np.ndarray:
    parse = tf_example_pb2.Example.FromString
    return np.array([parse(r).features.feature['input_ids'].int64_list.value for r in records],
                    np.int32)

  def __call__(self, indices: np.ndarray) -> np.ndarray:
    indices = np.asarray(indices)
    out = np.zeros((len(indices), self.seq_len), np.int32)
    real = indices >= 0
    keys = [int(i) for i in indices[real]]
    if not keys:
      return out
    if self._raw is not None:
      out[real] = self._parse(self._raw.__getitems__(keys))
    else:
      out[real] = np.stack([self.source[k]['input_ids'] for k in keys])
    return out

  def __len__(self) -> int:
    return len(self.source)


def sentence_pairs(input_ids: np.ndarray, *, task: str, seed: int, step: int | np.ndarray,
                   rows: np.ndarray, read_other=None,
                   own_indices: np.ndarray | None = None,
                   num_source_rows: int = 0) -> dict[str, np.ndarray]:
  """Packed rows [b, T] -> sentence-pair rows and their labels.

  Returns input_ids [b, T], segment_ids [b, T], sentence_pair_labels [b] int32
  and sentence_pair_weights [b] float32: 0 on rows with fewer than 2 content
  tokens (eval padding rows, a very short last row of a split), which are left
  as they were.
  For 'nsp', `read_other(indices [b]) -> [b, T]` reads the random rows, chosen
  uniformly among the `num_source_rows` rows of the split other than
  `own_indices` (the rows' own indices there).
  """
  if task not in ('nsp', 'sop'):
    raise ValueError(f"config.sentence_pair.task={task!r}: use 'none', 'nsp' or 'sop'")
  b, t = input_ids.shape
  content = (input_ids != tok_lib.PAD_ID).sum(axis=1) - 2     # [b] tokens between [CLS] and [SEP]
  m = np.clip(np.minimum(content, t - 3), 0, None)             # [b] content kept in the pair
  ok = m >= 2

  def draw(stream: int) -> np.ndarray:
    return masking.uniform(seed, step, rows, 1, stream)[:, 0]

  cut = np.where(ok, 1 + np.floor(draw(_PAIR_CUT) * (m - 1)).astype(np.int64), m)  # len(A)
  label = ok & (draw(_PAIR_LABEL) >= 0.5)
  swapped = label if task == 'sop' else np.zeros(b, bool)
  first = np.where(swapped, m - cut, cut)[:, None]           # [b, 1] tokens of the first segment
  m, cut = m[:, None], cut[:, None]
  pos = np.arange(t)[None, :]
  in_first = (pos >= 1) & (pos <= first)
  in_second = (pos >= first + 2) & (pos <= m + 1)
  is_sep = (pos == first + 1) | (pos == m + 2)
  # Column of the packed row that each position copies.
  col = np.where(in_first, np.where(swapped[:, None], cut + pos, pos),
                 np.where(swapped[:, None], pos - m + cut - 1, pos - 1))
  row_idx = np.arange(b)[:, None]
  tokens = input_ids[row_idx, np.clip(col, 0, t - 1)]
  if task == 'nsp' and label.any():
    if read_other is None or own_indices is None or num_source_rows < 2:
      raise ValueError("sentence_pair.task='nsp' needs read_other, own_indices and a split "
                       'of at least 2 rows')
    offset = 1 + np.floor(draw(_PAIR_OTHER) * (num_source_rows - 1)).astype(np.int64)
    other = read_other(np.where(label, (np.asarray(own_indices) + offset) % num_source_rows, -1))
    other_content = np.maximum((other != tok_lib.PAD_ID).sum(axis=1) - 2, 1)[:, None]
    # B' starts where B would have, wrapping around a short random row.
    other_tokens = other[row_idx, 1 + (pos - 2) % other_content]
    tokens = np.where(label[:, None] & in_second, other_tokens, tokens)
  paired = np.where(in_first | in_second, tokens,
                    np.where(pos == 0, tok_lib.CLS_ID,
                             np.where(is_sep, tok_lib.SEP_ID, tok_lib.PAD_ID)))
  segments = ((pos >= first + 2) & (pos <= m + 2)).astype(np.int32)
  keep = ~ok[:, None]
  return {
      'input_ids': np.where(keep, input_ids, paired).astype(np.int32),       # [b, T]
      'segment_ids': np.where(keep, 0, segments).astype(np.int32),          # [b, T]
      'sentence_pair_labels': label.astype(np.int32),                       # [b]
      'sentence_pair_weights': ok.astype(np.float32),                       # [b]
  }


@dataclasses.dataclass(frozen=True, eq=False)
class BatchBuilder:
  """Source row indices -> a masked batch; pickled into grain's worker processes."""

  reader: RowReader
  masker: masking.Masker
  seed: int
  sentence_pair: str = 'none'

  def __post_init__(self):
    if self.sentence_pair not in SENTENCE_PAIR_TASKS:
      raise ValueError(f'config.sentence_pair.task={self.sentence_pair!r}: use one of '
                       f'{SENTENCE_PAIR_TASKS}')

  def __call__(self, indices: np.ndarray, *, step: int | np.ndarray,
               rows: np.ndarray) -> dict[str, np.ndarray]:
    """indices [n] into the source (-1: a padding row); step: one or [n]; rows: [n] global."""
    input_ids = self.reader(indices)
    if self.sentence_pair == 'none':
      return self.masker(input_ids, seed=self.seed, step=step, rows=rows)
    pairs = sentence_pairs(input_ids, task=self.sentence_pair, seed=self.seed, step=step,
                           rows=rows, read_other=self.reader, own_indices=indices,
                           num_source_rows=len(self.reader))
    batch = self.masker(pairs['input_ids'], seed=self.seed, step=step, rows=rows)
    batch['segment_ids'] = pairs['segment_ids']
    batch['sentence_pair_labels'] = pairs['sentence_pair_labels']
    batch['sentence_pair_weights'] = pairs['sentence_pair_weights']
    return batch


def stream_to_source(rows: np.ndarray, num_rows: int, seed: int) -> np.ndarray:
  """Global stream positions [n] -> source row indices [n]: a new permutation every epoch.

  Position r is row index_shuffle(r mod N) of epoch r // N, with grain's
  bijective index_shuffle seeded by seed + epoch: what grain's
  MapDataset.range(N).repeat().shuffle(seed) gives, called directly per row
  (the dataset machinery around it costs ~3x the shuffle itself).
  """
  epochs, within = np.divmod(rows, num_rows)
  return np.array([grain_experimental.index_shuffle(int(i), max_index=num_rows - 1,
                                                    seed=int((seed + e) % 2**32), rounds=4)
                   for e, i in zip(epochs, within)], np.int64)


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
                  chunk_rows: int = CHUNK_ROWS) -> Iterator[dict[str, np.ndarray]]:
  """Yields this process's masked part of global batches start_step, start_step+1, ...

  worker_count: grain worker processes (0: threads of this process); prefetch:
  chunks of about `chunk_rows` rows computed ahead per worker.
  """
  if global_batch % process_count:
    raise ValueError(f'global batch {global_batch} does not divide over {process_count} processes')
  local = global_batch // process_count
  builder = BatchBuilder(RowReader(source), masker, seed, sentence_pair)
  steps_per_chunk = max(1, chunk_rows // local)

  def build(c: int) -> dict[str, np.ndarray]:
    steps = start_step + c * steps_per_chunk + np.arange(steps_per_chunk)
    rows = (steps[:, None] * global_batch + process_index * local + np.arange(local)).ravel()
    return builder(stream_to_source(rows, len(source), seed), step=np.repeat(steps, local),
                   rows=rows)

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

  Padding rows are all [PAD]: they have no maskable token, so their
  masked_weights (and sentence_pair_weights) are 0 and they change no metric.
  """
  local = global_batch // process_count
  builder = BatchBuilder(RowReader(source), masker, mask_seed, sentence_pair)
  n = len(source)
  num_batches = -(-n // global_batch)
  if max_batches:
    num_batches = min(num_batches, max_batches)
  for b in range(num_batches):
    rows = b * global_batch + process_index * local + np.arange(local)
    yield builder(np.where(rows < n, rows, -1), step=b, rows=rows)
