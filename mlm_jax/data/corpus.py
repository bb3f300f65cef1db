"""Where text comes from: the embedded default corpus, the user's files, a tfds dataset, parquet
files and datasets directories (data/arrow_source.py), or a mixture of them (data/mixture.py).

Each kind is a Source (data/sources.py); `resolve` turns config.data into a
Corpus: its sources and their units of work in reading order.

The default corpus exists on every machine with Python: the docstrings of the
standard library (~1.6 MB of English technical prose), read with `ast` from
the source files, never by importing the modules. Each docstring is one
document. Parsing them takes seconds; the first read of the whole corpus keeps
them, file by file, in mlm_jax's cache (paths.cache_root()), named by the
Python version and the files' sizes and times, and every later read of the
same files takes them from there.

User files (`config.data.corpus`: paths, directories or globs, comma
separated) are `.txt` (or any other name: plain text) or `.jsonl` (one JSON
object per line, its `config.data.text_key` field is one document), each
possibly gzipped (`.gz`). A text file is split into documents at blank lines
(`document_split='blank_line'`) or is one document (`'file'`). A tfds dataset
already prepared on disk in array_record format (`config.data.tfds_name`) gives
one document per record.

Bad input never stops a prepare and never disappears silently: every input
that is skipped (missing, empty, binary, unreadable, a jsonl line that is not
JSON or lacks the key) or repaired (invalid UTF-8 replaced, CRLF line endings,
a document cut into pieces) is counted in a `Tally`, which prepare reports.

Reading streams: a document comes out as pieces of at most PIECE_CHARS
characters cut at whitespace, so a 100 MB line never sits in memory whole.

Units of work: small files are grouped to about UNIT_BYTES; a larger
uncompressed file is cut into byte ranges of about UNIT_BYTES, each cut moved
forward to the next document boundary (a blank line for 'blank_line', a line
end for .jsonl) within the following UNIT_BYTES, so that all workers share
one big file. A range starts on a fresh line after a boundary, so reading the
ranges one after another gives exactly the documents, pieces and text of
reading the file whole. A stretch with no boundary (a document longer than
UNIT_BYTES, a file with no newline) stays in one range.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import io
import json
import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from typing import Any

import ml_collections

from mlm_jax.data import arrow_source
from mlm_jax.data import mds_source
from mlm_jax.data import mixture
from mlm_jax.data import paths
from mlm_jax.data import sources as sources_lib
from mlm_jax.data import tfds_source
from mlm_jax.data.sources import Tally
from mlm_jax.data.sources import Unit
from mlm_jax.errors import ConfigError
from mlm_jax.errors import CorpusError
from mlm_jax.errors import one_of
from mlm_jax.errors import require

# Standard-library folders that are tests, third-party code or tooling rather
# than documentation.
_SKIP_DIRS = frozenset({'site-packages', 'dist-packages', 'test', 'tests',
                        'idlelib', 'lib2to3', '__pycache__', 'turtledemo'})
# What a blank line may hold (the characters of the old r'\n[ \t\r\f\v]*\n').
_BLANK = ' \t\r\f\v\n'
# How a text file splits into documents (config.data.document_split).
DOCUMENT_SPLITS = ('blank_line', 'file')
# Documents longer than this are read and tokenized in pieces of this size.
PIECE_CHARS = 1 << 20
# A jsonl line longer than this is skipped: json needs it whole in memory.
MAX_RECORD_CHARS = 64 << 20
# Files are grouped into units of work of about this many bytes.
UNIT_BYTES = 16 << 20
# Records of a tfds split per unit of work.
TFDS_RECORDS_PER_UNIT = 10_000
# Bytes sniffed for NULs: a file holding one is binary, not text.
_SNIFF_BYTES = 8192


@dataclasses.dataclass
class Corpus:
  """A resolved corpus: its sources, their units of work in reading order, and what it is.

  A corpus of one kind has one source; `config.data.corpus` naming text files
  and parquet files has one of each, and a mixture (`config.data.sources`)
  the sources of all its members, `parts[i]` being the member that source i
  belongs to.
  """
  name: str  # For messages: the config option that named it.
  sources: list[sources_lib.Source]
  units: list[Unit]  # Unit.source indexes `sources`.
  description: dict  # Identity for the data dir fingerprint.
  tally: Tally  # Inputs skipped while resolving (missing paths, empty globs).
  # How documents are delimited, for the fingerprint: config.data.document_split for
  # text files, 'docstring' for the default corpus, 'record' for tables and tfds.
  split_rule: str
  parts: list[int] = dataclasses.field(default_factory=list)  # Per source; [] for one corpus.

  @property
  def num_parts(self) -> int:
    return max(self.parts, default=0) + 1

  def part(self, unit: Unit) -> int:
    """The mixture member a unit belongs to (0 for one corpus)."""
    return self.parts[unit.source] if self.parts else 0

  @property
  def pretokenized(self) -> bool:
    return any(s.pretokenized for s in self.sources)

  def pieces(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    """(starts_a_document, text or Ids) for every piece of every document of `unit`, in order."""
    return self.sources[unit.source].read(unit, tally)


class StdlibSource(sources_lib.Source):
  """The default corpus: every docstring of the standard library's source files."""

  name = 'the default corpus'

  def __init__(self):
    self.files = stdlib_files()
    self.digest = _stat_digest(self.files)

  def units(self) -> list[Unit]:
    # ~11 MB of source holding ~1.7 MB of docstrings: small units, so all workers get some.
    return _group(self.files, [os.path.getsize(f) for f in self.files], UNIT_BYTES // 16)

  def read(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    table = _docstring_table(tuple(self.files), self.digest, build=True)
    for path in unit.files:
      for doc in table[path]:
        yield True, doc


class FileSource(sources_lib.Source):
  """Text and jsonl files, each possibly gzipped; a big uncompressed file in byte ranges."""

  def __init__(self, name: str, files: list[str], document_split: str, text_key: str):
    self.name, self.files = name, files
    self.document_split, self.text_key = document_split, text_key

  def units(self) -> list[Unit]:
    return _group(self.files, [paths.size(f) for f in self.files], UNIT_BYTES,
                  self.document_split)

  def read(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    for path in unit.files:
      yield from _file_pieces(path, self.document_split, self.text_key, tally, unit.byte_range)


class TfdsSource(sources_lib.Source):
  """A split of a tfds dataset prepared on disk (array_record): one document per record."""

  def __init__(self, name: str, source: Any, text_key: str):
    self.name, self.source, self.text_key = name, source, text_key

  def units(self) -> list[Unit]:
    n, step = len(self.source), TFDS_RECORDS_PER_UNIT
    return [Unit(start=a, stop=min(a + step, n), kind='records') for a in range(0, n, step)]

  def read(self, unit: Unit, tally: Tally) -> Iterator[sources_lib.Piece]:
    yield from _tfds_pieces(self.source, unit, self.name, self.text_key, tally)


# ---------------------------------------------------------------- default corpus


def stdlib_files() -> list[str]:
  root = sysconfig.get_paths()['stdlib']
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith('.py'))
  return files


def docstrings_of(path: str) -> Iterator[str]:
  """The module, class and function docstrings of one Python file (none if it does not parse)."""
  try:
    with open(path, 'rb') as f:
      tree = ast.parse(f.read(), filename=path)
  except (SyntaxError, ValueError, OSError):
    return  # A few files target other Python versions; skip them.
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=True)
      if doc and doc.strip():
        yield doc.strip()


def stdlib_docstrings() -> Iterator[str]:
  """Every module, class and function docstring of the standard library, in StdlibSource's
  order: from the cache when a whole read has filled it, else parsed as they are taken."""
  files = stdlib_files()
  table = _docstring_table(tuple(files), _stat_digest(files), build=False)
  for path in files:
    yield from table[path] if table is not None else docstrings_of(path)


def docstring_cache(digest: str) -> str:
  """The cache file of the docstrings of the stdlib files whose _stat_digest is `digest`."""
  version = '.'.join(map(str, sys.version_info[:3]))
  return os.path.join(paths.cache_root(), 'corpus', f'stdlib-docstrings-{version}-{digest}.json')


@functools.lru_cache(maxsize=1)
def _docstring_table(files: tuple[str, ...], digest: str,
                     build: bool) -> dict[str, list[str]] | None:
  """{file: its docstrings} for the stdlib `files` whose _stat_digest is `digest`: read from
  the cache, else (with `build`) parsed and written there; None without `build` and a cache.

  A file of the cache is written whole under a temporary name, then renamed, so processes
  that fill it at once each see a complete one; a cache that cannot be read or written is
  passed over (it only saves time).
  """
  path = docstring_cache(digest)
  try:
    with open(path, encoding='utf-8') as f:
      table = json.load(f)
    if sorted(table) == sorted(files):
      return table
  except (OSError, ValueError):
    pass
  if not build:
    return None
  table = {file: list(docstrings_of(file)) for file in files}
  partial = f'{path}.{os.getpid()}.tmp'
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(partial, 'w', encoding='utf-8') as f:
      json.dump(table, f)
    os.replace(partial, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.remove(partial)
  return table


# ---------------------------------------------------------------- resolving


def _expand(spec: str) -> tuple[list[str], str, str]:
  """(files, tally key, reason) for one path, directory or glob; key set iff no files.

  A directory written by `datasets.Dataset.save_to_disk` is one input, itself.
  """
  path = paths.expand(spec)
  if any(ch in spec for ch in '*?['):
    return paths.glob(path), 'empty_glob', 'the glob matches no files'
  if paths.isfile(path):
    return [path], '', ''
  if paths.isdir(path):
    if arrow_source.is_dataset_dir(path) or mds_source.is_mds_dir(path):
      return [path], '', ''
    return paths.walk_files(path), 'empty_dir', 'the directory is empty'
  return [], 'missing', 'no such file or directory'


def resolve_files(corpus: str, field: str = 'config.data.corpus') -> tuple[list[str], Tally]:
  """The files (and `datasets` directories) named by comma-separated paths, directories and
  globs, in order.

  Names that give no file are skipped and counted; raises CorpusError if none
  gives any.
  """
  tally, files, seen = Tally(), [], set()
  for spec in (s.strip() for s in corpus.split(',')):
    if not spec:
      continue
    found, key, reason = _expand(spec)
    if not found:
      tally.skip(spec, key, reason)
    for path in found:
      if path not in seen:
        seen.add(path)
        files.append(path)
  if not files:
    reasons = '; '.join(f'{s["input"]!r}: {s["reason"]}' for s in tally.skipped)
    raise CorpusError(f'{field}={corpus!r} names no files ({reasons}). Give paths, '
                      'directories or globs of .txt/.jsonl(.gz) or .parquet files or '
                      'datasets directories, or leave it empty for the default corpus.')
  return files, tally


def _group(files: list[str], sizes: list[int], unit_bytes: int,
           document_split: str = 'file') -> list[Unit]:
  """Consecutive files in units of about `unit_bytes`; a bigger file cut into byte ranges."""
  units, current, size = [], [], 0
  for path, n in zip(files, sizes):
    cuts = _cuts(path, n, unit_bytes, document_split) if n > unit_bytes else []
    if cuts:
      if current:
        units.append(Unit(files=tuple(current)))
        current, size = [], 0
      bounds = [0] + cuts + [n]
      units.extend(Unit(files=(path,), start=a, stop=b, kind='bytes')
                   for a, b in zip(bounds, bounds[1:]))
      continue
    current.append(path)
    size += n
    if size >= unit_bytes:
      units.append(Unit(files=tuple(current)))
      current, size = [], 0
  if current:
    units.append(Unit(files=tuple(current)))
  return units


# Where a document may end: after a line end (.jsonl) or after a blank line,
# whose bytes are a line end, the whitespace of _BLANK, and a line end.
_JSONL_BOUNDARY = re.compile(rb'\n')
_BLANK_LINE_BOUNDARY = re.compile(rb'\n[ \t\r\f\v]*\n')


def _cuts(path: str, size: int, unit_bytes: int, document_split: str) -> list[int]:
  """Byte offsets in (0, size) where a big file is cut into units; [] to keep it whole.

  The nominal cuts k * unit_bytes, each moved to just after the first
  document boundary found from it within unit_bytes (none found: no cut
  there); compressed files (no random access) and one-document files are not
  cut. Any boundary serves: the cuts depend only on the file and unit_bytes.
  """
  if path.endswith('.gz'):
    return []
  if _is_jsonl(path):
    boundary = _JSONL_BOUNDARY
  elif document_split == 'blank_line':
    boundary = _BLANK_LINE_BOUNDARY
  else:
    return []
  cuts: list[int] = []
  try:
    with paths.open_binary(path) as f:
      for nominal in range(unit_bytes, size, unit_bytes):
        if cuts and cuts[-1] >= nominal:
          continue
        end = _boundary_end(f, boundary, nominal - 1, min(size, nominal + unit_bytes))
        if end is not None and end < size:
          cuts.append(end)
  except OSError:
    return []  # Unreadable here: the reader reports it.
  return cuts


def _boundary_end(f, boundary: re.Pattern, start: int, stop: int,
                  block: int = 1 << 20) -> int | None:
  """Where the first boundary within bytes [start, stop) of f ends; read 1 MiB at a time."""
  pos = start
  while pos < stop:
    f.seek(pos)
    data = f.read(min(block, stop - pos))
    if not data:
      return None
    found = boundary.search(data)
    if found is not None:
      return pos + found.end()
    if pos + len(data) >= stop:
      return None
    # A boundary across the end of the block starts at its last line end.
    last = data.rfind(b'\n')
    pos += last if last > 0 else len(data)
  return None


def resolve(data: ml_collections.ConfigDict) -> Corpus:
  """The corpus that `config.data` names (one corpus, or a mixture), split into units of work."""
  if data.get('sources'):
    return _resolve_mixture(data)
  return _resolve_one(data)


def _resolve_one(data: ml_collections.ConfigDict, field: str = 'config.data') -> Corpus:
  """The corpus of data.corpus or data.tfds_name (or the default); `field` names the section."""
  ids_key = data.get('ids_key', '')
  if data.get('tfds_name'):
    return _resolve_tfds(data, field)
  if not data.corpus:
    source = StdlibSource()
    description = {'source': 'python-stdlib-docstrings', 'python': sys.version.split()[0],
                   'files': len(source.files), 'digest': _stat_digest(source.files)}
    return Corpus(source.name, [source], source.units(), description, Tally(),
                  split_rule='docstring')
  name = f'{field}.corpus={data.corpus!r}'
  files, tally = resolve_files(data.corpus, f'{field}.corpus')
  tables = [f for f in files if arrow_source.is_table(f)]
  mds = [f for f in files if mds_source.is_mds(f)]
  texts = [f for f in files if f not in tables and f not in mds]
  if ids_key and texts:
    raise CorpusError(f'{field}.ids_key={ids_key!r} reads token ids from parquet files or '
                      f'datasets directories, but {name} also names the text file {texts[0]}; '
                      'give token ids and text as separate corpora.')
  sources: list[sources_lib.Source] = []
  if texts:
    sources.append(FileSource(name, texts, data.document_split, data.text_key))
  if tables:
    sources.append(arrow_source.TableSource(name, tables, data.text_key, ids_key, field,
                                            UNIT_BYTES, PIECE_CHARS))
  if mds:
    sources.append(mds_source.MdsSource(name, mds, data.text_key, ids_key, UNIT_BYTES,
                                        PIECE_CHARS))
  identities = [f for path in files for f in (
      mds_source.data_files(path) if path in mds else arrow_source.data_files(path))]
  description = {'source': data.corpus, 'files': len(identities),
                 'digest': _stat_digest(identities)}
  if ids_key:
    description['ids_key'] = ids_key
  elif tables or mds or any(_is_jsonl(f) for f in files):
    description['text_key'] = data.text_key
  return Corpus(name, sources, _units(sources), description, tally,
                split_rule=data.document_split if texts else 'record')


def _units(sources: list[sources_lib.Source]) -> list[Unit]:
  return [dataclasses.replace(u, source=i) for i, s in enumerate(sources) for u in s.units()]


def _resolve_mixture(data: ml_collections.ConfigDict) -> Corpus:
  """Every member of config.data.sources resolved; their sources and units one after another."""
  sources, parts, tally, described = [], [], Tally(), []
  for k, member in enumerate(mixture.members(data)):
    try:
      part = _resolve_one(member.data, f'config.data.sources[{k}]')
    except CorpusError as e:
      raise CorpusError(f'config.data.sources[{k}] ({member.name}): {e}') from None
    sources += part.sources
    parts += [k] * len(part.sources)
    tally.add(part.tally.to_json())
    described.append({'corpus': part.description, 'document_split': part.split_rule})
  return Corpus('config.data.sources', sources, _units(sources), {'mixture': described}, tally,
                split_rule='per source', parts=parts)


def _stat_digest(files: list[str]) -> str:
  h = hashlib.sha256()
  for path in files:
    h.update(json.dumps(paths.identity(path)).encode())
  return h.hexdigest()[:16]


def _resolve_tfds(data: ml_collections.ConfigDict, field: str = 'config.data') -> Corpus:
  name = f'{field}.tfds_name={data.tfds_name!r}'
  data_dir = os.path.expanduser(data.tfds_data_dir) if data.tfds_data_dir else None
  try:
    source = tfds_source.open_split(data.tfds_name, data.split, data_dir,
                                    f'{name}, {field}.split={data.split!r}',
                                    f'{field}.tfds_data_dir')
  except tfds_source.TfdsError as e:
    raise CorpusError(str(e)) from None
  info = source.dataset_info
  if data.text_key not in info.features.keys():
    raise CorpusError(f'{name} has no feature {field}.text_key={data.text_key!r}; its '
                      f'features are {sorted(info.features.keys())}.')
  description = {'source': 'tfds', 'name': info.full_name, 'split': data.split,
                 'data_dir': os.path.abspath(data_dir) if data_dir else '',
                 'records': len(source), 'text_key': data.text_key}
  tfds_reader = TfdsSource(name, source, data.text_key)
  return Corpus(name, [tfds_reader], _units([tfds_reader]), description, Tally(),
                split_rule='record')


def check(data: ml_collections.ConfigDict, field: str = 'config.data') -> None:
  """Cheap early check that the corpus options name something readable; raises CorpusError.

  A parquet file or datasets directory must hold the column named by
  text_key (or ids_key): the first one's schema is read.
  """
  if data.get('ids_key') and not data.corpus:
    raise CorpusError(f'{field}.ids_key={data.ids_key!r} reads token ids from parquet files or '
                      f'datasets directories: name them in {field}.corpus.')
  if data.get('tfds_name'):
    if data.corpus:
      raise CorpusError(f'{field}.corpus and {field}.tfds_name are both set; '
                        'set one of them.')
  elif data.corpus:
    files, _ = resolve_files(data.corpus, f'{field}.corpus')
    tables = [f for f in files if arrow_source.is_table(f)]
    if tables:
      arrow_source.check_column(tables[0], data.text_key, data.get('ids_key', ''), field)
    mds = [f for f in files if mds_source.is_mds(f)]
    if mds:
      mds_source.check_column(mds[0], data.text_key, data.get('ids_key', ''))


# ---------------------------------------------------------------- reading


def _is_jsonl(path: str) -> bool:
  return path.removesuffix('.gz').endswith('.jsonl')


def _open_binary(path: str, byte_range: tuple[int, int] | None = None):
  if byte_range is not None:
    return io.BufferedReader(_ByteRange(path, *byte_range))
  if not path.endswith('.gz'):
    return paths.open_binary(path)
  if not paths.is_url(path):
    return gzip.open(path, 'rb')
  raw = paths.open_binary(path)
  unzipped = gzip.GzipFile(fileobj=raw, mode='rb')
  unzipped.myfileobj = raw  # Closed with it, as when GzipFile opens a file by name.
  return unzipped


class _ByteRange(io.RawIOBase):
  """Bytes [start, stop) of a file as a raw stream (read from start, never before or past)."""

  def __init__(self, path: str, start: int, stop: int):
    super().__init__()
    self._file = paths.open_binary(path)
    self._file.seek(start)
    self._left = stop - start

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    n = min(len(buffer), self._left)
    if n <= 0:
      return 0
    got = self._file.readinto(memoryview(buffer)[:n]) or 0
    self._left -= got
    return got

  def close(self) -> None:
    self._file.close()
    super().close()


class _Utf8Counted(io.RawIOBase):
  """A binary stream read through unchanged, counting its bytes that are not valid UTF-8.

  `invalid_bytes`: how many of the bytes read so far Python's 'replace'
  decoding turns into U+FFFD (one U+FFFD per invalid sequence, of 1 to 3
  bytes). Each reading of a file owns one, so no count is shared.
  """

  def __init__(self, raw: io.IOBase):
    super().__init__()
    self._raw = raw
    self._pending = b''  # The start of a character not read whole yet.
    self.invalid_bytes = 0

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    n = self._raw.readinto(buffer)
    view = memoryview(buffer)
    # In small blocks, so that an ASCII block (most of them, in most text)
    # is only looked at, not decoded.
    for start in range(0, n, 4096):
      self._check(view[start:min(start + 4096, n)], final=False)
    if not n:
      self._check(b'', final=True)
    return n

  def _check(self, block, final: bool) -> None:
    data = self._pending + block
    if data.isascii():
      self._pending = b''
      return
    try:
      _, used = codecs.utf_8_decode(data, 'strict', final)
    except UnicodeDecodeError:
      text, used = codecs.utf_8_decode(data, 'surrogateescape', final)
      # Each invalid byte became one lone surrogate, which valid UTF-8 never
      # gives and encoding with 'ignore' drops.
      self.invalid_bytes += used - len(text.encode('utf-8', 'ignore'))
    self._pending = data[used:]

  def close(self) -> None:
    self._raw.close()
    super().close()


def _text_pieces(f: io.TextIOBase, document_split: str,
                 long_docs: list[int]) -> Iterator[tuple[bool, str]]:
  doc = sources_lib.Pieces(PIECE_CHARS)
  for line in iter(functools.partial(f.readline, PIECE_CHARS), ''):
    if document_split == 'blank_line' and not line.strip(_BLANK):
      yield from doc.end()
      long_docs[0] += doc.num_pieces > 1
      doc = sources_lib.Pieces(PIECE_CHARS)
    else:
      yield from doc.add(line)
  yield from doc.end()
  long_docs[0] += doc.num_pieces > 1


def _jsonl_pieces(f: io.TextIOBase, name: str, text_key: str, tally: Tally,
                  long_docs: list[int]) -> Iterator[tuple[bool, str]]:
  lineno = 0
  while line := f.readline(MAX_RECORD_CHARS):
    lineno += 1
    if len(line) >= MAX_RECORD_CHARS and not line.endswith('\n'):
      while line and not line.endswith('\n'):  # Drop the rest of the line unread.
        line = f.readline(MAX_RECORD_CHARS)
      tally.skip_line(name, 'long_record', lineno, f'line over {MAX_RECORD_CHARS:,} characters')
      continue
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError:
      tally.skip_line(name, 'not_json', lineno, 'line is not JSON')
      continue
    text = record.get(text_key) if isinstance(record, dict) else None
    if not isinstance(text, str):
      tally.skip_line(name, 'missing_key', lineno, f'no string field {text_key!r}')
      continue
    doc = sources_lib.Pieces(PIECE_CHARS)
    yield from doc.add(text)
    yield from doc.end()
    long_docs[0] += doc.num_pieces > 1


def _file_pieces(path: str, document_split: str, text_key: str, tally: Tally,
                 byte_range: tuple[int, int] | None = None) -> Iterator[tuple[bool, str]]:
  """The pieces of one file, or of its bytes [start, stop) (a unit of a big file).

  Skips the file (counted, by its first range) if it is empty, binary or
  unreadable. What a range repairs or skips is reported under the file's
  name with the range; jsonl line numbers then count from the range's start.
  """
  first_range = byte_range is None or byte_range[0] == 0
  name = path if byte_range is None else f'{path} (bytes {byte_range[0]:,}-{byte_range[1]:,})'
  try:
    with _open_binary(path) as f:
      head = f.read(_SNIFF_BYTES)
  except (OSError, EOFError, zlib.error) as e:  # Each range: the file may vanish mid-run.
    tally.skip(name, 'read_error', f'cannot read: {e}')
    return
  if not head:
    tally.skip(path, 'empty', 'empty file')
    return
  if b'\0' in head:
    if first_range:
      tally.skip(path, 'binary', f'binary (NUL bytes in the first {_SNIFF_BYTES} bytes)')
    return
  long_docs, num_docs, newlines, counted = [0], 0, None, None
  try:
    counted = _Utf8Counted(_open_binary(path, byte_range))
    with io.TextIOWrapper(io.BufferedReader(counted, buffer_size=1 << 20), encoding='utf-8',
                          errors='replace', newline=None) as f:
      pieces = (_jsonl_pieces(f, name, text_key, tally, long_docs) if _is_jsonl(path)
                else _text_pieces(f, document_split, long_docs))
      for first, piece in pieces:
        num_docs += first
        yield first, piece
      newlines = f.newlines
  except (OSError, EOFError, zlib.error) as e:
    tally.skip(name, 'read_error', f'read error after {num_docs} documents (kept): {e}')
  invalid = counted.invalid_bytes if counted is not None else 0
  if num_docs and first_range:
    tally.counts['files_used'] += 1
  elif first_range and not any(s['input'] == name for s in tally.skipped):
    tally.skip(name, 'no_text', 'no text (only whitespace)')
  if invalid:
    tally.repair(name, 'invalid_utf8_files', f'invalid UTF-8: {invalid} bytes replaced by U+FFFD')
    tally.counts['invalid_utf8_bytes'] += invalid
  if newlines and '\r\n' in newlines and first_range:
    tally.repair(path, 'crlf_files', 'Windows (CRLF) line endings read as newlines')
  if long_docs[0]:
    tally.repair(name, 'long_documents', f'documents over {PIECE_CHARS:,} characters read and '
                 'tokenized in pieces', long_docs[0])


def _tfds_pieces(source, unit: Unit, name: str, text_key: str,
                 tally: Tally) -> Iterator[tuple[bool, str]]:
  long_docs = invalid = 0
  for i in range(unit.start, unit.stop):
    text = source[i][text_key]
    if isinstance(text, bytes):
      text, bad = sources_lib.decode_utf8(text)
      invalid += bad
    doc = sources_lib.Pieces(PIECE_CHARS)
    yield from doc.add(text)
    yield from doc.end()
    long_docs += doc.num_pieces > 1
  label = f'{name}[{unit.start}:{unit.stop}]'
  if invalid:
    tally.repair(label, 'invalid_utf8_files', f'invalid UTF-8: {invalid} bytes replaced by U+FFFD')
    tally.counts['invalid_utf8_bytes'] += invalid
  if long_docs:
    tally.repair(label, 'long_documents', f'documents over {PIECE_CHARS:,} characters read and '
                 'tokenized in pieces', long_docs)


def check_config(data: ml_collections.ConfigDict, check_paths: bool = True) -> None:
  """ConfigError for an invalid text source in config.data, one corpus or each member of a
  mixture (and, if asked, a missing one)."""
  mixture.check_config(data)
  sections = [(f'config.data.sources[{k}]', m.data) for k, m in enumerate(mixture.members(data))]
  for field, section in sections or [('config.data', data)]:
    one_of(field.removeprefix('config.'), 'document_split', section.document_split,
           DOCUMENT_SPLITS)
    require(bool(section.text_key),
            f"{field}.text_key is empty; name the text field, e.g. 'text'.")
    if check_paths:
      try:
        check(section, field)
      except CorpusError as e:
        raise ConfigError(str(e)) from None


def uses_token_ids(data: ml_collections.ConfigDict) -> bool:
  """Whether config.data (or a member of its mixture) reads pre-tokenized ids."""
  return any(m.data.ids_key for m in mixture.members(data)) or bool(data.get('ids_key'))
