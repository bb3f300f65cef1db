"""Parquet files and `datasets` directories as a corpus, read with pyarrow (its one home here).

A `.parquet` file (FineWeb, FineWeb-Edu and most published corpora ship so)
and a directory written by `datasets.Dataset.save_to_disk` (Arrow stream
files listed in its state.json) are tables: one document per row, in the
column `config.data.text_key` (text), or `config.data.ids_key` (token ids made
with the tokenizer config.tokenizer.model_file names: pre-tokenized input).

Units of work are ranges of a parquet file's row groups, or of an Arrow
file's record batches, grouped to about UNIT_BYTES, so that all workers share
one big file. Rows are named in messages by their index: within the file for
parquet, within the dataset for a datasets directory (as `dataset[i]`).

Bad rows are reported as bad lines of files are: a null is skipped and
counted; a binary column's invalid UTF-8 is replaced and counted. A column
that is missing, or holds neither text nor lists of integers, is an error
naming the columns there are. A file pyarrow cannot read (not parquet, not
Arrow, truncated, corrupt) is a one-line CorpusError naming it, not skipped:
a table's rows cannot be read past the damage, and a corpus quietly missing
a file of it would train on other data than the config names. Files are
opened through data/paths.py, so a bucket URL works where its fsspec back
end is installed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mlm_jax.data import paths
from mlm_jax.data import sources as sources_lib
from mlm_jax.data.sources import Ids
from mlm_jax.data.sources import Tally
from mlm_jax.data.sources import Unit
from mlm_jax.errors import CorpusError

# What save_to_disk writes beside its Arrow files (a DatasetDict: one folder per split).
_STATE, _DATASET_DICT = 'state.json', 'dataset_dict.json'


def is_dataset_dir(path: str) -> bool:
  """Whether `path` is a directory written by datasets' save_to_disk (a Dataset or DatasetDict)."""
  return paths.isfile(paths.join(path, _STATE)) or paths.isfile(paths.join(path, _DATASET_DICT))


def is_table(path: str) -> bool:
  """A parquet file or a datasets directory (rather than a text or jsonl file)."""
  return path.endswith('.parquet') or (paths.isdir(path) and is_dataset_dir(path))


def data_files(path: str) -> list[str]:
  """The files holding an input's rows: a datasets directory's Arrow files, else the path."""
  if not paths.isdir(path):
    return [path]
  if paths.isfile(paths.join(path, _DATASET_DICT)):
    splits = json.loads(paths.read_text(paths.join(path, _DATASET_DICT)))['splits']
    raise CorpusError(f'{path} holds a DatasetDict (splits {splits}); name the directory of '
                      f'one split, e.g. {paths.join(path, splits[0])}.')
  try:
    state = json.loads(paths.read_text(paths.join(path, _STATE)))
    return [paths.join(path, f['filename']) for f in state['_data_files']]
  except (ValueError, KeyError, TypeError) as e:
    raise CorpusError(f'{paths.join(path, _STATE)} is not a datasets state.json listing its '
                      f'Arrow files ({type(e).__name__}: {e}); save the dataset again with '
                      'save_to_disk, or remove it from the corpus.') from e


@contextlib.contextmanager
def _reading(path: str, what: str = '') -> Iterator[None]:
  """Turns pyarrow's error for an unreadable file into a CorpusError naming it (and `what`)."""
  try:
    yield
  except (pa.ArrowException, OSError) as e:  # ArrowInvalid, or OSError for bad thrift.
    kind = 'a parquet' if path.endswith('.parquet') else 'an Arrow stream'
    raise CorpusError(f'{path}{what} cannot be read as {kind} file ({type(e).__name__}: '
                      f'{str(e).strip()}); it is not one, or it is damaged: replace it, or '
                      'remove it from the corpus.') from e


def _open(path: str):
  """A pyarrow input: memory-mapped when local, else a file object through data/paths.py."""
  return pa.PythonFile(paths.open_binary(path), mode='r') if paths.is_url(path) else (
      pa.memory_map(path))


def _schema(path: str) -> pa.Schema:
  with _reading(path):
    if path.endswith('.parquet'):
      return pq.read_schema(_open(path))
    return pa.ipc.open_stream(_open(path)).schema


def _kind(column_type: pa.DataType) -> str:
  """'text', 'binary', 'ids' or 'other' for a column's type."""
  if pa.types.is_string(column_type) or pa.types.is_large_string(column_type):
    return 'text'
  if pa.types.is_binary(column_type) or pa.types.is_large_binary(column_type):
    return 'binary'
  if ((pa.types.is_list(column_type) or pa.types.is_large_list(column_type)
       or pa.types.is_fixed_size_list(column_type))
      and pa.types.is_integer(column_type.value_type)):
    return 'ids'
  return 'other'


def check_column(path: str, text_key: str, ids_key: str, field: str) -> str:
  """The kind of the column a table input is read from ('text', 'binary' or 'ids');
  CorpusError naming the columns there are when it is missing or of another kind."""
  key, key_field = (ids_key, 'ids_key') if ids_key else (text_key, 'text_key')
  for f in data_files(path):
    schema = _schema(f)
    if key not in schema.names:
      raise CorpusError(f'{f} has no column {field}.{key_field}={key!r}; its columns are '
                        f'{schema.names}.')
    kind = _kind(schema.field(key).type)
    wanted = ('ids',) if ids_key else ('text', 'binary')
    if kind not in wanted:
      what = 'lists of integer token ids' if ids_key else 'text (string or binary)'
      raise CorpusError(f'{f}: column {key!r} holds {schema.field(key).type}, not {what}; its '
                        f'columns are {schema.names}.')
  return kind


