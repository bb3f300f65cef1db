"""Prepare: text -> tokenizer -> packed [CLS] ... [SEP] rows + unigram counts.

Runs once per (corpus, tokenizer settings, T): the result is a tfds dataset in
array_record format under the data dir, with the sentencepiece model and the
token counts beside it:

  DATA_DIR/fingerprint.json    what the data was made from (checked on reuse)
  DATA_DIR/tokenizer.model     sentencepiece model
  DATA_DIR/unigram_counts.npy  [vocab] int64 token counts of the train split
  DATA_DIR/stats.json          documents, tokens, rows, padding per split
  DATA_DIR/tfds/mlm_rows/1.0.0 the rows: {'input_ids': int32[T]}

Packing follows RoBERTa's FULL-SENTENCES: documents are concatenated with
[SEP] between them and cut into rows of exactly T ids, so only the last row of
each split has padding. Documents, not rows, are assigned to the validation
split, so no held-out text is seen in training.

The whole directory is built under a temporary name and renamed into place at
the end, so an interrupted prepare never leaves a half-written dataset.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Iterator

import ml_collections
import numpy as np
import tensorflow_datasets as tfds

from mlm_jax import corpus as corpus_lib
from mlm_jax import tokenizer as tok_lib

FORMAT_VERSION = 1
_DOCS_PER_CHUNK = 2000


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
    return os.path.join(self.data_dir, 'tfds', _PackedRows.name, str(_PackedRows.VERSION))

  def most_frequent_token(self) -> int:
    """The train split's most frequent normal (non-special) token id."""
    counts = self.unigram_counts.astype(np.float64).copy()
    counts[list(tok_lib.SPECIAL_IDS)] = 0
    return int(np.argmax(counts))

  def source(self, split: str):
    """A random-access source of {'input_ids': int32[T]} rows."""
    builder = tfds.builder_from_directory(self.rows_dir)
    return builder.as_data_source(split)


