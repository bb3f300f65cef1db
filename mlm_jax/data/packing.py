"""The work of prepare's worker processes: tokenize units of the corpus, write shards of rows.

A unit's documents become units/NNNNNN/ (int32 ids of its documents, their
lengths and splits). How they become rows of T ids is the RowLayout
(config.data.row_layout):

  packed           row r of a split is the slice [r(T-2), (r+1)(T-2)) of that
                   split's stream `doc [SEP] doc [SEP] ...` over all units in
                   order, between [CLS] and [SEP]: every row full but a
                   split's last (RoBERTa's FULL-SENTENCES).
  document_chunks  each document cut into chunks of T-2 ids, one row each,
                   [CLS] chunk [SEP] then [PAD] to T; rows in the order of
                   the documents (Ettin's rows: JHU-CLSP/ettin-encoder-vs-
                   decoder, pretraining/data_processing/src/sampling/
                   split_dataset_into_chunks_individual.py's chunk_instance).
                   A document's later chunk shorter than drop_tokens is
                   dropped; one shorter than min_tokens takes a share of the
                   chunk before it (Ettin's backfill without duplicates: a
                   number of that chunk's last ids drawn uniformly from
                   [0, T-2 - its length), here by a hash of the document's
                   ids and the split seed instead of a generator's state).

Either way each shard is computed from the unit files alone, by any worker.
Everything is written under a temporary name and renamed when complete.

Each shard is a plain .npy array of its rows under DATA_DIR/rows/, which the
input pipeline reads (data/packed_rows.py); the tfds copy of the rows is an
export made from these files when asked for (data/tfds_export.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import shutil
import threading
import zlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
import tqdm

from mlm_jax.data import corpus as corpus_lib
from mlm_jax.data import line_sample
from mlm_jax.data import packed_rows
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.data.sources import Ids
from mlm_jax.errors import CorpusError

# Texts per tokenizer encode call.
_DOCS_PER_CHUNK = 2000
# config.data.row_layout.
ROW_LAYOUTS = ('packed', 'document_chunks')


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """How documents become rows (the module's docstring): config.data's row_layout,
  chunk_min_tokens and chunk_drop_tokens."""

  kind: str = 'packed'
  min_tokens: int = 0
  drop_tokens: int = 0

  @classmethod
  def from_config(cls, data: ml_collections.ConfigDict) -> RowLayout:
    kind = data.get('row_layout', 'packed')
    if kind == 'packed':
      return cls()
    return cls(kind, int(data.chunk_min_tokens), int(data.chunk_drop_tokens))

  @property
  def chunked(self) -> bool:
    return self.kind == 'document_chunks'


PACKED = RowLayout()


def is_validation(text: str | Ids, fraction: float, seed: int) -> bool:
  """A stable, content-keyed coin flip per document: keyed by its first piece of text, or by
  its token ids (a pre-tokenized document)."""
  content = (np.asarray(text.ids, '<i4').tobytes() if isinstance(text, Ids)
             else text.encode('utf-8', 'replace'))
  h = zlib.crc32(content, zlib.crc32(str(seed).encode()))
  return h / 2**32 < fraction


def split_role(name: str) -> str:
  """'train' or 'validation': what a stored split is ('train', or a mixture member's 'train_1')."""
  return name.partition('_')[0]


# Per worker process: what init_worker was given, and the tokenizer once loaded.
_WORKER: dict = {}


def init_worker(reader: corpus_lib.Corpus, tokenizer_path: str, val_fraction: float,
                split_seed: int, seq_len: int, all_threads: bool,
                layout: RowLayout = PACKED) -> None:
  """`tokenizer_path`: the tokenizer that stage 1 writes (DATA_DIR/tokenizer.model or
  DATA_DIR/tokenizer/), read with tokenizer.load when a task first needs it."""
  _WORKER.clear()
  _WORKER.update(reader=reader, tokenizer_path=tokenizer_path, val=(val_fraction, split_seed),
                 seq_len=seq_len, threads=0 if all_threads else 1, layout=layout)


def _tokenizer() -> tok_lib.Tokenizer:
  """The data dir's tokenizer, loaded on first use (the pool starts before it is trained)."""
  if 'tokenizer' not in _WORKER:
    _WORKER['tokenizer'] = tok_lib.load(_WORKER['tokenizer_path'])
  return _WORKER['tokenizer']


def document_pieces(unit: corpus_lib.Unit,
                    tally: corpus_lib.Tally) -> Iterator[tuple[bool, str | Ids, bool]]:
  """(first piece of a document, the piece sanitized (or a document's Ids), its document is
  held out) of a unit, read from the corpus; what the unit's input held is counted in `tally`."""
  is_val = False
  for first, piece in _WORKER['reader'].pieces(unit, tally):
    if isinstance(piece, Ids):  # A given tokenizer's ids: the tokenizer is there already.
      piece = Ids(checked_ids(piece, _tokenizer()), piece.where)
    else:
      piece = tok_lib.sanitize(piece)
    if first:
      is_val = is_validation(piece, *_WORKER['val'])
    yield first, piece, is_val


def train_lines(unit: corpus_lib.Unit, tally: corpus_lib.Tally,
                documents: list[int]) -> Iterator[str]:
  """The stripped non-empty lines of a unit's training documents; counts them in documents[0]."""
  for first, piece, is_val in document_pieces(unit, tally):
    documents[0] += first and not is_val
    if not is_val and not isinstance(piece, Ids):  # Token ids teach a tokenizer nothing.
      for line in piece.splitlines():
        if line := line.strip():
          yield line


def sample_unit(index: int, unit: corpus_lib.Unit, max_lines: int, seed: int,
                below: int) -> tuple[line_sample.LineSample, int, dict]:
  """Stage 1 in a worker: (the unit's share of the tokenizer sample, documents, tally).

  Only sentences with keys below `below` come back (see line_sample.merge_samples).
  """
  tally, documents = corpus_lib.Tally(), [0]
  sample = line_sample.sample_part(train_lines(unit, tally, documents), max_lines, seed,
                                   part=index, below=below)
  return sample, documents[0], tally.to_json()


class Pool:
  """`workers` spawned processes (or this one, for 1) that run tasks with a progress bar.

  `init_args`: init_worker's, for the tasks that read the corpus or the
  tokenizer; None for tasks that need neither (the tfds export).
  """

  def __init__(self, workers: int, init_args: tuple | None):
    self._workers, self._init_args, self._executor = workers, init_args, None

  def __enter__(self) -> Pool:
    init = self._init_args is not None
    if self._workers == 1:
      if init:
        init_worker(*self._init_args)
    else:
      # Spawned, not forked: the caller may have started JAX's threads.
      self._executor = concurrent.futures.ProcessPoolExecutor(
          self._workers, mp_context=multiprocessing.get_context('spawn'),
          initializer=init_worker if init else None, initargs=self._init_args or ())
    return self

  def __exit__(self, *exc) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)

  def run(self, fn: Callable, tasks: Sequence[tuple], desc: str, total: int) -> None:
    for _ in self.results(fn, tasks, desc, total, todo=len(tasks)):
      pass

  def results(self, fn: Callable, tasks: Iterable[tuple], desc: str,
              total: int, todo: int | None = None) -> Iterator[Any]:
    """fn(*task) for every task, yielded as each finishes (in any order).

    Tasks are taken from `tasks` only when a worker is about to be free (two
    in flight per worker), so a task made by a generator can depend on the
    results yielded before it. `todo`: how many tasks there are (default: all
    `total`), for the progress bar.
    """
    todo = total if todo is None else todo
    bar = tqdm.tqdm(total=total, initial=total - todo, desc=desc, unit='task', mininterval=2)
    tasks = iter(tasks)
    with bar:
      if self._executor is None:
        for task in tasks:
          yield fn(*task)
          bar.update()
        return
      pending = set()
      while True:
        for task in itertools.islice(tasks, 2 * self._workers - len(pending)):
          pending.add(self._executor.submit(fn, *task))
        if not pending:
          return
        done, pending = concurrent.futures.wait(
            pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          result = future.result()  # Re-raises a worker's exception here.
          bar.update()
          yield result

  @contextlib.contextmanager
  def meanwhile(self, fn: Callable, tasks: Iterable[tuple]) -> Iterator[None]:
    """fn(*task) in the pool's workers while this process does other work.

    At most workers - 1 tasks run at once, so that one core stays with this
    process (sentencepiece's training is mostly one thread, and slows down
    when a task holds every other core). On leaving, the tasks not
    started are dropped and the running ones finished. Their results and
    errors are not kept, so the caller must not depend on them: a task that
    failed here is done again, and its error reported, by the stage that
    needs it. An in-process pool runs none.
    """
    if self._executor is None or self._workers < 2:
      yield
      return
    stop = threading.Event()

    def feed():
      running = set()
      for task in tasks:
        while len(running) >= self._workers - 1:
          _, running = concurrent.futures.wait(
              running, return_when=concurrent.futures.FIRST_COMPLETED)
        if stop.is_set():
          break
        running.add(self._executor.submit(fn, *task))
      concurrent.futures.wait(running)

    feeder = threading.Thread(target=feed, name='pool-meanwhile', daemon=True)
    feeder.start()
    try:
      yield
    finally:
      stop.set()
      feeder.join()


def remove_temporaries(directory: str) -> None:
  """Leftovers of interrupted writers (our own names only)."""
  for name in os.listdir(directory):
    if '.tmp-' in name:
      path = os.path.join(directory, name)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.remove(path)


def split_path(units_dir: str, index: int) -> str:
  """Where read_unit keeps a unit's documents until tokenize_unit has them."""
  return os.path.join(units_dir, f'{index:06d}.read.npz')


def read_unit(index: int, unit: corpus_lib.Unit, units_dir: str) -> None:
  """Stage 2's reading, done ahead while the tokenizer trains: units_dir/NNNNNN.read.npz.

  The unit's pieces as tokenize_unit would read them (sanitized, each
  document's split decided), with the tally of its input, so that stage 2
  only encodes them.
  """
  tally = corpus_lib.Tally()
  pieces = list(document_pieces(unit, tally))
  texts = [piece.encode('utf-8', 'surrogatepass') for _, piece, _ in pieces]
  path = split_path(units_dir, index)
  tmp = f'{path[:-len(".npz")]}.tmp-{os.getpid()}.npz'
  np.savez(tmp, text=np.frombuffer(b''.join(texts), np.uint8),
           sizes=np.asarray([len(t) for t in texts], np.int64),
           first=np.asarray([first for first, _, _ in pieces], bool),
           held_out=np.asarray([held_out for _, _, held_out in pieces], bool),
           tally=np.asarray(json.dumps(tally.to_json())))
  os.replace(tmp, path)


def _unit_pieces(index: int, unit: corpus_lib.Unit, units_dir: str,
                 tally: corpus_lib.Tally) -> Iterator[tuple[bool, str, bool]]:
  """document_pieces of a unit: from read_unit's file if there is one, else from the corpus."""
  path = split_path(units_dir, index)
  if not os.path.exists(path):
    yield from document_pieces(unit, tally)
    return
  with np.load(path) as read:
    text, sizes = read['text'].tobytes(), read['sizes'].tolist()
    firsts, held_out = read['first'].tolist(), read['held_out'].tolist()
    tally.add(json.loads(str(read['tally'])))
  ends = list(itertools.accumulate(sizes))
  for first, start, end, is_val in zip(firsts, [0, *ends], ends, held_out):
    yield first, text[start:end].decode('utf-8', 'surrogatepass'), is_val


def tokenize_unit(index: int, unit: corpus_lib.Unit, units_dir: str) -> None:
  """Writes units_dir/NNNNNN/: ids.bin (int32 ids of all documents), docs.npz, tally.json."""
  tokenizer = _tokenizer()
  final = os.path.join(units_dir, f'{index:06d}')
  tmp = f'{final}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  tally = corpus_lib.Tally()
  lengths: list[int] = []
  is_val: list[bool] = []
  texts: list[str] = []
  owners: list[int] = []
  with open(os.path.join(tmp, 'ids.bin'), 'wb') as f:

    def flush():
      if not texts:
        return
      # Corpus text: a special token's spelling in it is plain text.
      encoded = tokenizer.encode_documents(texts, num_threads=_WORKER['threads'])
      for doc, ids in zip(owners, encoded):
        lengths[doc] += len(ids)
        f.write(np.asarray(ids, np.int32).tobytes())
      texts.clear()
      owners.clear()

    chars = 0
    for first, piece, held_out in _unit_pieces(index, unit, units_dir, tally):
      if first:
        lengths.append(0)
        is_val.append(held_out)
      if isinstance(piece, Ids):
        flush()
        lengths[-1] += len(piece.ids)
        f.write(piece.ids.astype(np.int32).tobytes())
        continue
      texts.append(piece)
      owners.append(len(lengths) - 1)
      chars += len(piece)
      if len(texts) >= _DOCS_PER_CHUNK or chars >= 4 * corpus_lib.PIECE_CHARS:
        flush()
        chars = 0
    flush()
  lengths_np = np.asarray(lengths, np.int64)
  keep = lengths_np > 0  # A document of no ids (e.g. only stripped markup) adds nothing.
  np.savez(os.path.join(tmp, 'docs.npz'), lengths=lengths_np[keep],
           is_val=np.asarray(is_val, bool)[keep])
  with open(os.path.join(tmp, 'tally.json'), 'w') as f:
    json.dump(tally.to_json(), f)
  try:
    os.rename(tmp, final)
  except OSError:  # Another run finished it first: same content.
    shutil.rmtree(tmp, ignore_errors=True)
  if os.path.exists(split_path(units_dir, index)):
    os.remove(split_path(units_dir, index))



def checked_ids(document: Ids, tokenizer: tok_lib.Tokenizer) -> np.ndarray:
  """A pre-tokenized document's ids as packing takes them: a leading [CLS] and a trailing [SEP]
  (which a tokenizer's encode adds) dropped, as packing adds its own. CorpusError naming the
  row for an id outside the vocabulary, or a [PAD] or [MASK] inside the text."""
  ids, s = document.ids, tokenizer.specials
  if len(ids) and ids[0] == s.cls:
    ids = ids[1:]
  if len(ids) and ids[-1] == s.sep:
    ids = ids[:-1]
  outside = (ids < 0) | (ids >= tokenizer.vocab_size)
  if outside.any():
    raise CorpusError(
        f'{document.where}: token id {int(ids[outside][0])} is outside the vocabulary of the '
        f'given tokenizer ({tokenizer.describe()}): these ids were made with another tokenizer; '
        'set config.tokenizer.model_file to the one they were made with.')
  reserved = np.isin(ids, (s.pad, s.mask))
  if reserved.any():
    raise CorpusError(
        f'{document.where}: holds the id {int(ids[reserved][0])} of '
        f'{tokenizer.id_to_piece(int(ids[reserved][0]))!r} inside a document, which padding and '
        'masking give their own meaning; remove it from the ids.')
  return ids


def unit_entry(unit_dir: str, lengths: np.ndarray, seq_len: int,
               layout: RowLayout) -> tuple[str, int, int, int, int]:
  """A unit's part of a split (the documents of `lengths` ids each): (unit_dir, size,
  documents, tokens, kept), size in the layout's terms (packed: its stream's length, every
  document and its [SEP]; document_chunks: its rows) and kept the ids its rows hold."""
  tokens = int(lengths.sum())
  if not layout.chunked:
    return unit_dir, tokens + len(lengths), len(lengths), tokens, tokens
  rows, kept = chunk_rows(lengths, seq_len - 2, layout)
  return unit_dir, int(rows.sum()), len(lengths), tokens, int(kept.sum())


def split_stats(stream: list[tuple[str, int, int, int, int]], seq_len: int,
                layout: RowLayout = PACKED) -> dict:
  """Documents, tokens, rows and padding of a split, from its units' unit_entry()s; chunked,
  also the ids dropped with documents' short last chunks."""
  content = seq_len - 2
  tokens = sum(t for *_, t, _ in stream)
  if layout.chunked:
    rows, kept = sum(n for _, n, *_ in stream), sum(k for *_, k in stream)
    total = rows * seq_len
    return {'documents': sum(d for _, _, d, _, _ in stream), 'tokens': tokens, 'rows': rows,
            'padding_fraction': (total - kept - 2 * rows) / total if total else 0.0,
            'dropped_tokens': tokens - kept}
  length = sum(n for _, n, *_ in stream)  # Every document + its [SEP].
  # The final [SEP] is dropped unless it fills the last row; a rest is padded.
  rest = length % content
  rows = length // content + (rest > 1)
  padding = content - (rest - 1) if rest > 1 else 0
  total = rows * seq_len
  return {'documents': sum(d for _, _, d, _, _ in stream), 'tokens': tokens,
          'rows': rows, 'padding_fraction': padding / total if total else 0.0}


def chunk_rows(lengths: np.ndarray, content: int,
               layout: RowLayout) -> tuple[np.ndarray, np.ndarray]:
  """Per document of `lengths` ids, chunked into `content` ids a row: (its rows, the ids they
  hold). A document's first chunk is always kept; a later one under drop_tokens is not."""
  full, rest = np.divmod(np.asarray(lengths, np.int64), content)
  last = (rest > 0) & ((full == 0) | (rest >= layout.drop_tokens))
  return full + last, full * content + np.where(last, rest, 0)


def chunk_bounds(lengths: np.ndarray, content: int, layout: RowLayout, seed: int,
                 ids_of: Callable[[int], np.ndarray]) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray]:
  """The rows of documents of `lengths` ids (chunk_rows's, in order): (each row's document,
  start, end) in its document's ids. Chunks of `content`; a last chunk under drop_tokens is
  gone (chunk_rows), one under min_tokens that is not the first starts backfill_share() ids
  earlier, the chunk before ending as much earlier. `ids_of(d)`: document d's ids, read only
  for those backfilled."""
  lengths = np.asarray(lengths, np.int64)
  counts = chunk_rows(lengths, content, layout)[0]
  doc = np.repeat(np.arange(len(lengths)), counts)
  chunk = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)
  start = chunk * content
  end = np.minimum(start + content, lengths[doc])
  short = (chunk > 0) & (chunk == counts[doc] - 1) & (end - start < layout.min_tokens)
  for row in np.flatnonzero(short):
    share = backfill_share(ids_of(int(doc[row])), int(end[row] - start[row]), content, seed)
    start[row] -= share
    end[row - 1] -= share
  return doc, start, end


