"""Prepare: text -> tokenizer -> packed [CLS] ... [SEP] rows + unigram counts.

Runs once per (corpus, tokenizer settings, T): the result is a tfds dataset in
array_record format under the data dir, with the sentencepiece model, the
token counts and a report beside it:

  DATA_DIR/fingerprint.json    what the data was made from (checked on reuse)
  DATA_DIR/tokenizer.model     sentencepiece model
  DATA_DIR/unigram_counts.npy  [vocab] int64 token counts of the train split
  DATA_DIR/stats.json          documents, tokens, rows, padding per split
  DATA_DIR/report.json         stats + inputs skipped or repaired, tokenizer sample, work
  DATA_DIR/tfds/mlm_rows/1.0.0 the rows: {'input_ids': int32[T]}

Packing follows RoBERTa's FULL-SENTENCES: documents are concatenated with
[SEP] between them and cut into rows of exactly T ids, so only the last row of
each split has padding. Documents, not rows, are assigned to the validation
split, so no held-out text is seen in training.

Three stages, in DATA_DIR.partial, renamed to DATA_DIR when all are done:
  1. tokenizer: one pass over the training documents; a sample of at most
     config.tokenizer.max_sentences of their lines trains sentencepiece.
  2. tokenize, in `config.data.num_workers` processes: each unit of the corpus
     (a group of files, a range of tfds records) becomes units/NNNNNN/ (ids of
     its documents and their lengths and splits).
  3. pack and write, in the same processes: row r of a split is the slice
     [r(T-2), (r+1)(T-2)) of that split's stream `doc [SEP] doc [SEP] ...`, so
     each array_record shard is computed from the unit files alone.
Every unit and shard is written under a temporary name and renamed when
complete, so an interrupted prepare keeps its finished work and a rerun
continues from it. The rows depend only on the config: not on the number of
workers, the grouping into units, or interruptions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
import zlib
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence

import ml_collections
import numpy as np
import tensorflow_datasets as tfds
import tqdm
from tensorflow_datasets.core import file_adapters

from mlm_jax.data import corpus as corpus_lib
from mlm_jax.data import tokenizer as tok_lib

FORMAT_VERSION = 1
# Texts per sentencepiece encode call.
_DOCS_PER_CHUNK = 2000
# Raw ids per array_record shard (rows = this / (4 T)).
SHARD_BYTES = 64 << 20
_ROWS_NAME, _ROWS_VERSION = 'mlm_rows', '1.0.0'
_FILENAME_TEMPLATE = '{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}'
_SPLITS = ('train', 'validation')


class DataDirError(ValueError):
  """The data dir holds something other than what this config would make."""


@dataclasses.dataclass(frozen=True)
class PreparedData:
  data_dir: str
  tokenizer: tok_lib.Tokenizer
  unigram_counts: np.ndarray  # [vocab] int64
  stats: dict

  @property
  def rows_dir(self) -> str:
    return _rows_dir(self.data_dir)

  @property
  def report(self) -> dict:
    """report.json: stats, skipped and repaired inputs, tokenizer sample, work done."""
    path = os.path.join(self.data_dir, 'report.json')
    if not os.path.exists(path):
      return {}  # Prepared before reports existed.
    with open(path) as f:
      return json.load(f)

  def most_frequent_token(self) -> int:
    """The train split's most frequent normal (non-special) token id."""
    counts = self.unigram_counts.astype(np.float64).copy()
    counts[list(tok_lib.SPECIAL_IDS)] = 0
    return int(np.argmax(counts))

  def source(self, split: str):
    """A random-access source of {'input_ids': int32[T]} rows."""
    builder = tfds.builder_from_directory(self.rows_dir)
    return builder.as_data_source(split)


def _rows_dir(data_dir: str) -> str:
  return os.path.join(data_dir, 'tfds', _ROWS_NAME, _ROWS_VERSION)