def fingerprint(data: ml_collections.ConfigDict, tok: ml_collections.ConfigDict) -> dict:
  """Everything the prepared data depends on."""
  if tok.model_file:
    tokenizer = {'model_file_sha256': _file_digest(os.path.expanduser(tok.model_file))}
  else:
    tokenizer = {'vocab_size': tok.vocab_size, 'model_type': tok.model_type,
                 'character_coverage': tok.character_coverage,
                 'max_sentences': tok.max_sentences}
  return {
      'format': FORMAT_VERSION,
      'corpus': corpus_lib.describe(data.corpus),
      'document_split': data.document_split if data.corpus else 'docstring',
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
  name = 'stdlib' if fp['corpus']['source'] == 'python-stdlib-docstrings' else 'corpus'
  return os.path.join(root, 'data', f'{name}-T{fp["seq_len"]}-{digest}')


def resolve_data_dir(config: ml_collections.ConfigDict) -> tuple[str, dict]:
  fp = fingerprint(config.data, config.tokenizer)
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
  """Loads the prepared data for `config`, preparing it first if needed."""
  data_dir, fp = resolve_data_dir(config)
  if is_prepared(data_dir, fp):
    return load(data_dir)
  parent = os.path.dirname(data_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(data_dir) + '.partial-', dir=parent)
  try:
    os.chmod(tmp, 0o755)
    _prepare_into(tmp, config, fp)
    if os.path.isdir(data_dir):
      os.rmdir(data_dir)  # Empty (checked above); rename needs it gone.
    os.rename(tmp, data_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return load(data_dir)


def _prepare_into(out: str, config: ml_collections.ConfigDict, fp: dict) -> None:
  data = config.data
  # The default corpus costs seconds to parse: read it once for both passes.
  docs: Iterable[str] | None = (
      list(corpus_lib.documents('')) if not data.corpus else None)

  def iter_docs() -> Iterator[tuple[bool, str]]:
    """(is_validation, text) for every non-empty document."""
    source = docs if docs is not None else corpus_lib.documents(data.corpus, data.document_split)
    for text in source:
      text = tok_lib.sanitize(text)
      yield _is_validation(text, data.val_fraction, data.split_seed), text

  model_path = os.path.join(out, 'tokenizer.model')
  if config.tokenizer.model_file:
    shutil.copyfile(os.path.expanduser(config.tokenizer.model_file), model_path)
    tokenizer = tok_lib.Tokenizer(model_path)
  else:
    tokenizer = _train_tokenizer(iter_docs, model_path, config)


  logging.info('Tokenizing and packing rows of %d ids', data.seq_len)
  packers = {'train': _RowPacker(os.path.join(out, 'train.rows'), data.seq_len),
             'validation': _RowPacker(os.path.join(out, 'validation.rows'), data.seq_len)}
  counts = np.zeros(tokenizer.vocab_size, np.int64)
  chunk: list[tuple[bool, str]] = []

  def flush():
    for (is_val, _), ids in zip(chunk, tokenizer.encode([t for _, t in chunk])):
      if not ids:
        continue
      ids = np.asarray(ids, np.int32)
      packers['validation' if is_val else 'train'].add(ids)
      if not is_val:
        np.add(counts, np.bincount(ids, minlength=tokenizer.vocab_size), out=counts)
    chunk.clear()

  for item in iter_docs():
    chunk.append(item)
    if len(chunk) >= _DOCS_PER_CHUNK:
      flush()
  flush()
  stats = {split: p.close() for split, p in packers.items()}
  _ensure_splits(stats, data)

  builder = _PackedRows(
      data_dir=os.path.join(out, 'tfds'), seq_len=data.seq_len,
      row_files={s: p.path for s, p in packers.items()})
  tfds.disable_progress_bar()
  # tfds announces "downloading" on stdout; nothing is downloaded here.
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare(file_format='array_record')
  for p in packers.values():
    os.remove(p.path)
  np.save(os.path.join(out, 'unigram_counts.npy'), counts)
  with open(os.path.join(out, 'stats.json'), 'w') as f:
    json.dump(stats, f, indent=2)
  # Written last: its presence marks a complete data dir.
  with open(os.path.join(out, 'fingerprint.json'), 'w') as f:
    json.dump(fp, f, indent=2)


def _train_tokenizer(iter_docs, model_path: str,
                     config: ml_collections.ConfigDict) -> tok_lib.Tokenizer:
  """Trains sentencepiece on the lines of the training documents."""
  tok = config.tokenizer
  logging.info('Training a %s tokenizer (vocab %d)', tok.model_type, tok.vocab_size)
  lines = (line.strip() for is_val, text in iter_docs() if not is_val
           for line in text.splitlines() if line.strip())
  tokenizer = tok_lib.train_tokenizer(
      lines, model_path, vocab_size=tok.vocab_size, model_type=tok.model_type,
      character_coverage=tok.character_coverage, max_sentences=tok.max_sentences,
      seed=config.data.split_seed)
  if tokenizer.vocab_size < tok.vocab_size:
    logging.warning('The corpus supports only %d tokenizer pieces, not the %d asked for '
                    '(config.tokenizer.vocab_size).', tokenizer.vocab_size, tok.vocab_size)
  return tokenizer


def _is_validation(text: str, fraction: float, seed: int) -> bool:
  """A stable, content-keyed coin flip per document."""
  h = zlib.crc32(text.encode('utf-8', 'replace'), zlib.crc32(str(seed).encode()))
  return h / 2**32 < fraction


def _ensure_splits(stats: dict, data: ml_collections.ConfigDict) -> None:
  name = data.corpus or 'the default corpus'
  if stats['train']['rows'] == 0:
    raise corpus_lib.CorpusError(f'{name} has no usable text: check config.data.corpus.')
  if stats['validation']['rows'] == 0:
    raise corpus_lib.CorpusError(
        f'{name}: no document fell into the validation split '
        f'(config.data.val_fraction={data.val_fraction}, '
        f'{stats["train"]["documents"]} documents). Raise val_fraction, or add '
        "documents (document_split='blank_line' makes one per paragraph).")


class _RowPacker:
  """Concatenates documents with [SEP] between them into rows of T ids."""

  def __init__(self, path: str, seq_len: int):
    self.path = path
    self._content = seq_len - 2  # Room between [CLS] and the closing [SEP].
    self._f = open(path, 'wb')
    self._pending: list[np.ndarray] = []
    self._pending_len = 0
    self.documents = self.tokens = self.rows = self.padding = 0

  def add(self, ids: np.ndarray) -> None:
    self.documents += 1
    self.tokens += len(ids)
    self._pending += [ids, np.array([tok_lib.SEP_ID], np.int32)]
    self._pending_len += len(ids) + 1
    if self._pending_len >= self._content:
      stream = np.concatenate(self._pending)
      n_rows = len(stream) // self._content
      self._write(stream[:n_rows * self._content].reshape(n_rows, self._content))
      rest = stream[n_rows * self._content:]
      self._pending, self._pending_len = [rest], len(rest)

  def _write(self, content: np.ndarray) -> None:
    n = len(content)
    cls = np.full((n, 1), tok_lib.CLS_ID, np.int32)
    sep = np.full((n, 1), tok_lib.SEP_ID, np.int32)
    self._f.write(np.concatenate([cls, content, sep], axis=1).tobytes())
    self.rows += n

  def close(self) -> dict:
    stream = np.concatenate(self._pending) if self._pending else np.zeros(0, np.int32)
    if len(stream) and stream[-1] == tok_lib.SEP_ID:
      stream = stream[:-1]  # The closing [SEP] of the row ends the last document.
    if len(stream):
      self.padding = self._content - len(stream)
      row = np.full((1, self._content), tok_lib.PAD_ID, np.int32)
      row[0, :len(stream)] = stream
      self._write(row)
    self._f.close()
    total = self.rows * (self._content + 2)
    return {'documents': self.documents, 'tokens': self.tokens, 'rows': self.rows,
            'padding_fraction': self.padding / total if total else 0.0}


class _PackedRows(tfds.core.GeneratorBasedBuilder):
  """Packed rows of token ids, written by `prepare` from raw row files."""

  name = 'mlm_rows'
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Packed [CLS] ... [SEP] rows.'}

  def __init__(self, *, seq_len: int, row_files: dict[str, str], **kwargs):
    self._seq_len = seq_len
    self._row_files = row_files
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='Packed [CLS] ... [SEP] rows of sentencepiece ids.',
        features=tfds.features.FeaturesDict({
            'input_ids': tfds.features.Tensor(shape=(self._seq_len,), dtype=np.int32),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the rows are local files.
    return {split: self._generate_examples(path) for split, path in self._row_files.items()}

  def _generate_examples(self, path):
    rows = np.fromfile(path, np.int32).reshape(-1, self._seq_len)
    for i, row in enumerate(rows):
      yield i, {'input_ids': row}
