"""mosaicml-streaming MDS directories as a corpus, read with numpy and zstandard (its one home).

An MDS directory (what streaming's MDSWriter writes; ModernBERT's, Ettin's and mmBERT's
training data ship so) holds `index.json`, {'version': 2, 'shards': [...]}, and the shards
it lists: `shard.NNNNN.mds`, or `shard.NNNNN.mds.zstd` (any compression's extension) when
written compressed. Each shard entry gives its format ('mds'), columns (names, encodings,
fixed sizes), compression, `samples`, and `raw_data` / `zip_data` (basename, bytes, hashes).
A merged index (streaming's merge_index) names shards in sub-directories ('part0/shard...').
The corpus names a directory holding index.json, or the index.json itself (so a glob such
as ROOT/*/index.json names many); a local path or a bucket URL (data/paths.py).

One sample is one document: the column config.data.text_key ('str': text), or
config.data.ids_key (an integer 'ndarray', e.g. ModernBERT's `input_ids`
`ndarray:uint32`: token ids made with the tokenizer config.tokenizer.model_file names).
Units of work are ranges of one directory's shards grouped to about UNIT_BYTES.

A shard file (after decompression) is: uint32 n, uint32 offsets [n + 1] (from the file's
start), the writer's config as JSON, then the samples; a sample is a uint32 size for each
column without a fixed size, in column order, then each column's bytes. An ndarray column
without a dtype in its encoding starts with a dtype code byte, one without a shape with a
byte ndim << 2 | shape-dtype code and the shape (streaming's encodings.NDArray).

What must stay true: streaming is not imported here (it is only a test dependency, to write
shards); the documents come in index order, shard by shard, sample by sample, whatever the
units; every hash the index gives that hashlib computes is checked before a shard is read
(xxhash's are not checked: that library is not a dependency); a missing shard, a hash that
does not match, a shard that does not decode and a column that is missing or of another kind
are each a one-line CorpusError naming the file, never a skipped input: a corpus quietly
missing part of itself would train on other data than the config names.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import posixpath
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlm_jax.data import paths
from mlm_jax.data import sources as sources_lib
from mlm_jax.errors import CorpusError
from mlm_jax.data.sources import Ids
from mlm_jax.data.sources import Tally
from mlm_jax.data.sources import Unit

INDEX = 'index.json'
# streaming's NDArray encoding: value dtype codes, and shape dtype codes (2 bits).
_VALUE_DTYPES = {8: 'uint8', 9: 'int8', 16: 'uint16', 17: 'int16', 18: 'float16', 32: 'uint32',
                 33: 'int32', 34: 'float32', 64: 'uint64', 65: 'int64', 66: 'float64'}
_SHAPE_DTYPES = ('uint8', 'uint16', 'uint32', 'uint64')


def is_mds_dir(path: str) -> bool:
  """Whether `path` is a directory holding an MDS index.json."""
  return paths.isdir(path) and paths.isfile(paths.join(path, INDEX))


def is_mds(path: str) -> bool:
  """An MDS directory, or its index.json named itself."""
  return posixpath.basename(path.rstrip('/')) == INDEX or is_mds_dir(path)


def root(path: str) -> str:
  """The MDS directory an input names (itself, or the directory of its index.json)."""
  path = path.rstrip('/')
  if posixpath.basename(path) != INDEX:
    return path
  return path[:-len(INDEX)].rstrip('/\\') or '.'


def read_index(path: str) -> list[dict[str, Any]]:
  """The shard entries of an MDS directory's index.json; CorpusError for one that is not."""
  index = paths.join(root(path), INDEX)
  try:
    shards = json.loads(paths.read_text(index))['shards']
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
      raise TypeError('its shards are not a list of objects')
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorpusError(f'{index} is not an MDS index ({type(e).__name__}: {e}); write the '
                      "directory again with streaming's MDSWriter, or remove it from the "
                      'corpus.') from e
  for k, shard in enumerate(shards):
    if shard.get('format') != 'mds':
      raise CorpusError(f'{index}: shard {k} has format {shard.get("format")!r}; only MDS '
                        "shards ('mds') are read (streaming's MDSWriter).")
  return shards


def _shard_file(shard: dict[str, Any]) -> tuple[str, dict[str, Any]]:
  """(basename, its file info) of the file a shard is stored in: compressed, or raw."""
  info = shard.get('zip_data') or shard['raw_data']
  return info['basename'], info


def _path(directory: str, basename: str) -> str:
  return paths.join(directory, *basename.split('/'))