def fingerprint(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict,
                corpus: corpus_lib.Corpus | None = None) -> dict:
  """Everything the prepared data depends on (not num_workers: the rows do not)."""
  if tok.model_file:
    tokenizer = {'model_file_sha256': _file_digest(os.path.expanduser(tok.model_file))}
  else:
    tokenizer = {'vocab_size': tok.vocab_size, 'model_type': tok.model_type,
                 'character_coverage': tok.character_coverage,
                 'max_sentences': tok.max_sentences}
  corpus = corpus or corpus_lib.resolve(data)
  return {
      'format': FORMAT_VERSION,
      'corpus': corpus.description,
      'document_split': data.document_split if corpus.kind == 'files' else (
          'docstring' if corpus.kind == 'stdlib' else 'record'),
      'seq_len': data.seq_len,
      'val_fraction': data.val_fraction,
      'split_seed': data.split_seed,
      'tokenizer': tokenizer,
  }


def _file_digest(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def default_data_dir(fp: dict) -> str:
  root = os.environ.get('MLM_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'mlm_jax'))
  digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  name = {'python-stdlib-docstrings': 'stdlib', 'tfds': 'tfds'}.get(fp['corpus']['source'], 'corpus')
  return os.path.join(root, 'data', f'{name}-T{fp["seq_len"]}-{digest}')


def resolve_data_dir(config: ml_collections.ConfigDict,
                     corpus: corpus_lib.Corpus | None = None) -> tuple[str, dict]:
  fp = fingerprint(config.data, config.tokenizer, corpus)
  data_dir = config.data.data_dir or default_data_dir(fp)
  return os.path.abspath(os.path.expanduser(data_dir)), fp


def load(data_dir: str) -> PreparedData:
  with open(os.path.join(data_dir, 'stats.json')) as f:
    stats = json.load(f)
  return PreparedData(
      data_dir=data_dir,
      tokenizer=tok_lib.Tokenizer(os.path.join(data_dir, 'tokenizer.model')),
      unigram_counts=np.load(os.path.join(data_dir, 'unigram_counts.npy')),
      stats=stats)


def is_prepared(data_dir: str, fp: dict) -> bool:
  """True if data_dir holds data made from `fp`; raises if it holds other data."""
  fp_path = os.path.join(data_dir, 'fingerprint.json')
  if os.path.exists(fp_path):
    with open(fp_path) as f:
      found = json.load(f)
    if found == json.loads(json.dumps(fp)):
      return True
    diff = sorted(k for k in set(fp) | set(found) if fp.get(k) != found.get(k))
    raise DataDirError(
        f'{data_dir} holds data prepared from other settings (differs in: '
        f'{", ".join(diff)}). Set config.data.data_dir to a new directory, '
        'or leave it empty to use a cache directory keyed by the settings.')
  if os.path.isdir(data_dir) and os.listdir(data_dir):
    raise DataDirError(
        f'{data_dir} is not empty and is not an mlm_jax data dir '
        '(no fingerprint.json). Set config.data.data_dir to a new or empty directory.')
  return False


def prepare(config: ml_collections.ConfigDict) -> PreparedData:
  """Loads the prepared data for `config`, preparing it first (or finishing it) if needed."""
  corpus = corpus_lib.resolve(config.data)
  data_dir, fp = resolve_data_dir(config, corpus)
  if is_prepared(data_dir, fp):
    return load(data_dir)
  partial = data_dir + '.partial'
  _open_partial(partial, fp)
  try:
    report = _prepare_into(partial, corpus, config)
  except corpus_lib.CorpusError:
    shutil.rmtree(partial, ignore_errors=True)  # A rerun cannot help: nothing worth keeping.
    raise
  except BaseException:
    logging.warning('Prepare stopped; its finished units and shards are kept in %s. Run the '
                    'same command again to continue from them.', partial)
    raise
  os.remove(os.path.join(partial, 'partial.json'))
  if os.path.isdir(data_dir):
    os.rmdir(data_dir)  # Empty (checked above); rename needs it gone.
  os.rename(partial, data_dir)
  print(format_report(report, data_dir), flush=True)
  return load(data_dir)


def _open_partial(partial: str, fp: dict) -> None:
  """Creates DATA_DIR.partial, or keeps an unfinished one made from the same settings."""
  marker = os.path.join(partial, 'partial.json')
  if os.path.isdir(partial):
    if not os.path.exists(marker):
      raise DataDirError(f'{partial} exists but is not an unfinished mlm_jax prepare (no '
                         'partial.json); move it away, or set config.data.data_dir elsewhere.')
    with open(marker) as f:
      if json.load(f) == json.loads(json.dumps(fp)):
        logging.info('Continuing the unfinished prepare in %s', partial)
        return
    logging.warning('Discarding %s: an unfinished prepare of other settings.', partial)
    shutil.rmtree(partial)
  new = f'{partial}.new-{os.getpid()}'
  os.makedirs(new)
  os.chmod(new, 0o755)
  with open(os.path.join(new, 'partial.json'), 'w') as f:
    json.dump(fp, f, indent=2)
  os.rename(new, partial)  # The marker is there before the name is.


def _prepare_into(out: str, corpus: corpus_lib.Corpus, config: ml_collections.ConfigDict) -> dict:
  data = config.data
  start = time.perf_counter()
  # A corpus of one unit is tokenized here: spawning would cost more than it saves.
  workers = min(data.num_workers or os.cpu_count() or 1, max(1, len(corpus.units)))

  # --- 1. tokenizer -----------------------------------------------------------
  tokenizer, tokenizer_report = _tokenizer(out, corpus, config)
  seconds = {'tokenizer': time.perf_counter() - start}

  # --- 2. tokenize the units, in parallel --------------------------------------
  units_dir = os.path.join(out, 'units')
  os.makedirs(units_dir, exist_ok=True)
  _remove_temporaries(units_dir)
  todo = [(i, u) for i, u in enumerate(corpus.units)
          if not os.path.isdir(os.path.join(units_dir, f'{i:06d}'))]
  logging.info('Tokenizing %d of %d units of %s with %d workers', len(todo), len(corpus.units),
               corpus.name, workers)
  reader = dataclasses.replace(corpus, units=[], tally=corpus_lib.Tally())
  init_args = (reader, os.path.join(out, 'tokenizer.model'), data.val_fraction, data.split_seed,
               data.seq_len, workers == 1)
  with _Pool(workers, init_args) as pool:
    pool.run(_tokenize_unit, [(i, u, units_dir) for i, u in todo], 'tokenize',
             len(corpus.units))
    seconds['tokenize'] = time.perf_counter() - start - sum(seconds.values())

    # --- 3. pack into rows and write the array_record shards, in parallel ----------
    tally = corpus_lib.Tally()
    tally.add(corpus.tally.to_json())
    streams = {s: [] for s in _SPLITS}  # Per unit: (dir, stream length, documents, tokens).
    for i in range(len(corpus.units)):
      unit_dir = os.path.join(units_dir, f'{i:06d}')
      with open(os.path.join(unit_dir, 'tally.json')) as f:
        tally.add(json.load(f))
      docs = np.load(os.path.join(unit_dir, 'docs.npz'))
      for s in _SPLITS:
        lengths = docs['lengths'][docs['is_val'] == (s == 'validation')]
        streams[s].append((unit_dir, int(lengths.sum() + len(lengths)), len(lengths),
                           int(lengths.sum())))
    stats = {s: _split_stats(streams[s], data.seq_len) for s in _SPLITS}
    _ensure_splits(stats, corpus, tally)

    rows_dir = _rows_dir(out)
    tmp_dir = os.path.join(out, 'tmp')
    counts_dir = os.path.join(out, 'counts')
    for d in (rows_dir, counts_dir):
      os.makedirs(d, exist_ok=True)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    rows_per_shard = max(1, SHARD_BYTES // (4 * data.seq_len))
    tasks, shard_lengths, num_shards = [], {}, 0
    for s in _SPLITS:
      rows = stats[s]['rows']
      n = -(-rows // rows_per_shard)
      shard_lengths[s] = [min(rows_per_shard, rows - k * rows_per_shard) for k in range(n)]
      num_shards += n
      for k in range(n):
        if not os.path.exists(_shard_path(rows_dir, s, k, n)):
          tasks.append((s, k, n, k * rows_per_shard, k * rows_per_shard + shard_lengths[s][k],
                        streams[s], rows_dir, tmp_dir, counts_dir))
    logging.info('Writing %d of %d shards of rows', len(tasks), num_shards)
    pool.run(_write_shard, tasks, 'write rows', num_shards)

  counts = np.zeros(tokenizer.vocab_size, np.int64)
  for k in range(len(shard_lengths['train'])):
    counts += np.load(os.path.join(counts_dir, f'train-{k:05d}.npy'))
  split_infos = [tfds.core.SplitInfo(
      name=s, shard_lengths=shard_lengths[s],
      num_bytes=sum(os.path.getsize(_shard_path(rows_dir, s, k, len(shard_lengths[s])))
                    for k in range(len(shard_lengths[s]))),
      filename_template=_template(rows_dir, s)) for s in _SPLITS]
  tfds.folder_dataset.write_metadata(
      data_dir=rows_dir, features=_features(data.seq_len), split_infos=split_infos,
      filename_template=_FILENAME_TEMPLATE, check_data=False,
      description='Packed [CLS] ... [SEP] rows of sentencepiece ids.')
  for d in (units_dir, counts_dir, tmp_dir):
    shutil.rmtree(d)
  os.remove(os.path.join(out, 'tokenizer.json'))  # Kept in the report.
  seconds['write'] = time.perf_counter() - start - sum(seconds.values())
  report = {
      'corpus': corpus.name,
      'splits': stats,
      'inputs': tally.to_json(),
      'tokenizer': tokenizer_report,
      'work': {'workers': workers, 'units': len(corpus.units),
               'units_reused': len(corpus.units) - len(todo), 'shards': num_shards,
               'shards_reused': num_shards - len(tasks),
               'seconds': round(time.perf_counter() - start, 2),
               'stage_seconds': {k: round(v, 2) for k, v in seconds.items()}},
  }
  np.save(os.path.join(out, 'unigram_counts.npy'), counts)
  for name, value in (('stats.json', stats), ('report.json', report)):
    with open(os.path.join(out, name), 'w') as f:
      json.dump(value, f, indent=2)
  # Written last: its presence marks a complete data dir.
  with open(os.path.join(out, 'fingerprint.json'), 'w') as f:
    with open(os.path.join(out, 'partial.json')) as marker:
      f.write(marker.read())
  return report


def format_report(report: dict, data_dir: str) -> str:
  """The report as a few lines for the console (report.json has it all)."""
  w = report['work']
  stages = ', '.join(f'{k} {v:.1f}s' for k, v in w['stage_seconds'].items())
  lines = [f'Prepared {report["corpus"]} into {data_dir} in {w["seconds"]:.1f}s ({stages}; '
           f'{w["workers"]} workers; reused {w["units_reused"]}/{w["units"]} units, '
           f'{w["shards_reused"]}/{w["shards"]} shards)']
  for s, st in report['splits'].items():
    lines.append(f'  {s}: {st["documents"]:,} documents, {st["tokens"]:,} tokens, '
                 f'{st["rows"]:,} rows, padding {st["padding_fraction"]:.4%}')
  t = report['tokenizer']
  if t.get('trained'):
    lines.append(f'  tokenizer: trained on {t["lines_sampled"]:,} of {t["lines_seen"]:,} lines '
                 f'({t["lines_too_long"]:,} over {tok_lib.MAX_SENTENCE_BYTES} bytes ignored)')
  inputs = report['inputs']
  counts = {k: v for k, v in inputs['counts'].items() if v}
  lines.append(f'  inputs: {json.dumps(counts)}')
  for kind in ('skipped', 'repaired'):
    for e in inputs[kind]:
      count = f' x{e["count"]}' if e.get('count', 1) != 1 else ''
      at = f' (lines {", ".join(map(str, e["lines"]))}{"..." if e["count"] > 10 else ""})' if (
          e.get('lines')) else ''
      lines.append(f'  {kind}: {e["input"]}: {e["reason"]}{count}{at}')
  lines.append(f'  full report: {os.path.join(data_dir, "report.json")}')
  return '\n'.join(lines)


# ------------------------------------------------------------------ stage 1: tokenizer


def _tokenizer(out: str, corpus: corpus_lib.Corpus,
               config: ml_collections.ConfigDict) -> tuple[tok_lib.Tokenizer, dict]:
  """The tokenizer in out/tokenizer.model: copied, kept from an earlier run, or trained."""
  model_path = os.path.join(out, 'tokenizer.model')
  info_path = os.path.join(out, 'tokenizer.json')
  if os.path.exists(model_path):
    with open(info_path) as f:
      return tok_lib.Tokenizer(model_path), json.load(f)
  tok, data = config.tokenizer, config.data
  tmp_path = os.path.join(out, 'tokenizer-tmp.model')
  if tok.model_file:
    shutil.copyfile(os.path.expanduser(tok.model_file), tmp_path)
    info = {'trained': False, 'model_file': tok.model_file}
  else:
    logging.info('Training a %s tokenizer (vocab %d)', tok.model_type, tok.vocab_size)
    tally = corpus_lib.Tally()
    tally.add(corpus.tally.to_json())
    lines, info = tok_lib.sample_lines(_train_lines(corpus, data, tally), tok.max_sentences,
                                       seed=data.split_seed)
    if not lines:
      _raise_no_text(corpus, tally)
    tokenizer = tok_lib.train_tokenizer(
        lines, tmp_path, vocab_size=tok.vocab_size, model_type=tok.model_type,
        character_coverage=tok.character_coverage, max_sentences=tok.max_sentences,
        seed=data.split_seed)
    del lines
    if tokenizer.vocab_size < tok.vocab_size:
      logging.warning('The corpus supports only %d tokenizer pieces, not the %d asked for '
                      '(config.tokenizer.vocab_size).', tokenizer.vocab_size, tok.vocab_size)
    info = {'trained': True, **info}
  with open(info_path, 'w') as f:
    json.dump(info, f, indent=2)
  os.rename(tmp_path, model_path)  # Its presence marks the stage done.
  return tok_lib.Tokenizer(model_path), info


def _train_lines(corpus: corpus_lib.Corpus, data: ml_collections.ConfigDict,
                 tally: corpus_lib.Tally) -> Iterator[str]:
  """The stripped non-empty lines of the training documents, in corpus order."""
  is_val = False
  for unit in tqdm.tqdm(corpus.units, desc='tokenizer lines', unit='unit', mininterval=2):
    for first, piece in corpus.pieces(unit, tally):
      piece = tok_lib.sanitize(piece)
      if first:
        is_val = _is_validation(piece, data.val_fraction, data.split_seed)
      if not is_val:
        for line in piece.splitlines():
          if line := line.strip():
            yield line


def _raise_no_text(corpus: corpus_lib.Corpus, tally: corpus_lib.Tally):
  skipped = tally.skipped
  listed = '; '.join(f'{e["input"]}: {e["reason"]}' for e in skipped[:5])
  more = f' and {len(skipped) - 5} more' if len(skipped) > 5 else ''
  raise corpus_lib.CorpusError(
      f'{corpus.name} has no usable text: no training document'
      + (f' ({len(skipped)} inputs skipped: {listed}{more})' if skipped else '')
      + '. Check config.data.corpus / config.data.tfds_name.')


def _is_validation(text: str, fraction: float, seed: int) -> bool:
  """A stable, content-keyed coin flip per document (keyed by its first piece)."""
  h = zlib.crc32(text.encode('utf-8', 'replace'), zlib.crc32(str(seed).encode()))
  return h / 2**32 < fraction


def _ensure_splits(stats: dict, corpus: corpus_lib.Corpus, tally: corpus_lib.Tally) -> None:
  if stats['train']['rows'] == 0:
    _raise_no_text(corpus, tally)
  if stats['validation']['rows'] == 0:
    raise corpus_lib.CorpusError(
        f'{corpus.name}: no document fell into the validation split '
        f'(config.data.val_fraction, {stats["train"]["documents"]} documents). Raise '
        "val_fraction, or add documents (document_split='blank_line' makes one per paragraph).")


# ------------------------------------------------------------------ workers

# Per worker process: what _init_worker was given, and the loaded tokenizer.
_WORKER: dict = {}


def _init_worker(reader: corpus_lib.Corpus, model_path: str, val_fraction: float,
                 split_seed: int, seq_len: int, all_threads: bool) -> None:
  _WORKER.update(reader=reader, tokenizer=tok_lib.Tokenizer(model_path),
                 val=(val_fraction, split_seed), seq_len=seq_len,
                 threads=0 if all_threads else 1)


class _Pool:
  """`workers` spawned processes (or this one, for 1) that run tasks with a progress bar."""

  def __init__(self, workers: int, init_args: tuple):
    self._workers, self._init_args, self._executor = workers, init_args, None

  def __enter__(self) -> _Pool:
    if self._workers == 1:
      _init_worker(*self._init_args)
    else:
      # Spawned, not forked: the caller may have started JAX's threads.
      self._executor = concurrent.futures.ProcessPoolExecutor(
          self._workers, mp_context=multiprocessing.get_context('spawn'),
          initializer=_init_worker, initargs=self._init_args)
    return self

  def __exit__(self, *exc) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)

  def run(self, fn: Callable, tasks: Sequence[tuple], desc: str, total: int) -> None:
    bar = tqdm.tqdm(total=total, initial=total - len(tasks), desc=desc, unit='task',
                    mininterval=2)
    with bar:
      if self._executor is None:
        for task in tasks:
          fn(*task)
          bar.update()
        return
      futures = [self._executor.submit(fn, *task) for task in tasks]
      for future in concurrent.futures.as_completed(futures):
        future.result()  # Re-raises a worker's exception here.
        bar.update()


def _remove_temporaries(directory: str) -> None:
  """Leftovers of interrupted writers (our own names only)."""
  for name in os.listdir(directory):
    if '.tmp-' in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _tokenize_unit(index: int, unit: corpus_lib.Unit, units_dir: str) -> None:
  """Writes units_dir/NNNNNN/: ids.bin (int32 ids of all documents), docs.npz, tally.json."""
  reader, tokenizer = _WORKER['reader'], _WORKER['tokenizer']
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
      for doc, ids in zip(owners, tokenizer.encode(texts, num_threads=_WORKER['threads'])):
        lengths[doc] += len(ids)
        f.write(np.asarray(ids, np.int32).tobytes())
      texts.clear()
      owners.clear()

    chars = 0
    for first, piece in reader.pieces(unit, tally):
      piece = tok_lib.sanitize(piece)
      if first:
        lengths.append(0)
        is_val.append(_is_validation(piece, *_WORKER['val']))
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


# ------------------------------------------------------------------ stage 3: rows


def _split_stats(stream: list[tuple[str, int, int, int]], seq_len: int) -> dict:
  """Documents, tokens, rows and padding of a split, from its units' stream lengths."""
  content = seq_len - 2
  length = sum(n for _, n, _, _ in stream)  # Every document + its [SEP].
  # The final [SEP] is dropped unless it fills the last row; a rest is padded.
  rest = length % content
  rows = length // content + (rest > 1)
  padding = content - (rest - 1) if rest > 1 else 0
  total = rows * seq_len
  return {'documents': sum(d for *_, d, _ in stream), 'tokens': sum(t for *_, t in stream),
          'rows': rows, 'padding_fraction': padding / total if total else 0.0}


def _unit_stream(unit_dir: str, validation: bool, lo: int, hi: int) -> np.ndarray:
  """[hi - lo] int32: positions [lo, hi) of the unit's `doc [SEP] doc [SEP] ...` for a split."""
  docs = np.load(os.path.join(unit_dir, 'docs.npz'))
  lengths = docs['lengths']
  starts = np.cumsum(lengths) - lengths  # In ids.bin.
  sel = np.flatnonzero(docs['is_val'] == validation)
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
  out[seps] = tok_lib.SEP_ID
  return out[lo - base:hi - base]


def _write_shard(split: str, k: int, num_shards: int, r0: int, r1: int,
                 stream: list[tuple[str, int, int, int]], rows_dir: str, tmp_dir: str,
                 counts_dir: str) -> None:
  """Writes rows [r0, r1) of a split as shard k (and, for train, its token counts)."""
  seq_len = _WORKER['seq_len']
  content = seq_len - 2
  length = sum(n for _, n, _, _ in stream)
  a, b = r0 * content, min(r1 * content, length)
  parts, offset = [], 0
  for unit_dir, n, _, _ in stream:
    lo, hi = max(a, offset) - offset, min(b, offset + n) - offset
    if lo < hi:
      parts.append(_unit_stream(unit_dir, split == 'validation', lo, hi))
    offset += n
  flat = np.full((r1 - r0) * content, tok_lib.PAD_ID, np.int32)
  flat[:b - a] = np.concatenate(parts)
  if length % content and a <= length - 1 < b:
    flat[length - 1 - a] = tok_lib.PAD_ID  # The last document's [SEP] is the row's own.
  body = flat.reshape(-1, content)
  rows = np.concatenate([np.full((len(body), 1), tok_lib.CLS_ID, np.int32), body,
                         np.full((len(body), 1), tok_lib.SEP_ID, np.int32)], axis=1)
  if split == 'train':
    counts = np.bincount(body.ravel(), minlength=_WORKER['tokenizer'].vocab_size)
    counts[[tok_lib.PAD_ID, tok_lib.SEP_ID]] = 0  # Documents never hold either.
    tmp = os.path.join(tmp_dir, f'counts-{k:05d}.npy')
    np.save(tmp, counts.astype(np.int64))
    os.replace(tmp, os.path.join(counts_dir, f'train-{k:05d}.npy'))
  features = _features(seq_len)
  tmp = os.path.join(tmp_dir, f'{split}-{k:05d}-{os.getpid()}')
  file_adapters.ArrayRecordFileAdapter.write_examples(
      tmp, ((i, features.serialize_example({'input_ids': row})) for i, row in enumerate(rows)))
  os.replace(tmp, _shard_path(rows_dir, split, k, num_shards))  # Complete, or absent.


def _features(seq_len: int) -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict({
      'input_ids': tfds.features.Tensor(shape=(seq_len,), dtype=np.int32)})


def _template(rows_dir: str, split: str) -> tfds.core.ShardedFileTemplate:
  return tfds.core.ShardedFileTemplate(
      data_dir=rows_dir, template=_FILENAME_TEMPLATE, dataset_name=_ROWS_NAME, split=split,
      filetype_suffix='array_record')


def _shard_path(rows_dir: str, split: str, k: int, num_shards: int) -> str:
  return os.fspath(_template(rows_dir, split).sharded_filepath(shard_index=k,
                                                               num_shards=num_shards))
