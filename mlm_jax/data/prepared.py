"""A prepared data dir as training reads it: what it holds, how it is found, whether it is done.

data/prepare.py writes a data dir in stages; everything that reads one (the
training loop, the analyses, the benchmarks, the tests) reads it through this
module, which imports none of the stages:

  DATA_DIR/fingerprint.json    what the data was made from; written last, so its presence
                               marks a complete data dir (is_prepared)
  DATA_DIR/tokenizer.model     a sentencepiece tokenizer, or
  DATA_DIR/tokenizer/          a Hugging Face one (tokenizer.json, tokenizer_config.json, ...)
  DATA_DIR/added_tokens.json   with config.tokenizer.add_tokens: each added id's pieces before
  DATA_DIR/unigram_counts.npy  [vocab] int64 token counts of the train split
  DATA_DIR/stats.json          documents, tokens, rows, padding per split (train: [UNK] rate)
  DATA_DIR/report.json         stats + inputs skipped or repaired, tokenizer sample, work
  DATA_DIR/rows/               the rows: one .npy array [rows, T] per shard (data/packed_rows.py)
  DATA_DIR/tfds/mlm_rows/1.0.0 only with config.data.tfds_export: the same rows as a tfds
                               dataset in array_record (data/tfds_export.py)

A mixture (config.data.sources) stores each member's rows as its own splits
(train_K, validation_K). The fingerprint must stay what it is for the data
dirs already made: it names the cache directory and is checked on reuse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from mlm_jax.data import corpus as corpus_lib
from mlm_jax.data import mixture
from mlm_jax.data import packed_rows
from mlm_jax.data import paths
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.errors import DataDirError
from mlm_jax.errors import require

FORMAT_VERSION = 1
SPLITS = ('train', 'validation')
FINGERPRINT = 'fingerprint.json'
# Where a data dir keeps its tokenizer: a sentencepiece model, or a Hugging
# Face tokenizer's directory (tokenizer.load reads either).
SP_TOKENIZER, HF_TOKENIZER = 'tokenizer.model', 'tokenizer'
# {"spelled": {new id: [the ids that spelled the word before]}, "base_vocab_size": n}.
ADDED_TOKENS = 'added_tokens.json'
# The tfds export's dataset directory, under the data dir (name/version as tfds lays it out).
TFDS_NAME, TFDS_VERSION = 'mlm_rows', '1.0.0'



@dataclasses.dataclass(frozen=True)
class PreparedData:
  data_dir: str
  tokenizer: tok_lib.Tokenizer
  unigram_counts: np.ndarray  # [vocab] int64
  stats: dict
  # The names of a mixture's sources (config.data.sources), in order; () for one corpus.
  part_names: tuple[str, ...] = ()

  @property
  def tfds_dir(self) -> str:
    """Where the tfds export is (or would be): a dataset dir for tfds.builder_from_directory."""
    return tfds_dir(self.data_dir)

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
    return unknown_rate(self.unigram_counts, self.tokenizer)

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


def tfds_dir(data_dir: str) -> str:
  return os.path.join(data_dir, 'tfds', TFDS_NAME, TFDS_VERSION)


def has_tfds_export(data_dir: str) -> bool:
  """Whether the data dir holds a complete tfds export of its rows (its metadata is written
  last)."""
  return os.path.exists(os.path.join(tfds_dir(data_dir), 'dataset_info.json'))


def unknown_rate(counts: np.ndarray, tokenizer: tok_lib.Tokenizer) -> float:
  """The fraction of [UNK] among the train split's tokens (`counts` [vocab])."""
  unk = tokenizer.specials.unk
  return float(counts[unk]) / max(int(counts.sum()), 1) if unk < len(counts) else 0.0


# ------------------------------------------------------------------ the fingerprint


def fingerprint(rows: Mapping[str, Any], tok: ml_collections.ConfigDict,
                corpus: corpus_lib.Corpus | None = None) -> dict:
  """Everything the rows depend on, made from `rows`: the rows key of config.data
  (config/fields.py's rows_key, the fields whose role is ROWS; the phases of a run compare
  the same key), and the tokenizer. Nothing else of config.data enters it (num_workers,
  tfds_export, data_dir), so that adding the export to a data dir keeps its name."""
  tokenizer = tokenizer_fingerprint(tok)
  corpus = corpus or corpus_lib.resolve(ml_collections.ConfigDict(dict(rows)))
  fp = {
      'format': FORMAT_VERSION,
      'corpus': corpus.description,
      'document_split': corpus.split_rule,
      'seq_len': rows['seq_len'],
      'val_fraction': rows['val_fraction'],
      'split_seed': rows['split_seed'],
      'tokenizer': tokenizer,
  }
  if rows.get('row_layout', 'packed') != 'packed':  # Packed data dirs keep their names.
    fp['rows'] = {k: rows[k] for k in ('row_layout', 'chunk_min_tokens', 'chunk_drop_tokens')}
  return fp


def tokenizer_fingerprint(tok: ml_collections.ConfigDict) -> dict:
  """What the data dir's tokenizer is made from: a given tokenizer's content (and the words
  added to it), or the settings a trained one comes from.

  The default sentencepiece tokenizer's entries are those of earlier versions,
  so that their data dirs (and the cache keys naming them) stay valid. A given
  tokenizer that cannot take config.tokenizer.add_tokens is a ConfigError.
  """
  if tok.model_file:
    given = given_tokenizer(tok)
    if given.kind == 'sentencepiece':
      out = {'model_file_sha256': given.digest()}  # The .model file's sha256, as before.
    else:
      out = {'tokenizer_sha256': given.digest()}
    if tok.add_tokens:
      with open(os.path.expanduser(tok.add_tokens), 'rb') as f:
        out['add_tokens_sha256'] = hashlib.sha256(f.read()).hexdigest()
    return out
  if tok.kind == 'sentencepiece':
    return {'vocab_size': tok.vocab_size, 'model_type': tok.model_type,
            'character_coverage': tok.character_coverage, 'max_sentences': tok.max_sentences}
  return {'kind': tok.kind, 'vocab_size': tok.vocab_size, 'lowercase': tok.lowercase,
          'max_sentences': tok.max_sentences}


