"""The interface every corpus source implements, and what sources share.

A source is one kind of input: text and jsonl files (corpus.FileSource), the
default corpus (corpus.StdlibSource), a tfds split (corpus.TfdsSource),
parquet files and `datasets` directories (arrow_source), MDS directories
(mds_source). Each one

  - cuts itself into units of work (`units`): whole files, a byte range of a
    big file, a range of records, of parquet row groups or of Arrow record
    batches are kinds of unit, each read by the source that made it;
  - reads a unit's documents (`read`): (starts a document, piece) pairs, a
    piece being text (a document longer than PIECE_CHARS comes in several)
    or, from a pre-tokenized column, a whole document's token ids (`Ids`);
  - says what it skipped or repaired and why, in a `Tally`.

Prepare (data/prepare.py) sees only this interface: a corpus is a list of
sources and their units in reading order.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator

import numpy as np


# What a Unit covers (Unit.kind).
UNIT_KINDS = ('files', 'bytes', 'records', 'row_groups', 'batches', 'shards')


@dataclasses.dataclass(frozen=True)
class Unit:
  """A slice of a source that one worker reads.

  kind 'files': `files` whole; 'bytes': bytes [start, stop) of files[0];
  'records': records [start, stop) of the source (a tfds split); 'row_groups':
  parquet row groups [start, stop) of files[0]; 'batches': Arrow record
  batches [start, stop) of files[0]; 'shards': the shards [start, stop) of the MDS
  directory files[0]. `source`: the index of the source that
  reads it in its corpus.
  """
  files: tuple[str, ...] = ()
  start: int = 0
  stop: int = 0
  kind: str = 'files'
  source: int = 0

  @property
  def byte_range(self) -> tuple[int, int] | None:
    return (self.start, self.stop) if self.kind == 'bytes' else None


@dataclasses.dataclass(frozen=True)
class Ids:
  """A pre-tokenized document: its token ids [n] and where it was read (named in errors)."""
  ids: np.ndarray
  where: str


Piece = tuple[bool, 'str | Ids']



def decode_utf8(data: bytes) -> tuple[str, int]:
  """`data` decoded as Python's 'replace' decodes it, and how many of its bytes were invalid."""
  try:
    return data.decode('utf-8'), 0
  except UnicodeDecodeError:
    # Each invalid byte becomes one lone surrogate, which valid UTF-8 never
    # gives and encoding with 'ignore' drops.
    escaped = data.decode('utf-8', 'surrogateescape')
    return data.decode('utf-8', 'replace'), len(data) - len(escaped.encode('utf-8', 'ignore'))


class Pieces:
  """Cuts one document into stripped pieces of at most `piece_chars`, at whitespace."""

  def __init__(self, piece_chars: int):
    self._piece_chars = piece_chars
    self._buf: list[str] = []
    self._len = 0
    self.num_pieces = 0

  def add(self, text: str) -> Iterator[tuple[bool, str]]:
    size = self._piece_chars
    self._buf.append(text)
    self._len += len(text)
    if self._len >= size:
      text = ''.join(self._buf)
      while len(text) >= size:
        cut = max(text.rfind(' ', 0, size), text.rfind('\n', 0, size))
        if cut < size // 2:
          cut = size  # No whitespace near the end: cut mid-word.
        yield from self._emit(text[:cut])
        text = text[cut:]
      self._buf, self._len = [text], len(text)

  def end(self) -> Iterator[tuple[bool, str]]:
    """The last piece; then the builder is ready for the next document."""
    yield from self._emit(''.join(self._buf))
    self._buf, self._len = [], 0

  def _emit(self, text: str) -> Iterator[tuple[bool, str]]:
    text = text.strip()
    if text:
      yield self.num_pieces == 0, text
      self.num_pieces += 1


def document(text: str, piece_chars: int) -> tuple[list[tuple[bool, str]], bool]:
  """A whole document's pieces, and whether it was long enough to need several."""
  doc = Pieces(piece_chars)
  pieces = [*doc.add(text), *doc.end()]
  return pieces, doc.num_pieces > 1


class Tally:
  """Counts of skipped and repaired input, and which inputs they were.

  `counts` keys, always present: files_used; missing, empty_glob, empty_dir
  (named by the config but holding no file); empty, binary, no_text,
  read_error (files skipped, or cut short by a read error); not_json,
  missing_key, long_record (jsonl lines skipped); invalid_utf8_files,
  invalid_utf8_bytes, crlf_files, long_documents (used after repair). Only
  when they occur: null_value, not_text (table rows and columns skipped).
  """

  KEYS = ('files_used', 'missing', 'empty_glob', 'empty_dir', 'empty', 'binary', 'no_text',
          'read_error', 'not_json', 'missing_key', 'long_record', 'invalid_utf8_files',
          'invalid_utf8_bytes', 'crlf_files', 'long_documents')

  def __init__(self):
    self.counts = dict.fromkeys(self.KEYS, 0)
    self.skipped: list[dict] = []  # {'input', 'reason', 'count'?, 'lines'? or 'rows'?}
    self.repaired: list[dict] = []  # {'input', 'reason', 'count'}
    self._lines: dict[tuple[str, str], dict] = {}

  def count(self, key: str, n: int = 1) -> None:
    self.counts[key] = self.counts.get(key, 0) + n

  def skip(self, name: str, key: str, reason: str) -> None:
    self.count(key)
    self.skipped.append({'input': name, 'reason': reason})

  def skip_line(self, name: str, key: str, lineno: int, reason: str,
                where: str = 'lines') -> None:
    """A skipped jsonl line (or table row, where='rows'): one entry per (file, reason) with a
    count and the first ten line (row) numbers."""
    self.count(key)
    entry = self._lines.get((name, key))
    if entry is None:
      entry = self._lines[name, key] = {'input': name, 'reason': reason, 'count': 0, where: []}
      self.skipped.append(entry)
    entry['count'] += 1
    if len(entry[where]) < 10:
      entry[where].append(lineno)

  def repair(self, name: str, key: str, reason: str, count: int = 1) -> None:
    self.count(key, count)
    self.repaired.append({'input': name, 'reason': reason, 'count': count})

  def to_json(self) -> dict:
    return {'counts': dict(self.counts), 'skipped': list(self.skipped),
            'repaired': list(self.repaired)}

  def add(self, other: dict) -> None:
    """Adds a `to_json()` of another tally (e.g. of one unit of work)."""
    for k, v in other['counts'].items():
      self.count(k, v)
    self.skipped += other['skipped']
    self.repaired += other['repaired']


class Source(abc.ABC):
  """One kind of input, cut into units and read unit by unit (in worker processes: it pickles).

  `name`: how the config named it, for messages.
  """

  name: str
  # Whether read() gives token ids (Ids) rather than text.
  pretokenized: bool = False

  @abc.abstractmethod
  def units(self) -> list[Unit]:
    """The source's units of work, in reading order (their `source` field left 0)."""

  @abc.abstractmethod
  def read(self, unit: Unit, tally: Tally) -> Iterator[Piece]:
    """(starts a document, text or Ids) for every piece of every document of `unit`, in order;
    what was skipped or repaired, and why, is counted in `tally`."""
