"""Where text comes from: the embedded default corpus or the user's files.

The default corpus exists on every machine with Python: the docstrings of the
standard library (~1.6 MB of English technical prose), read with `ast` from
the source files, never by importing the modules. Each docstring is one
document.

User corpora are plain-text files given as a path, a directory or a glob;
each file is split into documents at blank lines (`document_split=
'blank_line'`) or is one document (`'file'`).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from collections.abc import Iterator

# Standard-library folders that are tests, third-party code or tooling rather
# than documentation.
_SKIP_DIRS = frozenset({'site-packages', 'dist-packages', 'test', 'tests',
                        'idlelib', 'lib2to3', '__pycache__', 'turtledemo'})
_BLANK_LINE = re.compile(r'\n[ \t\r\f\v]*\n')


class CorpusError(ValueError):
  """The corpus option does not name any usable text."""


def stdlib_files() -> list[str]:
  root = sysconfig.get_paths()['stdlib']
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith('.py'))
  return files


def stdlib_docstrings() -> Iterator[str]:
  """Every module, class and function docstring of the standard library."""
  for path in stdlib_files():
    try:
      with open(path, 'rb') as f:
        tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, OSError):
      continue  # A few files target other Python versions; skip them.
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                           ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
          yield doc.strip()


def resolve_files(spec: str) -> list[str]:
  """The sorted text files named by a path, a directory or a glob."""
  if any(ch in spec for ch in '*?['):
    files = sorted(p for p in glob.glob(os.path.expanduser(spec), recursive=True)
                   if os.path.isfile(p))
    if not files:
      raise CorpusError(f'config.data.corpus={spec!r}: the glob matches no files.')
    return files
  path = os.path.expanduser(spec)
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    if not files:
      raise CorpusError(f'config.data.corpus={spec!r}: the directory is empty.')
    return files
  raise CorpusError(f'config.data.corpus={spec!r}: no such file or directory. '
                    'Give a path, a directory or a glob of .txt files, or leave '
                    'it empty for the default corpus.')


def file_documents(path: str, document_split: str) -> Iterator[str]:
  # Invalid bytes are replaced rather than dropping the file.
  with open(path, encoding='utf-8', errors='replace', newline=None) as f:
    text = f.read()
  if document_split == 'file':
    parts = [text]
  else:
    parts = _BLANK_LINE.split(text)
  for part in parts:
    part = part.strip()
    if part:
      yield part


def documents(corpus: str, document_split: str = 'blank_line') -> Iterator[str]:
  """All documents of the corpus, in a fixed order."""
  if not corpus:
    yield from stdlib_docstrings()
    return
  for path in resolve_files(corpus):
    yield from file_documents(path, document_split)


def describe(corpus: str) -> dict:
  """A cheap identity of the corpus: changes when its files change."""
  if not corpus:
    files = stdlib_files()
    return {
        'source': 'python-stdlib-docstrings',
        'python': sys.version.split()[0],
        'files': len(files),
        'digest': _stat_digest(files),
    }
  files = resolve_files(corpus)
  return {'source': corpus, 'files': len(files), 'digest': _stat_digest(files)}


def _stat_digest(files: list[str]) -> str:
  h = hashlib.sha256()
  for path in files:
    st = os.stat(path)
    h.update(json.dumps([os.path.abspath(path), st.st_size, st.st_mtime_ns]).encode())
  return h.hexdigest()[:16]