def given_tokenizer(tok: ml_collections.ConfigDict) -> tok_lib.Tokenizer:
  """config.tokenizer.model_file, loaded; ConfigError if it cannot be, or cannot take the words
  of config.tokenizer.add_tokens (only a Hugging Face tokenizer can)."""
  try:
    given = tok_lib.load(tok.model_file)
  except ValueError as e:
    raise ConfigError(f'config.tokenizer.model_file={tok.model_file!r}: {e}') from e
  require(not tok.add_tokens or given.kind != 'sentencepiece',
          f'config.tokenizer.add_tokens={tok.add_tokens!r}: the {given.kind} tokenizer '
          f'{tok.model_file} cannot take added tokens (only a Hugging Face tokenizer.json or '
          'vocab.txt can); leave add_tokens empty.')
  return given


def default_data_dir(fp: dict) -> str:
  digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
  name = {'python-stdlib-docstrings': 'stdlib', 'tfds': 'tfds', None: 'mixture'}.get(
      fp['corpus'].get('source'), 'corpus')
  return os.path.join(paths.cache_root(), 'data', f'{name}-T{fp["seq_len"]}-{digest}')


def resolve_data_dir(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict,
                     rows: Mapping[str, Any],
                     corpus: corpus_lib.Corpus | None = None) -> tuple[str, dict]:
  """(the data dir of config.data `data`: its data_dir or the cache's, its fingerprint)."""
  fp = fingerprint(rows, tok, corpus)
  data_dir = data.data_dir or default_data_dir(fp)
  return paths.absolute(data_dir), fp


def is_prepared(data_dir: str, fp: dict) -> bool:
  """True if data_dir holds data made from `fp`; raises if it holds other data."""
  fp_path = paths.join(data_dir, FINGERPRINT)
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


def holds(data_dir: str, fp: dict) -> bool:
  """Whether `data_dir` holds data made from `fp` (False for anything else there)."""
  try:
    return is_prepared(data_dir, fp)
  except DataDirError:
    return False


# ------------------------------------------------------------------ reading


def stored_tokenizer(directory: str) -> str | None:
  """The tokenizer a data dir holds (tokenizer.model or tokenizer/), or None."""
  for name in (SP_TOKENIZER, HF_TOKENIZER):
    path = os.path.join(directory, name)
    if os.path.exists(path):
      return path
  return None


def load(data_dir: str, part_names: tuple[str, ...] = ()) -> PreparedData:
  """The data of a complete local data dir; DataDirError (one line) for one an earlier version
  wrote without what training reads."""
  with open(os.path.join(data_dir, 'stats.json')) as f:
    stats = json.load(f)
  stored = stored_tokenizer(data_dir)
  if stored is None:
    raise DataDirError(f'{data_dir} holds no tokenizer (tokenizer.model or tokenizer/): delete '
                       'it and prepare again.')
  parts = len(stats.get('parts', ())) or 1
  if not all(packed_rows.split_paths(data_dir, name) for s in SPLITS
             for name in split_names(s, parts)):
    raise DataDirError(f'{data_dir} was prepared by an earlier version of mlm_jax (no .npy shards '
                       f'of its rows in {packed_rows.DENSE_DIR}/): delete it and prepare it again '
                       'with `python -m mlm_jax.prepare --config=FILE` (the same config).')
  return PreparedData(
      data_dir=data_dir,
      tokenizer=tok_lib.load(stored),
      unigram_counts=np.load(os.path.join(data_dir, 'unigram_counts.npy')),
      stats=stats,
      part_names=part_names)


def part_names(data: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The names of a mixture's sources (config.data.sources); () for one corpus."""
  return tuple(m.name for m in mixture.members(data))


def local_copy_dir(url: str) -> str:
  """Where a data dir at a bucket URL is copied to be read (training memory-maps its rows)."""
  return os.path.join(paths.cache_root(), 'remote', hashlib.sha256(url.encode()).hexdigest()[:16])


def copy_down(url: str, fp: dict) -> str:
  """The local copy of the prepared data dir at `url`, made unless it holds the same data; the
  copy's fingerprint.json comes last, so an interrupted copy is never taken as complete."""
  local = local_copy_dir(url)
  if not holds(local, fp):
    shutil.rmtree(local, ignore_errors=True)  # A copy of other data, or an unfinished one.
    logging.info('Copying the data dir %s into %s', url, local)
    paths.copy_tree(url, f'{local}.copy-{os.getpid()}', last=[FINGERPRINT])
    os.replace(f'{local}.copy-{os.getpid()}', local)
  return local


def load_prepared(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict,
                  rows: Mapping[str, Any]) -> PreparedData:
  """The data of config.data `data` and config.tokenizer `tok` (`rows`: data's rows key, see
  fingerprint), prepared already (by prepare.prepare, in this process or another): no stage
  runs. DataDirError if it is not prepared."""
  data_dir, fp = resolve_data_dir(data, tok, rows)
  if not is_prepared(data_dir, fp):
    raise DataDirError(f'{data_dir} holds no prepared data for this config: prepare it first '
                       'with `python -m mlm_jax.prepare --config=FILE` (the same config).')
  if paths.is_url(data_dir):
    data_dir = copy_down(data_dir, fp)
  return load(data_dir, part_names(data))
