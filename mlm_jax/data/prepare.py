"""Prepare: text -> tokenizer -> packed [CLS] ... [SEP] rows + unigram counts, on disk.

Runs once per (corpus, tokenizer, T) and only writes: what a finished data
dir holds, how it is found and how training reads it is data/prepared.py's.
A mixture (config.data.sources) is prepared as one corpus whose units each
belong to one source; each source's rows are stored as its own splits
(train_K, validation_K), read by the input pipeline's mixture draw.

Packing follows RoBERTa's FULL-SENTENCES: documents are concatenated with
[SEP] between them and cut into rows of exactly T ids, so only the last row of
each split has padding; or, with config.data.row_layout='document_chunks',
each row holds one chunk of one document, padded (Ettin's rows; packing.py).
Documents, not rows, are assigned to the validation split, so no held-out
text is seen in training.

The stages, in DATA_DIR.partial, renamed to DATA_DIR when all are done, each
spread over `config.data.num_workers` processes by units of the corpus (a
group of files, a byte range of a big file, a range of tfds records, of
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
     [r(T-2), (r+1)(T-2)) of that split's stream `doc [SEP] doc [SEP] ...`
     (or the r-th chunk of its documents), so each .npy shard of rows is
     computed from the unit files alone.
  4. only with config.data.tfds_export: the rows exported as a tfds dataset
     (data/tfds_export.py), each array_record shard from its .npy shard.
  Then the report (data/prepare_report.py), and fingerprint.json last.
Every unit and shard is written under a temporary name and renamed when
complete, so an interrupted prepare keeps its finished work and a rerun
continues from it. The rows depend only on the config: not on the number of
workers, the grouping into units, interruptions, or the export. Asking for
the export of a data dir prepared without it adds it, from the rows there.

With `beam_options`, the stages' tasks run as Apache Beam pipelines instead of
in local processes (data/beam_runner.py): the same tasks and the same data
dir, spread over a Beam runner's workers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from mlm_jax.data import corpus as corpus_lib
from mlm_jax.data import line_sample
from mlm_jax.data import packed_rows
from mlm_jax.data import packing
from mlm_jax.data import paths
from mlm_jax.data import prepare_report
from mlm_jax.data import prepared
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.data.prepared import SPLITS
from mlm_jax.data.prepared import split_name
from mlm_jax.data.prepared import split_names
from mlm_jax.errors import one_of
from mlm_jax.errors import require
from mlm_jax.runtime import cores

# Raw ids per shard of rows (rows = this / (4 T)).
SHARD_BYTES = 64 << 20
# Units read ahead while the tokenizer trains (_units_to_read).
_READ_AHEAD_UNITS = 128
# What stage 1 sampled, kept until the report holds it. Named tokenizer.json
# by earlier versions, which an unfinished prepare of theirs may still hold.
_SAMPLE_INFO, _OLD_SAMPLE_INFO = 'tokenizer_sample.json', 'tokenizer.json'
# A train split with more [UNK] than this is reported with a warning.
MAX_UNKNOWN_RATE = 0.01


def _tokenizer_path(directory: str, tok: ml_collections.ConfigDict) -> str:
  """Where stage 1 puts the tokenizer of config.tokenizer `tok` in `directory`."""
  if tok.model_file:
    sentencepiece = prepared.given_tokenizer(tok).kind == 'sentencepiece'
  else:
    sentencepiece = tok.kind == 'sentencepiece'
  return os.path.join(directory, prepared.SP_TOKENIZER if sentencepiece else prepared.HF_TOKENIZER)


def prepare(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict,
            rows: Mapping[str, Any],
            beam_options: list[str] | None = None) -> prepared.PreparedData:
  """The prepared data of config.data `data` with config.tokenizer `tok`, prepared first (or
  finished, or its tfds export added) if needed; then read as data/prepared.py reads it.

  `rows`: data's rows key (config/fields.py's rows_key), which names the data dir
  (prepared.fingerprint).

  `beam_options`: run the stages on Apache Beam with these pipeline options
  (e.g. ['--runner=DirectRunner', '--direct_num_workers=2']); None: local
  worker processes.
  """
  if beam_options is not None:
    _import_beam_runner().check_options(beam_options)  # Before anything is read or written.
  corpus = corpus_lib.resolve(data)
  data_dir, fp = prepared.resolve_data_dir(data, tok, rows, corpus)
  names = prepared.part_names(data)
  if paths.is_url(data_dir):
    return prepared.load(_prepare_remote(data_dir, fp, data, tok, rows, beam_options), names)
  if prepared.is_prepared(data_dir, fp):
    if data.tfds_export and not prepared.has_tfds_export(data_dir):
      _add_export(data_dir, data, beam_options)
    return prepared.load(data_dir, names)
  partial = data_dir + '.partial'
  _open_partial(partial, fp)
  try:
    report = _prepare_into(partial, corpus, data, tok, beam_options)
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
  print(prepare_report.format_report(report, data_dir, names), flush=True)
  return prepared.load(data_dir, names)


def _prepare_remote(url: str, fp: dict, data: ml_collections.ConfigDict,
                    tok: ml_collections.ConfigDict, rows: Mapping[str, Any],
                    beam_options: list[str] | None) -> str:
  """The local copy of a data dir at a bucket URL (training memory-maps its rows).

  Prepared there already: copied into the cache once (data/prepared.py), and
  a tfds export asked for and missing made in the copy and copied up. Not
  yet: prepared into the cache as a local data dir would be, then copied up,
  fingerprint.json last, so that the URL never looks finished before it is.
  """
  local = prepared.local_copy_dir(url)
  if prepared.is_prepared(url, fp):
    prepared.copy_down(url, fp)
    if data.tfds_export and not prepared.has_tfds_export(local):
      _add_export(local, data, beam_options)
      logging.info('Copying the tfds export up to %s', url)
      paths.copy_tree(prepared.tfds_dir(local),
                      paths.join(url, 'tfds', prepared.TFDS_NAME, prepared.TFDS_VERSION),
                      last=['dataset_info.json'])
    return local
  if os.path.isdir(local) and not prepared.holds(local, fp):
    shutil.rmtree(local)  # A copy of data the URL no longer holds.
  local_data = data.copy_and_resolve_references()
  local_data.data_dir = local
  prepare(local_data, tok, rows, beam_options)
  logging.info('Copying the data dir %s up to %s', local, url)
  paths.copy_tree(local, url, last=[prepared.FINGERPRINT])
  return local


def _add_export(data_dir: str, data: ml_collections.ConfigDict,
                beam_options: list[str] | None) -> None:
  """Stage 4 alone, for a data dir prepared without the tfds export: from its .npy rows."""
  stored = prepared.load(data_dir)
  exporter = _import_tfds_export()
  splits = exporter.stored_splits(stored)
  num_shards = sum(len(packed_rows.split_paths(data_dir, s)) for s in splits)
  # Spawned workers pay off for many shards; a split or two of one shard each
  # (a small corpus) is exported here.
  workers = (min(data.num_workers or cores.usable_cores(), num_shards)
             if num_shards > len(splits) else 1)
  logging.info('Adding the tfds export of its rows to %s', data_dir)
  if beam_options is None:
    pool = packing.Pool(workers, None)
  else:
    pool = _import_beam_runner().BeamPool(beam_options, None,
                                          os.path.join(data_dir, 'tfds-beam'))
  with pool:
    exporter.export(data_dir, pool, splits, stored.tokenizer.kind)
  shutil.rmtree(os.path.join(data_dir, 'tfds-beam'), ignore_errors=True)


def _open_partial(partial: str, fp: dict) -> None:
  """Creates DATA_DIR.partial, or keeps an unfinished one made from the same settings."""
  marker = os.path.join(partial, 'partial.json')
  if os.path.isdir(partial):
    if not os.path.exists(marker):
      raise prepared.DataDirError(
          f'{partial} exists but is not an unfinished mlm_jax prepare (no partial.json); move it '
          'away, or set config.data.data_dir elsewhere.')
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


def _import_tfds_export():
  # Only a prepare that exports pays for importing tensorflow_datasets.
  from mlm_jax.data import tfds_export  # pylint: disable=import-outside-toplevel
  return tfds_export


def _import_beam_runner():
  try:
    from mlm_jax.data import beam_runner  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"Preparing with Apache Beam needs it installed: pip install -e '.[beam]' "
                      f'({e})') from e
  return beam_runner


def _prepare_into(out: str, corpus: corpus_lib.Corpus, data: ml_collections.ConfigDict,
                  tok: ml_collections.ConfigDict,
                  beam_options: list[str] | None = None) -> dict:
  """The stages in `out` (DATA_DIR.partial); returns the report. Resumable."""
  start = time.perf_counter()
  # Each worker is one process with one thread for sentencepiece, except that
  # a corpus of one unit is tokenized here, with the threads the other
  # workers would have had: spawning would cost more than it saves.
  requested = data.num_workers or cores.usable_cores()
  workers = min(requested, max(1, len(corpus.units)))
  layout = packing.RowLayout.from_config(data)
  # The workers load the tokenizer from there once stage 1 has put it there.
  init_args = (dataclasses.replace(corpus, units=[], tally=corpus_lib.Tally()),
               _tokenizer_path(out, tok), data.val_fraction, data.split_seed,
               data.seq_len, workers == 1 and requested > 1 and beam_options is None, layout)
  if beam_options is None:
    pool = packing.Pool(workers, init_args)
  else:
    pool = _import_beam_runner().BeamPool(beam_options, init_args, os.path.join(out, 'beam'))
  with pool:
    tokenizer, tokenizer_report = _tokenizer(out, corpus, data, tok, pool)        # 1.
    seconds = {'tokenizer': time.perf_counter() - start}
    units_todo = _tokenize_units(out, corpus, pool, workers)                   # 2.
    seconds['tokenize'] = time.perf_counter() - start - sum(seconds.values())
    tally, streams, stats = _read_units(out, corpus, data.seq_len, layout)
    shard_lengths, shards_todo = _write_rows(out, pool, streams, data.seq_len, layout)  # 3.
    seconds['write'] = time.perf_counter() - start - sum(seconds.values())
    if data.tfds_export:
      _import_tfds_export().export(out, pool, list(streams), tokenizer.kind)   # 4.
      seconds['tfds export'] = time.perf_counter() - start - sum(seconds.values())
  counts = _finish_rows(out, shard_lengths, tokenizer, data.tfds_export)
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


def _read_units(out: str, corpus: corpus_lib.Corpus, seq_len: int,
                layout: packing.RowLayout) -> tuple[corpus_lib.Tally, dict, dict]:
  """(tally of all inputs, per stored split the units' streams, per split stats).

  A mixture's stats hold the totals of its members under 'train' and
  'validation', and each member's under 'parts'.
  """
  tally = corpus_lib.Tally()
  tally.add(corpus.tally.to_json())
  parts = corpus.num_parts
  # Per stored split, per unit: packing.unit_entry's (dir, size, documents, tokens, kept).
  streams = {name: [] for s in SPLITS for name in split_names(s, parts)}
  for i, unit in enumerate(corpus.units):
    unit_dir = os.path.join(out, 'units', f'{i:06d}')
    with open(os.path.join(unit_dir, 'tally.json')) as f:
      tally.add(json.load(f))
    docs = np.load(os.path.join(unit_dir, 'docs.npz'))
    for s in SPLITS:
      lengths = docs['lengths'][docs['is_val'] == (s == 'validation')]
      streams[split_name(s, corpus.part(unit), parts)].append(
          packing.unit_entry(unit_dir, lengths, seq_len, layout))
  stats = {name: packing.split_stats(stream, seq_len, layout)
           for name, stream in streams.items()}
  if parts > 1:
    members = [{s: stats[split_name(s, p, parts)] for s in SPLITS} for p in range(parts)]
    stats = {s: _total([m[s] for m in members], seq_len) for s in SPLITS} | {'parts': members}
  for p, member in enumerate(stats.get('parts', [stats])):
    _ensure_splits(member, corpus, tally, p)
  return tally, streams, stats


def _total(stats: list[dict], seq_len: int) -> dict:
  """The stats of several members' splits taken together."""
  rows = sum(st['rows'] for st in stats)
  padding = sum(st['padding_fraction'] * st['rows'] * seq_len for st in stats)
  total = {'documents': sum(st['documents'] for st in stats),
           'tokens': sum(st['tokens'] for st in stats), 'rows': rows,
           'padding_fraction': padding / (rows * seq_len) if rows else 0.0}
  if 'dropped_tokens' in stats[0]:
    total['dropped_tokens'] = sum(st['dropped_tokens'] for st in stats)
  return total


def _write_rows(out: str, pool: packing.Pool, streams: dict, seq_len: int,
                layout: packing.RowLayout) -> tuple[dict[str, list[int]], int]:
  """Stage 3: every .npy shard of rows not written yet; (rows per shard by split, to do)."""
  dense_dir = os.path.join(out, packed_rows.DENSE_DIR)
  tmp_dir = os.path.join(out, 'tmp')
  counts_dir = os.path.join(out, 'counts')
  for d in (dense_dir, counts_dir):
    os.makedirs(d, exist_ok=True)
  shutil.rmtree(tmp_dir, ignore_errors=True)
  os.makedirs(tmp_dir)
  rows_per_shard = max(1, SHARD_BYTES // (4 * seq_len))
  tasks, shard_lengths = [], {}
  for s, stream in streams.items():
    rows = packing.split_stats(stream, seq_len, layout)['rows']
    n = -(-rows // rows_per_shard)
    shard_lengths[s] = [min(rows_per_shard, rows - k * rows_per_shard) for k in range(n)]
    for k in range(n):
      if not os.path.exists(packed_rows.dense_path(dense_dir, s, k, n)):
        tasks.append((s, k, n, k * rows_per_shard, k * rows_per_shard + shard_lengths[s][k],
                      stream, dense_dir, tmp_dir, counts_dir))
  num_shards = sum(len(v) for v in shard_lengths.values())
  logging.info('Writing %d of %d shards of rows', len(tasks), num_shards)
  pool.run(packing.write_shard, tasks, 'write rows', num_shards)
  return shard_lengths, len(tasks)


def _unknown_rate(counts: np.ndarray, tokenizer: tok_lib.Tokenizer, warn: bool = True) -> float:
  """The fraction of [UNK] among the train split's tokens (`counts`); if `warn`, a warning
  above MAX_UNKNOWN_RATE."""
  rate = prepared.unknown_rate(counts, tokenizer)
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
                 exported: bool) -> np.ndarray:
  """Removes the stages' scratch; returns the train split's token counts [vocab]."""
  counts_dir = os.path.join(out, 'counts')
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  for name, lengths in shard_lengths.items():
    if packing.split_role(name) == 'train':
      for k in range(len(lengths)):
        counts += np.load(os.path.join(counts_dir, f'{name}-{k:05d}.npy'))
  for name in ('units', 'counts', 'tmp', 'beam'):
    shutil.rmtree(os.path.join(out, name), ignore_errors=name == 'beam')
  if not exported:
    # The array_record shards an earlier version wrote into this unfinished
    # prepare: an export without its metadata, which nothing could read.
    shutil.rmtree(os.path.join(out, 'tfds'), ignore_errors=True)
  for name in (_SAMPLE_INFO, _OLD_SAMPLE_INFO):  # Kept in the report.
    if os.path.exists(os.path.join(out, name)):
      os.remove(os.path.join(out, name))
  return counts


# ------------------------------------------------------------------ stage 1: tokenizer


def _tokenizer(out: str, corpus: corpus_lib.Corpus, data: ml_collections.ConfigDict,
               tok: ml_collections.ConfigDict,
               pool: packing.Pool) -> tuple[tok_lib.Tokenizer, dict]:
  """The tokenizer in out/tokenizer.model or out/tokenizer/: given, kept from an earlier run,
  or trained.

  The units' lines are sampled in the pool's workers (packing.sample_unit)
  and merged here, so the sample is the same for any number of workers. The
  tokenizer is written under a temporary name and renamed last: its presence
  marks the stage done.
  """
  stored = prepared.stored_tokenizer(out)
  if stored is not None:
    info_path = os.path.join(out, _SAMPLE_INFO)
    if not os.path.exists(info_path):
      info_path = os.path.join(out, _OLD_SAMPLE_INFO)
    with open(info_path) as f:
      return tok_lib.load(stored), json.load(f)
  tmp_dir = os.path.join(out, 'tokenizer-tmp')
  shutil.rmtree(tmp_dir, ignore_errors=True)
  if tok.model_file:
    tokenizer = prepared.given_tokenizer(tok)
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
    summary = prepare_report.tokenizer_sample_summary(info)
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
    os.rename(os.path.join(tmp_dir, prepared.SP_TOKENIZER), stored)
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
  with open(os.path.join(out, prepared.ADDED_TOKENS), 'w') as f:
    json.dump({'spelled': {str(i): [int(p) for p in pieces] for i, pieces in spelled.items()},
               'base_vocab_size': base_vocab_size}, f, indent=2)
  return grown, len(spelled)


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
  one_of('data', 'row_layout', data.row_layout, packing.ROW_LAYOUTS)
  for name in ('chunk_min_tokens', 'chunk_drop_tokens'):
    require(0 <= data[name] <= data.seq_len - 2,
            f'config.data.{name}={data[name]} must be in [0, config.data.seq_len - 2 = '
            f'{data.seq_len - 2}] (0: none).')
    require(data.row_layout == 'document_chunks' or not data[name],
            f'config.data.{name}={data[name]} acts on document chunks only: set '
            "config.data.row_layout='document_chunks', or leave it 0.")
