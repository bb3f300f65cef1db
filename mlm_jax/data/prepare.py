"""Prepare: text -> tokenizer -> packed [CLS] ... [SEP] rows + unigram counts.

Runs once per (corpus, tokenizer, T): the result is a tfds dataset in
array_record format under the data dir, with the tokenizer, the token counts
and a report beside it:

  DATA_DIR/fingerprint.json    what the data was made from (checked on reuse)
  DATA_DIR/tokenizer.model     a sentencepiece tokenizer, or
  DATA_DIR/tokenizer/          a Hugging Face one (tokenizer.json, tokenizer_config.json, ...)
  DATA_DIR/added_tokens.json   with config.tokenizer.add_tokens: each added id's pieces before
  DATA_DIR/unigram_counts.npy  [vocab] int64 token counts of the train split
  DATA_DIR/stats.json          documents, tokens, rows, padding per split (train: [UNK] rate)
  DATA_DIR/report.json         stats + inputs skipped or repaired, tokenizer sample, work
  DATA_DIR/tfds/mlm_rows/1.0.0 the rows: {'input_ids': int32[T]}
  DATA_DIR/rows/               the same rows as .npy arrays, one per shard (read
                               by the input pipeline; see data/packed_rows.py)

A mixture (config.data.sources) is prepared as one corpus whose units each
belong to one source; each source's rows are stored as its own splits
(train_K, validation_K), read by the input pipeline's mixture draw.

Packing follows RoBERTa's FULL-SENTENCES: documents are concatenated with
[SEP] between them and cut into rows of exactly T ids, so only the last row of
each split has padding. Documents, not rows, are assigned to the validation
split, so no held-out text is seen in training.

Three stages, in DATA_DIR.partial, renamed to DATA_DIR when all are done,
each spread over `config.data.num_workers` processes by units of the corpus
(a group of files, a byte range of a big file, a range of tfds records, of
parquet row groups or of Arrow record batches; data/sources.py):
  1. tokenizer: the given one (config.tokenizer.model_file, with
     config.tokenizer.add_tokens added), or one trained: one pass over the
     training documents, each unit sampling its lines by random keys; the at
     most config.tokenizer.max_sentences lines with the smallest keys over
     all units train a tokenizer of config.tokenizer.kind (lines too long for
     sentencepiece are cut into pieces first). Its training keeps about one
     core busy; meanwhile the other workers read stage 2's units ahead.
  2. tokenize: each unit becomes units/NNNNNN/ (ids of its documents and
     their lengths and splits).
  3. pack and write, in the same processes: row r of a split is the slice
     [r(T-2), (r+1)(T-2)) of that split's stream `doc [SEP] doc [SEP] ...`, so
     each array_record shard is computed from the unit files alone.
Every unit and shard is written under a temporary name and renamed when
complete, so an interrupted prepare keeps its finished work and a rerun
continues from it. The rows depend only on the config: not on the number of
workers, the grouping into units, or interruptions.

With `beam_options`, the stages' tasks run as Apache Beam pipelines instead of
in local processes (data/beam_runner.py): the same tasks and the same data
dir, spread over a Beam runner's workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from mlm_jax.config_check import ConfigError
from mlm_jax.config_check import require
from mlm_jax.data import corpus as corpus_lib
from mlm_jax.data import hf_tokenizer
from mlm_jax.data import line_sample
from mlm_jax.data import mixture
from mlm_jax.data import packed_rows
from mlm_jax.data import packing
from mlm_jax.data import paths
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.runtime import cores

FORMAT_VERSION = 1
# Raw ids per array_record shard (rows = this / (4 T)).
SHARD_BYTES = 64 << 20
_SPLITS = ('train', 'validation')
# Units read ahead while the tokenizer trains (_units_to_read).
_READ_AHEAD_UNITS = 128
# Where a data dir keeps its tokenizer: a sentencepiece model, or a Hugging
# Face tokenizer's directory (tokenizer.load reads either from the data dir).
_SP_TOKENIZER, _HF_TOKENIZER = sp_tokenizer.FILE_NAME, 'tokenizer'
# What stage 1 sampled, kept until the report holds it. Named tokenizer.json
# by earlier versions, which an unfinished prepare of theirs may still hold.
_SAMPLE_INFO, _OLD_SAMPLE_INFO = 'tokenizer_sample.json', 'tokenizer.json'
# {"spelled": {new id: [the ids that spelled the word before]}, "base_vocab_size": n}.
ADDED_TOKENS = 'added_tokens.json'
# A train split with more [UNK] than this is reported with a warning.
MAX_UNKNOWN_RATE = 0.01


class DataDirError(ValueError):
  """The data dir holds something other than what this config would make."""


@dataclasses.dataclass(frozen=True)
class PreparedData:
  data_dir: str
  tokenizer: tok_lib.Tokenizer
  unigram_counts: np.ndarray  # [vocab] int64
  stats: dict
  # The names of a mixture's sources (config.data.sources), in order; () for one corpus.
  part_names: tuple[str, ...] = ()

  @property
  def rows_dir(self) -> str:
    return _rows_dir(self.data_dir)

  @property
  def report(self) -> dict:
    """report.json: stats, skipped and repaired inputs, tokenizer sample, work done."""
    with open(os.path.join(self.data_dir, 'report.json')) as f:
      return json.load(f)

  def most_frequent_token(self) -> int:
    """The train split's most frequent normal token id (none of the tokenizer's special ids)."""
    counts = self.unigram_counts.astype(np.float64).copy()
    special = self.tokenizer.special_ids()
    counts[special[special < len(counts)]] = 0
    return int(np.argmax(counts))

  def unknown_rate(self) -> float:
    """The fraction of the train split's tokens that are the tokenizer's unknown token."""
    return _unknown_rate(self.unigram_counts, self.tokenizer, warn=False)

  def added_tokens(self) -> dict[int, list[int]]:
    """{added id: the ids that spelled its word before} (config.tokenizer.add_tokens), else {}.

    The model side starts each added id's embedding from its pieces' rows.
    """
    path = os.path.join(self.data_dir, ADDED_TOKENS)
    if not os.path.exists(path):
      return {}
    with open(path) as f:
      spelled = json.load(f)['spelled']
    return {int(i): [int(p) for p in pieces] for i, pieces in spelled.items()}

  @property
  def num_parts(self) -> int:
    """The members of a mixture (config.data.sources) the data holds; 1 for one corpus."""
    return len(self.stats.get('parts', ())) or 1

  def source(self, split: str, part: int | None = None) -> packed_rows.DenseRows:
    """A split's rows, {'input_ids': int32[T]} by index (`read` for many): its .npy shards.

    Of a mixture: member `part`'s, or (None) all members' one after another.
    """
    names = split_names(split, self.num_parts) if part is None else [
        split_name(split, part, self.num_parts)]
    return packed_rows.DenseRows(
        [p for name in names for p in packed_rows.split_paths(self.data_dir, name)])


def split_name(split: str, part: int, num_parts: int) -> str:
  """The stored split of member `part` of a mixture ('train_0', ...); of one corpus, `split`."""
  return split if num_parts == 1 else f'{split}_{part}'


def split_names(split: str, num_parts: int) -> list[str]:
  return [split_name(split, p, num_parts) for p in range(num_parts)]


def _rows_dir(data_dir: str) -> str:
  return os.path.join(data_dir, 'tfds', packing.ROWS_NAME, packing.ROWS_VERSION)


def fingerprint(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict,
                corpus: corpus_lib.Corpus | None = None) -> dict:
  """Everything the prepared data depends on (not num_workers: the rows do not)."""
  tokenizer = tokenizer_fingerprint(tok)
  corpus = corpus or corpus_lib.resolve(data)
  return {
      'format': FORMAT_VERSION,
      'corpus': corpus.description,
      'document_split': corpus.split_rule,
      'seq_len': data.seq_len,
      'val_fraction': data.val_fraction,
      'split_seed': data.split_seed,
      'tokenizer': tokenizer,
  }


def tokenizer_fingerprint(tok: ml_collections.ConfigDict) -> dict:
  """What the data dir's tokenizer is made from: a given tokenizer's content (and the words
  added to it), or the settings a trained one comes from.

  The default sentencepiece tokenizer's entries are those of earlier versions,
  so that their data dirs (and the cache keys naming them) stay valid. A given
  tokenizer that cannot take config.tokenizer.add_tokens is a ConfigError.
  """
  if tok.model_file:
    given = _given_tokenizer(tok)
    if isinstance(given, sp_tokenizer.SentencePieceTokenizer):
      out = {'model_file_sha256': given.digest()}  # The .model file's sha256, as before.
    else:
      out = {'tokenizer_sha256': given.digest()}
    if tok.add_tokens:
      out['add_tokens_sha256'] = _file_digest(os.path.expanduser(tok.add_tokens))
    return out
  if tok.kind == 'sentencepiece':
    return {'vocab_size': tok.vocab_size, 'model_type': tok.model_type,
            'character_coverage': tok.character_coverage, 'max_sentences': tok.max_sentences}
  return {'kind': tok.kind, 'vocab_size': tok.vocab_size, 'lowercase': tok.lowercase,
          'max_sentences': tok.max_sentences}


def _given_tokenizer(tok: ml_collections.ConfigDict) -> tok_lib.Tokenizer:
  """config.tokenizer.model_file, loaded; ConfigError if it cannot be, or cannot take the words
  of config.tokenizer.add_tokens."""
  try:
    given = tok_lib.load(tok.model_file)
  except ValueError as e:
    raise ConfigError(f'config.tokenizer.model_file={tok.model_file!r}: {e}') from e
  require(not tok.add_tokens or isinstance(given, hf_tokenizer.HFTokenizer),
          f'config.tokenizer.add_tokens={tok.add_tokens!r}: the {given.kind} tokenizer '
          f'{tok.model_file} cannot take added tokens (only a Hugging Face tokenizer.json or '
          'vocab.txt can); leave add_tokens empty.')
  return given


def _file_digest(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def default_data_dir(fp: dict) -> str:
  root = os.environ.get('MLM_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'mlm_jax'))
  digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  name = {'python-stdlib-docstrings': 'stdlib', 'tfds': 'tfds', None: 'mixture'}.get(
      fp['corpus'].get('source'), 'corpus')
  return os.path.join(root, 'data', f'{name}-T{fp["seq_len"]}-{digest}')


def resolve_data_dir(config: ml_collections.ConfigDict,
                     corpus: corpus_lib.Corpus | None = None) -> tuple[str, dict]:
  fp = fingerprint(config.data, config.tokenizer, corpus)
  data_dir = config.data.data_dir or default_data_dir(fp)
  return paths.absolute(data_dir), fp


def _stored_tokenizer(directory: str) -> str | None:
  """The tokenizer stage 1 left in `directory` (tokenizer.model or tokenizer/), or None."""
  for name in (_SP_TOKENIZER, _HF_TOKENIZER):
    path = os.path.join(directory, name)
    if os.path.exists(path):
      return path
  return None


def _tokenizer_path(directory: str, tok: ml_collections.ConfigDict) -> str:
  """Where stage 1 puts the tokenizer of config.tokenizer `tok` in `directory`."""
  if tok.model_file:
    sentencepiece = isinstance(_given_tokenizer(tok), sp_tokenizer.SentencePieceTokenizer)
  else:
    sentencepiece = tok.kind == 'sentencepiece'
  return os.path.join(directory, _SP_TOKENIZER if sentencepiece else _HF_TOKENIZER)


def load(data_dir: str) -> PreparedData:
  with open(os.path.join(data_dir, 'stats.json')) as f:
    stats = json.load(f)
  stored = _stored_tokenizer(data_dir)
  if stored is None:
    raise DataDirError(f'{data_dir} holds no tokenizer (tokenizer.model or tokenizer/): delete '
                       'it and prepare again.')
  parts = len(stats.get('parts', ())) or 1
  if not all(packed_rows.split_paths(data_dir, name) for s in _SPLITS
             for name in split_names(s, parts)):
    raise DataDirError(f'{data_dir} was prepared by an earlier version of mlm_jax (no .npy shards '
                       f'of its rows in {packed_rows.DENSE_DIR}/): delete it and prepare it again '
                       'with `python -m mlm_jax.prepare --config=FILE` (the same config).')
  return PreparedData(
      data_dir=data_dir,
      tokenizer=tok_lib.load(stored),
      unigram_counts=np.load(os.path.join(data_dir, 'unigram_counts.npy')),
      stats=stats)


def is_prepared(data_dir: str, fp: dict) -> bool:
  """True if data_dir holds data made from `fp`; raises if it holds other data."""
  fp_path = paths.join(data_dir, 'fingerprint.json')
  if paths.exists(fp_path):
    found = json.loads(paths.read_text(fp_path))
    if found == json.loads(json.dumps(fp)):
      return True
    diff = sorted(k for k in set(fp) | set(found) if fp.get(k) != found.get(k))
    raise DataDirError(
        f'{data_dir} holds data prepared from other settings (differs in: '
        f'{", ".join(diff)}). Set config.data.data_dir to a new directory, '
        'or leave it empty to use a cache directory keyed by the settings.')
  if paths.isdir(data_dir) and paths.walk_files(data_dir):
    raise DataDirError(
        f'{data_dir} is not empty and is not an mlm_jax data dir '
        '(no fingerprint.json). Set config.data.data_dir to a new or empty directory.')
  return False


def prepare(config: ml_collections.ConfigDict,
            beam_options: list[str] | None = None) -> PreparedData:
  """Loads the prepared data for `config`, preparing it first (or finishing it) if needed.

  `beam_options`: run the stages on Apache Beam with these pipeline options
  (e.g. ['--runner=DirectRunner', '--direct_num_workers=2']); None: local
  worker processes.
  """
  if beam_options is not None:
    _import_beam_runner().check_options(beam_options)  # Before anything is read or written.
  corpus = corpus_lib.resolve(config.data)
  data_dir, fp = resolve_data_dir(config, corpus)
  names = tuple(m.name for m in mixture.members(config.data))
  if paths.is_url(data_dir):
    return dataclasses.replace(_prepare_remote(data_dir, fp, config, beam_options),
                               part_names=names)
  if is_prepared(data_dir, fp):
    return dataclasses.replace(load(data_dir), part_names=names)
  partial = data_dir + '.partial'
  _open_partial(partial, fp)
  try:
    report = _prepare_into(partial, corpus, config, beam_options)
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
  print(format_report(report, data_dir, names), flush=True)
  return dataclasses.replace(load(data_dir), part_names=names)


def _prepare_remote(url: str, fp: dict, config: ml_collections.ConfigDict,
                    beam_options: list[str] | None) -> PreparedData:
  """A data dir at a bucket URL, through a local copy (training memory-maps its rows).

  Prepared there already: copied into the cache once, then read from the
  copy. Not yet: prepared into the cache as a local data dir would be, then
  copied up, fingerprint.json last, so that the URL never looks finished
  before it is.
  """
  root = os.environ.get('MLM_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'mlm_jax'))
  local = os.path.join(root, 'remote', hashlib.sha256(url.encode()).hexdigest()[:16])
  local_config = config.copy_and_resolve_references()
  local_config.data.data_dir = local
  if is_prepared(url, fp):
    if not _holds(local, fp):
      shutil.rmtree(local, ignore_errors=True)  # A copy of other data, or an unfinished one.
      logging.info('Copying the data dir %s into %s', url, local)
      paths.copy_tree(url, f'{local}.copy-{os.getpid()}', last=['fingerprint.json'])
      os.replace(f'{local}.copy-{os.getpid()}', local)
    return load(local)
  if os.path.isdir(local) and not _holds(local, fp):
    shutil.rmtree(local)  # A copy of data the URL no longer holds.
  data = prepare(local_config, beam_options)
  logging.info('Copying the data dir %s up to %s', local, url)
  paths.copy_tree(local, url, last=['fingerprint.json'])
  return data


def _holds(data_dir: str, fp: dict) -> bool:
  """Whether `data_dir` holds data made from `fp` (False for anything else there)."""
  try:
    return is_prepared(data_dir, fp)
  except DataDirError:
    return False


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


def _import_beam_runner():
  try:
    from mlm_jax.data import beam_runner  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"Preparing with Apache Beam needs it installed: pip install -e '.[beam]' "
                      f'({e})') from e
  return beam_runner


def _prepare_into(out: str, corpus: corpus_lib.Corpus, config: ml_collections.ConfigDict,
                  beam_options: list[str] | None = None) -> dict:
  """The three stages in `out` (DATA_DIR.partial); returns the report. Resumable."""
  data = config.data
  start = time.perf_counter()
  # Each worker is one process with one thread for sentencepiece, except that
  # a corpus of one unit is tokenized here, with the threads the other
  # workers would have had: spawning would cost more than it saves.
  requested = data.num_workers or cores.usable_cores()
  workers = min(requested, max(1, len(corpus.units)))
  # The workers load the tokenizer from there once stage 1 has put it there.
  init_args = (dataclasses.replace(corpus, units=[], tally=corpus_lib.Tally()),
               _tokenizer_path(out, config.tokenizer), data.val_fraction, data.split_seed,
               data.seq_len, workers == 1 and requested > 1 and beam_options is None)
  if beam_options is None:
    pool = packing.Pool(workers, init_args)
  else:
    pool = _import_beam_runner().BeamPool(beam_options, init_args, os.path.join(out, 'beam'))
  with pool:
    tokenizer, tokenizer_report = _tokenizer(out, corpus, config, pool)        # 1.
    seconds = {'tokenizer': time.perf_counter() - start}
    units_todo = _tokenize_units(out, corpus, pool, workers)                   # 2.
    seconds['tokenize'] = time.perf_counter() - start - sum(seconds.values())
    tally, streams, stats = _read_units(out, corpus, data.seq_len)
    shard_lengths, shards_todo = _write_rows(out, pool, streams, data.seq_len)  # 3.
  counts = _finish_rows(out, shard_lengths, tokenizer, data.seq_len)
  seconds['write'] = time.perf_counter() - start - sum(seconds.values())
  stats['train']['unknown_rate'] = _unknown_rate(counts, tokenizer)
  num_shards = sum(len(v) for v in shard_lengths.values())
  report = {
      'corpus': corpus.name,
      'splits': stats,
      'inputs': tally.to_json(),
      'tokenizer': tokenizer_report,
      'work': {'workers': workers if beam_options is None else None,
               'beam_options': beam_options, 'units': len(corpus.units),
               'units_reused': len(corpus.units) - units_todo, 'shards': num_shards,
               'shards_reused': num_shards - shards_todo,
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


def _units_to_read(out: str, corpus: corpus_lib.Corpus) -> list[tuple]:
  """packing.read_unit's tasks: the first units stage 2 has neither tokenized nor read.

  At most _READ_AHEAD_UNITS of them (about 2 GB of text in 16 MB units): a
  long tokenizer training on a big corpus must not copy it all to disk.
  """
  units_dir = os.path.join(out, 'units')
  os.makedirs(units_dir, exist_ok=True)
  return [(i, u, units_dir) for i, u in enumerate(corpus.units)
          if not corpus.sources[u.source].pretokenized
          and not os.path.isdir(os.path.join(units_dir, f'{i:06d}'))
          and not os.path.exists(packing.split_path(units_dir, i))][:_READ_AHEAD_UNITS]


def _tokenize_units(out: str, corpus: corpus_lib.Corpus, pool: packing.Pool,
                    workers: int) -> int:
  """Stage 2: out/units/NNNNNN/ for every unit not done yet; returns how many were to do."""
  units_dir = os.path.join(out, 'units')
  os.makedirs(units_dir, exist_ok=True)
  packing.remove_temporaries(units_dir)
  todo = [(i, u) for i, u in enumerate(corpus.units)
          if not os.path.isdir(os.path.join(units_dir, f'{i:06d}'))]
  ids = all(s.pretokenized for s in corpus.sources)  # Nothing to tokenize.
  logging.info('%s %d of %d units of %s with %d workers',
               'Reading the token ids of' if ids else 'Tokenizing', len(todo), len(corpus.units),
               corpus.name, workers)
  pool.run(packing.tokenize_unit, [(i, u, units_dir) for i, u in todo],
           'read ids' if ids else 'tokenize', len(corpus.units))
  return len(todo)


def _read_units(out: str, corpus: corpus_lib.Corpus,
                seq_len: int) -> tuple[corpus_lib.Tally, dict, dict]:
  """(tally of all inputs, per stored split the units' streams, per split stats).

  A mixture's stats hold the totals of its members under 'train' and
  'validation', and each member's under 'parts'.
  """
  tally = corpus_lib.Tally()
  tally.add(corpus.tally.to_json())
  parts = corpus.num_parts
  # Per stored split, per unit: (dir, stream length, documents, tokens).
  streams = {name: [] for s in _SPLITS for name in split_names(s, parts)}
  for i, unit in enumerate(corpus.units):
    unit_dir = os.path.join(out, 'units', f'{i:06d}')
    with open(os.path.join(unit_dir, 'tally.json')) as f:
      tally.add(json.load(f))
    docs = np.load(os.path.join(unit_dir, 'docs.npz'))
    for s in _SPLITS:
      lengths = docs['lengths'][docs['is_val'] == (s == 'validation')]
      streams[split_name(s, corpus.part(unit), parts)].append(
          (unit_dir, int(lengths.sum() + len(lengths)), len(lengths), int(lengths.sum())))
  stats = {name: packing.split_stats(stream, seq_len) for name, stream in streams.items()}
  if parts > 1:
    members = [{s: stats[split_name(s, p, parts)] for s in _SPLITS} for p in range(parts)]
    stats = {s: _total([m[s] for m in members], seq_len) for s in _SPLITS} | {'parts': members}
  for p, member in enumerate(stats.get('parts', [stats])):
    _ensure_splits(member, corpus, tally, p)
  return tally, streams, stats


def _total(stats: list[dict], seq_len: int) -> dict:
  """The stats of several members' splits taken together."""
  rows = sum(st['rows'] for st in stats)
  padding = sum(st['padding_fraction'] * st['rows'] * seq_len for st in stats)
  return {'documents': sum(st['documents'] for st in stats),
          'tokens': sum(st['tokens'] for st in stats), 'rows': rows,
          'padding_fraction': padding / (rows * seq_len) if rows else 0.0}


def _write_rows(out: str, pool: packing.Pool, streams: dict,
                seq_len: int) -> tuple[dict[str, list[int]], int]:
  """Stage 3: every array_record shard not written yet; (rows per shard by split, to do)."""
  rows_dir, dense_dir = _rows_dir(out), os.path.join(out, packed_rows.DENSE_DIR)
  tmp_dir = os.path.join(out, 'tmp')
  counts_dir = os.path.join(out, 'counts')
  for d in (rows_dir, dense_dir, counts_dir):
    os.makedirs(d, exist_ok=True)
  shutil.rmtree(tmp_dir, ignore_errors=True)
  os.makedirs(tmp_dir)
  rows_per_shard = max(1, SHARD_BYTES // (4 * seq_len))
  tasks, shard_lengths = [], {}
  for s, stream in streams.items():
    rows = packing.split_stats(stream, seq_len)['rows']
    n = -(-rows // rows_per_shard)
    shard_lengths[s] = [min(rows_per_shard, rows - k * rows_per_shard) for k in range(n)]
    for k in range(n):
      if not (os.path.exists(packing.shard_path(rows_dir, s, k, n))
              and os.path.exists(packed_rows.dense_path(dense_dir, s, k, n))):
        tasks.append((s, k, n, k * rows_per_shard, k * rows_per_shard + shard_lengths[s][k],
                      stream, rows_dir, dense_dir, tmp_dir, counts_dir))
  num_shards = sum(len(v) for v in shard_lengths.values())
  logging.info('Writing %d of %d shards of rows', len(tasks), num_shards)
  pool.run(packing.write_shard, tasks, 'write rows', num_shards)
  return shard_lengths, len(tasks)


def _unknown_rate(counts: np.ndarray, tokenizer: tok_lib.Tokenizer, warn: bool = True) -> float:
  """The fraction of [UNK] among the train split's tokens (`counts`); if `warn`, a warning
  above MAX_UNKNOWN_RATE."""
  unk = tokenizer.specials.unk
  rate = float(counts[unk]) / max(int(counts.sum()), 1) if unk < len(counts) else 0.0
  if warn and rate > MAX_UNKNOWN_RATE:
    logging.warning(
        '%.2f%% of the train split\'s tokens are the unknown token %s: the %s tokenizer cannot '
        'spell much of this corpus (a language or script it was not made for?), and what those '
        'tokens stood for is lost to the model. Use a tokenizer made for this text, or one that '
        "cannot meet an unknown character: a byte-level one (config.tokenizer.kind='bpe', or "
        "the default 'sentencepiece', which falls back to bytes).", 100 * rate,
        tokenizer.specials.token('unk'), tokenizer.kind)
  return rate


def _finish_rows(out: str, shard_lengths: dict[str, list[int]], tokenizer: tok_lib.Tokenizer,
                 seq_len: int) -> np.ndarray:
  """The tfds metadata of the rows; returns the train split's token counts [vocab]."""
  rows_dir, counts_dir = _rows_dir(out), os.path.join(out, 'counts')
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  for name, lengths in shard_lengths.items():
    if packing.split_role(name) == 'train':
      for k in range(len(lengths)):
        counts += np.load(os.path.join(counts_dir, f'{name}-{k:05d}.npy'))
  split_infos = [tfds.core.SplitInfo(
      name=s, shard_lengths=shard_lengths[s],
      num_bytes=sum(os.path.getsize(packing.shard_path(rows_dir, s, k, len(shard_lengths[s])))
                    for k in range(len(shard_lengths[s]))),
      filename_template=packing.template(rows_dir, s)) for s in shard_lengths]
  tfds.folder_dataset.write_metadata(
      data_dir=rows_dir, features=packing.features(seq_len), split_infos=split_infos,
      filename_template=packing.FILENAME_TEMPLATE, check_data=False,
      description=f'Packed [CLS] ... [SEP] rows of {tokenizer.kind} ids.')
  for name in ('units', 'counts', 'tmp', 'beam'):
    shutil.rmtree(os.path.join(out, name), ignore_errors=name == 'beam')
  for name in (_SAMPLE_INFO, _OLD_SAMPLE_INFO):  # Kept in the report.
    if os.path.exists(os.path.join(out, name)):
      os.remove(os.path.join(out, name))
  return counts


def format_report(report: dict, data_dir: str, names: tuple[str, ...] = ()) -> str:
  """The report as a few lines for the console (report.json has it all); `names`: a mixture's
  sources."""
  w = report['work']
  stages = ', '.join(f'{k} {v:.1f}s' for k, v in w['stage_seconds'].items())
  where = (f'{w["workers"]} workers' if w.get('beam_options') is None
           else f'Apache Beam {" ".join(w["beam_options"])}')
  lines = [f'Prepared {report["corpus"]} into {data_dir} in {w["seconds"]:.1f}s ({stages}; '
           f'{where}; reused {w["units_reused"]}/{w["units"]} units, '
           f'{w["shards_reused"]}/{w["shards"]} shards)']
  splits = report['splits']
  members = [(f'{names[p]} ' if p < len(names) else f'source {p} ', m)
             for p, m in enumerate(splits.get('parts', ()))]
  for prefix, stats in [('', splits)] + members:
    for s in _SPLITS:
      st = stats[s]
      unknown = f', unknown {st["unknown_rate"]:.4%}' if st.get('unknown_rate') else ''
      lines.append(f'  {prefix}{s}: {st["documents"]:,} documents, {st["tokens"]:,} tokens, '
                   f'{st["rows"]:,} rows, padding {st["padding_fraction"]:.4%}{unknown}')
  t = report['tokenizer']
  # A tokenizer stage finished by an older version (a resumed prepare) has other counts.
  if t.get('trained') and 'sentences_seen' in t:
    lines.extend(f'  tokenizer: {line}' for line in tokenizer_sample_summary(t))
  inputs = report['inputs']
  counts = {k: v for k, v in inputs['counts'].items() if v}
  lines.append(f'  inputs: {json.dumps(counts)}')
  for kind in ('skipped', 'repaired'):
    for e in inputs[kind]:
      count = f' x{e["count"]}' if e.get('count', 1) != 1 else ''
      where = 'rows' if 'rows' in e else 'lines'
      at = (f' ({where} {", ".join(map(str, e[where]))}{"..." if e["count"] > 10 else ""})'
            if e.get(where) else '')
      lines.append(f'  {kind}: {e["input"]}: {e["reason"]}{count}{at}')
  lines.append(f'  full report: {os.path.join(data_dir, "report.json")}')
  return '\n'.join(lines)


# ------------------------------------------------------------------ stage 1: tokenizer


def _tokenizer(out: str, corpus: corpus_lib.Corpus, config: ml_collections.ConfigDict,
               pool: packing.Pool) -> tuple[tok_lib.Tokenizer, dict]:
  """The tokenizer in out/tokenizer.model or out/tokenizer/: given, kept from an earlier run,
  or trained.

  The units' lines are sampled in the pool's workers (packing.sample_unit)
  and merged here, so the sample is the same for any number of workers. The
  tokenizer is written under a temporary name and renamed last: its presence
  marks the stage done.
  """
  stored = _stored_tokenizer(out)
  if stored is not None:
    info_path = os.path.join(out, _SAMPLE_INFO)
    if not os.path.exists(info_path):
      info_path = os.path.join(out, _OLD_SAMPLE_INFO)
    with open(info_path) as f:
      return tok_lib.load(stored), json.load(f)
  tok, data = config.tokenizer, config.data
  tmp_dir = os.path.join(out, 'tokenizer-tmp')
  shutil.rmtree(tmp_dir, ignore_errors=True)
  if tok.model_file:
    tokenizer = _given_tokenizer(tok)
    info = {'trained': False, 'model_file': tok.model_file}
    if tok.add_tokens:
      tokenizer, info['added_tokens'] = _add_tokens(tokenizer, tok.add_tokens, out)
    tokenizer.save(tmp_dir)  # A sentencepiece model: the given file's bytes, as they are.
  else:
    kind = tok.model_type if tok.kind == 'sentencepiece' else tok.kind
    logging.info('Training a %s tokenizer (vocab %d)', kind, tok.vocab_size)
    tally = corpus_lib.Tally()
    tally.add(corpus.tally.to_json())
    documents = [0]

    bound = [2**64]  # Lowered by merge_samples as parts arrive; read as tasks are made.

    def samples() -> Iterator[line_sample.LineSample]:
      tasks = ((i, unit, tok.max_sentences, data.split_seed, bound[0])
               for i, unit in enumerate(corpus.units))
      for sample, unit_documents, unit_tally in pool.results(
          packing.sample_unit, tasks, 'tokenizer lines', len(corpus.units)):
        documents[0] += unit_documents
        tally.add(unit_tally)
        yield sample

    lines, info = line_sample.merge_samples(samples(), tok.max_sentences, bound)
    if not lines:
      _raise_no_text(corpus, tally)
    info['documents'] = documents[0]
    summary = tokenizer_sample_summary(info)
    logging.info('Tokenizer training text: %s', summary[0])
    for left_out in summary[1:]:
      logging.warning('Tokenizer training text: %s', left_out)
    # Tokenizer training keeps about one core busy: the idle workers read
    # stage 2's units meanwhile (packing.read_unit).
    with pool.meanwhile(packing.read_unit, _units_to_read(out, corpus)):
      tokenizer = tok_lib.train(tok.kind, lines, tmp_dir, tok, seed=data.split_seed)
    del lines
    if tokenizer.vocab_size < tok.vocab_size:
      logging.warning('The corpus supports only %d tokenizer pieces, not the %d asked for '
                      '(config.tokenizer.vocab_size).', tokenizer.vocab_size, tok.vocab_size)
    info = {'trained': True, **info}
  with open(os.path.join(out, _SAMPLE_INFO), 'w') as f:
    json.dump(info, f, indent=2)
  stored = _tokenizer_path(out, tok)
  if isinstance(tokenizer, sp_tokenizer.SentencePieceTokenizer):
    os.rename(os.path.join(tmp_dir, _SP_TOKENIZER), stored)
    shutil.rmtree(tmp_dir)
  else:
    os.rename(tmp_dir, stored)
  return tok_lib.load(stored), info


def _add_tokens(tokenizer: tok_lib.Tokenizer, words_file: str, out: str
                ) -> tuple[tok_lib.Tokenizer, int]:
  """`tokenizer` with the words of `words_file` (one a line) added; writes out/added_tokens.json.

  Returns the grown tokenizer and how many ids it gained (words it already
  holds as one token add none).
  """
  with open(os.path.expanduser(words_file), encoding='utf-8') as f:
    words = [line.strip() for line in f if line.strip()]
  base_vocab_size = tokenizer.vocab_size
  grown, spelled = tokenizer.add_tokens(words)
  logging.info('Added %d of the %d words of %s to the tokenizer (%d ids now)', len(spelled),
               len(words), words_file, grown.vocab_size)
  with open(os.path.join(out, ADDED_TOKENS), 'w') as f:
    json.dump({'spelled': {str(i): [int(p) for p in pieces] for i, pieces in spelled.items()},
               'base_vocab_size': base_vocab_size}, f, indent=2)
  return grown, len(spelled)


def tokenizer_sample_summary(info: dict) -> list[str]:
  """What tokenizer training saw (sample_lines' counts): a line, then one per part left out.

  A sentence is one input of sentencepiece's trainer: a line, or a piece of a
  line too long for it.
  """
  pieces = info['sentences_seen'] - info['lines_seen'] + info['lines_split']
  split = (f'; {info["lines_split"]:,} lines over {line_sample.MAX_SENTENCE_BYTES} bytes cut into '
           f'{pieces:,} pieces' if info['lines_split'] else '')
  out = [f'sampled {info["sentences_sampled"]:,} of {info["sentences_seen"]:,} sentences '
         f'({_size(info["bytes_sampled"])} of {_size(info["bytes_seen"])}) from the '
         f'{info["lines_seen"]:,} lines of {info["documents"]:,} training documents{split}']
  if info['capped_sentences']:
    out.append(f'{info["capped_sentences"]:,} sentences ({_size(info["capped_bytes"])}) left out: '
               'the sample is capped at config.tokenizer.max_sentences')
  if info['reserved_sentences']:
    out.append(f'{info["reserved_sentences"]:,} sentences ({_size(info["reserved_bytes"])}) left '
               "out: they hold U+2047, which sentencepiece reserves and skips")
  return out


def _size(num_bytes: int) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:,.1f} {unit}'
  return f'{num_bytes} bytes'


def _raise_no_text(corpus: corpus_lib.Corpus, tally: corpus_lib.Tally):
  skipped = tally.skipped
  listed = '; '.join(f'{e["input"]}: {e["reason"]}' for e in skipped[:5])
  more = f' and {len(skipped) - 5} more' if len(skipped) > 5 else ''
  raise corpus_lib.CorpusError(
      f'{corpus.name} has no usable text: no training document'
      + (f' ({len(skipped)} inputs skipped: {listed}{more})' if skipped else '')
      + '. Check config.data.corpus / config.data.tfds_name.')


def _ensure_splits(stats: dict, corpus: corpus_lib.Corpus, tally: corpus_lib.Tally,
                   part: int = 0) -> None:
  """CorpusError unless the corpus (member `part` of a mixture) has rows in both splits."""
  member = f'config.data.sources[{part}]: ' if corpus.num_parts > 1 else ''
  if stats['train']['rows'] == 0:
    if member:
      raise corpus_lib.CorpusError(f'{member}no usable text: no training document. Check its '
                                   'corpus (the report of skipped inputs: rerun with it alone).')
    _raise_no_text(corpus, tally)
  if stats['validation']['rows'] == 0:
    raise corpus_lib.CorpusError(
        f'{member or corpus.name + ": "}no document fell into the validation split '
        f'(config.data.val_fraction, {stats["train"]["documents"]} documents). Raise '
        "val_fraction, or add documents (document_split='blank_line' makes one per paragraph).")


# The shortest row: [CLS], two tokens, [SEP].
MIN_SEQ_LEN = 4


def check_config(data: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid packing or split setting in config.data."""
  require(data.seq_len >= MIN_SEQ_LEN,
          f'config.data.seq_len={data.seq_len} must be at least {MIN_SEQ_LEN}.')
  require(0.0 < data.val_fraction < 1.0,
          f'config.data.val_fraction={data.val_fraction} must be in (0, 1).')
  require(data.num_workers >= 0,
          f'config.data.num_workers={data.num_workers} must be >= 0 (0: one per core).')