def backfill_share(ids: np.ndarray, short: int, content: int, seed: int) -> int:
  """How many ids a document's short last chunk (`short` ids) takes from the chunk before:
  uniform in [0, content - short) as Ettin's np.random.randint, by a hash of the document's
  `ids` and `seed` (so the rows depend on the config alone)."""
  key = zlib.crc32(np.asarray(ids, '<i4').tobytes(), zlib.crc32(str(seed).encode()))
  return key % (content - short)


def _split_documents(unit_dir: str, validation: bool) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray]:
  """A unit's documents: (every document's length, its start in ids.bin, the indices of the
  split's documents)."""
  docs = np.load(os.path.join(unit_dir, 'docs.npz'))
  lengths = docs['lengths']
  return lengths, np.cumsum(lengths) - lengths, np.flatnonzero(docs['is_val'] == validation)


def unit_stream(unit_dir: str, validation: bool, lo: int, hi: int, sep_id: int) -> np.ndarray:
  """[hi - lo] int32: positions [lo, hi) of the unit's `doc [SEP] doc [SEP] ...` for a split."""
  lengths, starts, sel = _split_documents(unit_dir, validation)
  lens = lengths[sel] + 1
  ends = np.cumsum(lens)
  first, last = np.searchsorted(ends, lo, 'right'), np.searchsorted(ends - lens, hi, 'left')
  sel, lens, ends = sel[first:last], lens[first:last], ends[first:last]
  if not len(sel):
    return np.zeros(0, np.int32)
  begins = ends - lens
  base = begins[0]
  pos = np.arange(lens.sum()) + np.repeat(starts[sel] - (begins - base), lens)
  seps = ends - 1 - base
  pos[seps] = 0  # Any valid index; overwritten below.
  out = np.asarray(np.memmap(os.path.join(unit_dir, 'ids.bin'), np.int32, 'r')[pos])
  out[seps] = sep_id
  return out[lo - base:hi - base]