def data_files(path: str) -> list[str]:
  """An MDS input's index.json and shard files, each there (its fingerprint's files);
  CorpusError naming a shard the index lists and the directory lacks."""
  directory = root(path)
  out = [paths.join(directory, INDEX)]
  for k, shard in enumerate(read_index(directory)):
    file = _path(directory, _shard_file(shard)[0])
    if not paths.isfile(file):
      raise CorpusError(f'{paths.join(directory, INDEX)} names shard {k}, {file}, which is '
                        'missing: copy the directory again whole, or remove it from the '
                        'corpus.')
    out.append(file)
  return out


def _column(shard: dict[str, Any], key: str, pretokenized: bool, where: str) -> int:
  """The index of column `key` in a shard; CorpusError naming the columns where it is missing
  or holds another kind (text: 'str'; ids: an 'ndarray' of integers)."""
  names, encodings = shard['column_names'], shard['column_encodings']
  field = 'ids_key' if pretokenized else 'text_key'
  if key not in names:
    raise CorpusError(f'{where} has no column config.data.{field}={key!r}; its columns are '
                      f'{dict(zip(names, encodings))}.')
  encoding = encodings[names.index(key)]
  kind, _, spec = encoding.partition(':')
  dtype = spec.partition(':')[0]
  if pretokenized:
    ok = kind == 'ndarray' and (not dtype or np.issubdtype(np.dtype(dtype), np.integer))
  else:
    ok = encoding == 'str'
  if not ok:
    what = "an integer 'ndarray' of token ids" if pretokenized else "'str' text"
    raise CorpusError(f'{where}: column {key!r} is {encoding!r}, not {what}; its columns are '
                      f'{dict(zip(names, encodings))}.')
  return names.index(key)


def check_column(path: str, text_key: str, ids_key: str) -> None:
  """CorpusError unless the first shard of an MDS input holds the column read from it."""
  shards = read_index(path)
  if shards:
    _column(shards[0], ids_key or text_key, bool(ids_key), paths.join(root(path), INDEX))