class TableSource(sources_lib.Source):
  """Parquet files and datasets directories: a row is a document (text, or token ids)."""

  def __init__(self, name: str, inputs: list[str], text_key: str, ids_key: str, field: str,
               unit_bytes: int, piece_chars: int):
    self.name, self.key, self.pretokenized = name, ids_key or text_key, bool(ids_key)
    self._unit_bytes, self._piece_chars = unit_bytes, piece_chars
    self.kinds: dict[str, str] = {}
    self.first_row: dict[str, int] = {}  # A datasets file's first row in its dataset.
    self.files: list[str] = []
    for path in inputs:
      check_column(path, text_key, ids_key, field)
      row = 0
      for f in data_files(path):
        self.files.append(f)
        self.kinds[f] = _kind(_schema(f).field(self.key).type)
        self.first_row[f] = row
        row += _num_rows(f)

  def units(self) -> list[Unit]:
    units = []
    for f in self.files:
      kind = 'row_groups' if f.endswith('.parquet') else 'batches'
      start, size = 0, 0
      sizes = _part_sizes(f)
      for i, n in enumerate(sizes):
        size += n
        if size >= self._unit_bytes or i == len(sizes) - 1:
          units.append(Unit(files=(f,), start=start, stop=i + 1, kind=kind))
          start, size = i + 1, 0
    return units

  def read(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    path = unit.files[0]
    label = f'{path} ({unit.kind.replace("_", " ")} {unit.start}-{unit.stop - 1})'
    row = self.first_row[path] + _rows_before(path, unit.start)
    long_docs = invalid = 0
    for column in _columns(path, self.key, unit):
      nulls = column.is_null().to_numpy(zero_copy_only=False)
      if self.pretokenized:
        for i, ids in enumerate(_id_lists(column)):
          if nulls[i]:
            tally.skip_line(label, 'null_value', row + i, f'null in column {self.key!r}', 'rows')
          else:
            yield True, Ids(ids, f'{path} row {row + i}')
      else:
        for i, value in enumerate(column.to_pylist()):
          if value is None:
            tally.skip_line(label, 'null_value', row + i, f'null in column {self.key!r}', 'rows')
            continue
          if isinstance(value, bytes):
            value, bad = sources_lib.decode_utf8(value)
            invalid += bad
          pieces, long = sources_lib.document(value, self._piece_chars)
          long_docs += long
          yield from pieces
      row += len(column)
    if invalid:
      tally.repair(label, 'invalid_utf8_files', f'invalid UTF-8: {invalid} bytes replaced by '
                   'U+FFFD')
      tally.count('invalid_utf8_bytes', invalid)
    if long_docs:
      tally.repair(label, 'long_documents', f'documents over {self._piece_chars:,} characters '
                   'read and tokenized in pieces', long_docs)
    if unit.start == 0 and row > self.first_row[path]:
      tally.count('files_used')


def _num_rows(path: str) -> int:
  with _reading(path):
    if path.endswith('.parquet'):
      return pq.ParquetFile(_open(path)).metadata.num_rows
    return sum(b.num_rows for b in pa.ipc.open_stream(_open(path)))


def _part_sizes(path: str) -> list[int]:
  """Bytes of each row group (parquet, uncompressed) or record batch (Arrow)."""
  with _reading(path):
    if path.endswith('.parquet'):
      meta = pq.ParquetFile(_open(path)).metadata
      return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
    return [b.nbytes for b in pa.ipc.open_stream(_open(path))]


def _rows_before(path: str, part: int) -> int:
  """Rows of a file before its row group (record batch) `part`."""
  with _reading(path):
    if path.endswith('.parquet'):
      meta = pq.ParquetFile(_open(path)).metadata
      return sum(meta.row_group(g).num_rows for g in range(part))
    reader = pa.ipc.open_stream(_open(path))
    return sum(reader.read_next_batch().num_rows for _ in range(part))


def _columns(path: str, key: str, unit: Unit) -> Iterator[pa.Array]:
  """The column `key` of each row group / record batch of a unit, in order."""
  if unit.kind == 'row_groups':
    with _reading(path):
      parquet = pq.ParquetFile(_open(path))
    for g in range(unit.start, unit.stop):
      with _reading(path, f' (row group {g})'):
        chunks = parquet.read_row_group(g, columns=[key]).column(key).chunks
      yield from chunks
    return
  with _reading(path):
    reader = pa.ipc.open_stream(_open(path))
  for b in range(unit.stop):
    with _reading(path, f' (record batch {b})'):
      batch = reader.read_next_batch()
    if b >= unit.start:
      yield batch.column(key)


def _id_lists(column: pa.Array) -> list[np.ndarray]:
  """A list-of-integers column as one int64 array per row (a null row: an empty one)."""
  if pa.types.is_fixed_size_list(column.type):
    return [np.asarray(v or [], np.int64) for v in column.to_pylist()]
  offsets = column.offsets.to_numpy()
  values = column.values.to_numpy(zero_copy_only=False).astype(np.int64)
  return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