def write_shard(split: str, k: int, num_shards: int, r0: int, r1: int,
                stream: list[tuple[str, int, int, int, int]], dense_dir: str, tmp_dir: str,
                counts_dir: str) -> None:
  """Writes rows [r0, r1) of a split as .npy shard k (and, for train, its counts first: the
  shard's presence marks both complete)."""
  tokenizer = _tokenizer()
  specials = tokenizer.specials
  build = _chunked_rows if _WORKER['layout'].chunked else _packed_rows
  rows = build(split, r0, r1, stream, _WORKER['seq_len'], specials)
  if split_role(split) == 'train':
    counts = np.bincount(rows.ravel(), minlength=tokenizer.vocab_size)
    counts[list(specials.never_masked)] = 0  # Documents never hold [PAD], [CLS] or [SEP].
    tmp = os.path.join(tmp_dir, f'counts-{split}-{k:05d}-{os.getpid()}.npy')
    np.save(tmp, counts.astype(np.int64))
    os.replace(tmp, os.path.join(counts_dir, f'{split}-{k:05d}.npy'))
  tmp = os.path.join(tmp_dir, f'{split}-{k:05d}-{os.getpid()}.npy')
  np.save(tmp, rows.astype(dense_dtype(tokenizer.vocab_size)))
  os.replace(tmp, packed_rows.dense_path(dense_dir, split, k, num_shards))