class MdsSource(sources_lib.Source):
  """MDS directories: a sample is a document (text, or token ids)."""

  def __init__(self, name: str, inputs: list[str], text_key: str, ids_key: str,
               unit_bytes: int, piece_chars: int):
    self.name, self.key, self.pretokenized = name, ids_key or text_key, bool(ids_key)
    self._unit_bytes, self._piece_chars = unit_bytes, piece_chars
    self.dirs = [root(p) for p in inputs]
    self.shards = {d: read_index(d) for d in self.dirs}
    for d, shards in self.shards.items():
      for k, shard in enumerate(shards):
        _column(shard, self.key, self.pretokenized, f'{paths.join(d, INDEX)} (shard {k})')

  def units(self) -> list[Unit]:
    units = []
    for d in self.dirs:
      start, size, shards = 0, 0, self.shards[d]
      for k, shard in enumerate(shards):
        size += int(shard['raw_data'].get('bytes') or 0)
        if size >= self._unit_bytes or k == len(shards) - 1:
          units.append(Unit(files=(d,), start=start, stop=k + 1, kind='shards'))
          start, size = k + 1, 0
    return units

  def read(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    directory = unit.files[0]
    label = f'{directory} (shards {unit.start}-{unit.stop - 1})'
    long_docs = invalid = documents = 0
    for k in range(unit.start, unit.stop):
      shard = self.shards[directory][k]
      file = _path(directory, _shard_file(shard)[0])
      column = _column(shard, self.key, self.pretokenized, file)
      for i, value in enumerate(_column_values(_shard_bytes(shard, file), shard, column, file)):
        documents += 1
        if self.pretokenized:
          yield True, Ids(_ids(value, shard['column_encodings'][column], f'{file} sample {i}'),
                          f'{file} sample {i}')
          continue
        text, bad = sources_lib.decode_utf8(value)
        invalid += bad
        pieces, long = sources_lib.document(text, self._piece_chars)
        long_docs += long
        yield from pieces
    if invalid:
      tally.repair(label, 'invalid_utf8_files', f'invalid UTF-8: {invalid} bytes replaced by '
                   'U+FFFD')
      tally.count('invalid_utf8_bytes', invalid)
    if long_docs:
      tally.repair(label, 'long_documents', f'documents over {self._piece_chars:,} characters '
                   'read and tokenized in pieces', long_docs)
    if unit.start == 0 and documents:
      tally.count('files_used')


def _shard_bytes(shard: dict[str, Any], file: str) -> bytes:
  """A shard's file read, its hashes checked and decompressed: the raw MDS bytes."""
  _, info = _shard_file(shard)
  try:
    with paths.open_binary(file) as f:
      data = f.read()
  except OSError as e:
    raise CorpusError(f'{file} cannot be read ({e}); copy it again, or remove its directory '
                      'from the corpus.') from e
  _check_hashes(data, info, file)
  compression = shard.get('compression')
  if shard.get('zip_data') and compression:
    data = _decompress(data, compression, file)
    _check_hashes(data, shard['raw_data'], f'{file} (decompressed)')
  raw_bytes = shard['raw_data'].get('bytes')
  if raw_bytes is not None and len(data) != raw_bytes:
    raise CorpusError(f'{file} holds {len(data):,} bytes where its index says '
                      f'{raw_bytes:,}: it is truncated or damaged; copy it again.')
  return data


def _check_hashes(data: bytes, info: dict[str, Any], file: str) -> None:
  for algorithm, expected in sorted((info.get('hashes') or {}).items()):
    if algorithm not in hashlib.algorithms_available:
      continue  # xxhash's (xxh64, xxh3_64, ...): not computed here.
    digest = hashlib.new(algorithm, data).hexdigest()
    if digest != expected:
      raise CorpusError(f'{file} does not match its {algorithm} in index.json ({digest} vs '
                        f'{expected}): it is damaged or was changed after the index was '
                        'written; copy it again, or write the directory again.')


def _decompress(data: bytes, compression: str, file: str) -> bytes:
  """A shard's bytes decompressed by its algorithm ('zstd', 'zstd:LEVEL', 'gz', 'bz2')."""
  algorithm = compression.partition(':')[0]
  try:
    if algorithm == 'zstd':
      import zstandard  # pylint: disable=import-outside-toplevel  # Compressed shards only.
      # decompressobj: frames that do not record their size decompress too.
      stream = zstandard.ZstdDecompressor().decompressobj()
      out = stream.decompress(data)
      if not stream.eof:
        raise EOFError('the data ends inside its zstd frame')
      return out
    if algorithm == 'gz':
      return gzip.decompress(data)
    if algorithm == 'bz2':
      return bz2.decompress(data)
  except Exception as e:  # pylint: disable=broad-except  # zstandard.ZstdError, OSError, EOF.
    raise CorpusError(f'{file} does not decompress as {algorithm} ({type(e).__name__}: {e}): '
                      'it is truncated or damaged; copy it again.') from e
  raise CorpusError(f'{file} is compressed with {compression!r}; MDS shards are read '
                    "uncompressed or compressed with 'zstd', 'gz' or 'bz2': write them again "
                    'with one of those.')


def _column_values(data: bytes, shard: dict[str, Any], column: int,
                   file: str) -> Iterator[bytes]:
  """The bytes of column `column` of each sample of a shard's raw data, in order."""
  n = int(np.frombuffer(data, np.uint32, 1)[0]) if len(data) >= 4 else -1
  if n < 0 or len(data) < 4 * (n + 2):
    raise CorpusError(f'{file} is not an MDS shard (too short for its sample table): it is '
                      'truncated or damaged; copy it again.')
  offsets = np.frombuffer(data, np.uint32, n + 1, 4).astype(np.int64)
  if n != shard.get('samples', n) or np.any(np.diff(offsets) < 0) or offsets[-1] > len(data):
    raise CorpusError(f'{file} does not hold the {shard.get("samples")} samples its index '
                      'says: it is damaged, or not the shard the index was written with.')
  sizes = shard['column_sizes']
  variable = [j for j, s in enumerate(sizes) if s is None]
  for a, b in zip(offsets[:-1], offsets[1:]):
    sample = data[a:b]
    lengths = np.frombuffer(sample, np.uint32, len(variable)) if variable else ()
    widths = list(sizes)
    for j, length in zip(variable, lengths):
      widths[j] = int(length)
    start = 4 * len(variable) + sum(widths[:column])
    yield sample[start:start + widths[column]]


def _ids(value: bytes, encoding: str, where: str) -> np.ndarray:
  """An 'ndarray[:dtype[:shape]]' value as int64 ids [n] (its shape flattened)."""
  spec = encoding.partition(':')[2]
  dtype, _, shape = spec.partition(':')
  at = 0
  if not dtype:
    dtype, at = _VALUE_DTYPES.get(value[0], ''), 1
    if not dtype or not np.issubdtype(np.dtype(dtype), np.integer):
      raise CorpusError(f'{where} holds an array of {dtype or "an unknown dtype"}, not integer '
                        'token ids.')
  if not shape:
    byte = value[at]
    ndim, shape_dtype = byte >> 2, np.dtype(_SHAPE_DTYPES[byte & 3])
    at += 1 + ndim * shape_dtype.itemsize
  return np.frombuffer(value, np.dtype(dtype), offset=at).astype(np.int64)