def _packed_rows(split: str, r0: int, r1: int, stream: list[tuple[str, int, int, int, int]],
                 seq_len: int, specials: tok_lib.Specials) -> np.ndarray:
  """[r1 - r0, T] int32: rows [r0, r1) of the split's packed stream."""
  content = seq_len - 2
  length = sum(n for _, n, *_ in stream)
  a, b = r0 * content, min(r1 * content, length)
  parts, offset = [], 0
  for unit_dir, n, *_ in stream:
    lo, hi = max(a, offset) - offset, min(b, offset + n) - offset
    if lo < hi:
      parts.append(unit_stream(unit_dir, split_role(split) == 'validation', lo, hi,
                               specials.sep))
    offset += n
  flat = np.full((r1 - r0) * content, specials.pad, np.int32)
  flat[:b - a] = np.concatenate(parts)
  if length % content and a <= length - 1 < b:
    flat[length - 1 - a] = specials.pad  # The last document's [SEP] is the row's own.
  body = flat.reshape(-1, content)
  return np.concatenate([np.full((len(body), 1), specials.cls, np.int32), body,
                         np.full((len(body), 1), specials.sep, np.int32)], axis=1)


def _chunked_rows(split: str, r0: int, r1: int, stream: list[tuple[str, int, int, int, int]],
                  seq_len: int, specials: tok_lib.Specials) -> np.ndarray:
  """[r1 - r0, T] int32: rows [r0, r1) of the split in the document_chunks layout."""
  layout, seed = _WORKER['layout'], _WORKER['val'][1]
  content = seq_len - 2
  rows = np.full((r1 - r0, seq_len), specials.pad, np.int32)
  rows[:, 0] = specials.cls
  offset = 0  # The split's rows before this unit.
  for unit_dir, n, *_ in stream:
    lo, hi = max(r0, offset) - offset, min(r1, offset + n) - offset
    if lo < hi:
      lengths, starts, sel = _split_documents(unit_dir, split_role(split) == 'validation')
      ends = np.cumsum(chunk_rows(lengths[sel], content, layout)[0])
      # The documents whose rows meet [lo, hi).
      first = np.searchsorted(ends, lo, 'right')
      last = min(np.searchsorted(ends, hi, 'left') + 1, len(sel))
      sel = sel[first:last]
      ids_bin = np.memmap(os.path.join(unit_dir, 'ids.bin'), np.int32, 'r')
      doc, a, b = chunk_bounds(
          lengths[sel], content, layout, seed,
          lambda d: ids_bin[starts[sel[d]]:starts[sel[d]] + lengths[sel[d]]])
      row = (ends[first - 1] if first else 0) + np.arange(len(doc))  # In the unit's split.
      keep = (row >= lo) & (row < hi)
      out, size, where = offset + row[keep] - r0, (b - a)[keep], starts[sel[doc[keep]]] + a[keep]
      within = np.arange(size.sum()) - np.repeat(np.cumsum(size) - size, size)
      rows[np.repeat(out, size), 1 + within] = ids_bin[np.repeat(where, size) + within]
      rows[out, 1 + size] = specials.sep
    offset += n
  return rows


def dense_dtype(vocab_size: int) -> type:
  """The dtype of the .npy rows: uint16 while every id fits, else int32."""
  return np.uint16 if vocab_size <= 1 << 16 else np.int32
