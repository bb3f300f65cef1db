"""Paths of corpora and data dirs: local files, or bucket URLs through etils.epath.

A local path (or `~/...`) is read with the standard library, as it always
was; a URL (gs://, s3://, az://, hf://) goes through `etils.epath`, which
tfds already brings, and its fsspec back end: it works wherever that
back end's library is installed (gcsfs for gs://, s3fs for s3://, adlfs for
az://). This module is epath's one home in mlm_jax: corpus readers, the
parquet and Arrow readers and the data dir ask it to list, stat and open.
"""

from __future__ import annotations

import glob as glob_lib
import os
import re
import shutil
from collections.abc import Sequence
from typing import IO

# A URL scheme epath reads (gs://, s3://, ...); anything else is a local path.
_URL = re.compile(r'^[a-z][a-z0-9+.-]*://')


def is_url(path: str) -> bool:
  return bool(_URL.match(path))


def _epath(path: str):
  from etils import epath  # pylint: disable=import-outside-toplevel  # Only URLs pay for it.
  return epath.Path(path)


def expand(path: str) -> str:
  """`~` expanded for a local path; a URL as it is."""
  return path if is_url(path) else os.path.expanduser(path)


def absolute(path: str) -> str:
  return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def isfile(path: str) -> bool:
  if is_url(path):
    p = _epath(path)
    return p.exists() and not p.is_dir()
  return os.path.isfile(path)


def isdir(path: str) -> bool:
  return _epath(path).is_dir() if is_url(path) else os.path.isdir(path)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_url(path) else os.path.exists(path)


def join(path: str, *names: str) -> str:
  return '/'.join([path.rstrip('/'), *names]) if is_url(path) else os.path.join(path, *names)


def glob(pattern: str) -> list[str]:
  """Files matching a glob, sorted (a local glob's ** is recursive; a URL's is not)."""
  if not is_url(pattern):
    return sorted(p for p in glob_lib.glob(pattern, recursive=True) if os.path.isfile(p))
  scheme, rest = pattern.split('://', 1)
  bucket, _, inside = rest.partition('/')
  root = _epath(f'{scheme}://{bucket}')
  return sorted(os.fspath(p) for p in root.glob(inside) if not p.is_dir())


def walk_files(directory: str) -> list[str]:
  """Every file under a directory, recursively, sorted."""
  if not is_url(directory):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs)
  scheme = directory.split('://', 1)[0]
  out = []
  for folder, _, files in _epath(directory).walk():
    folder = os.fspath(folder)  # fsspec's walk may leave the scheme out.
    folder = folder if is_url(folder) else f'{scheme}://{folder.lstrip("/")}'
    out += [join(folder, f) for f in files]
  return sorted(out)


def size(path: str) -> int:
  return _epath(path).stat().length if is_url(path) else os.path.getsize(path)


def cache_root() -> str:
  """$MLM_JAX_CACHE, else ~/.cache/mlm_jax: where default data dirs, bucket copies and the
  default corpus's parsed docstrings go."""
  return os.environ.get('MLM_JAX_CACHE', os.path.join(os.path.expanduser('~'), '.cache', 'mlm_jax'))


def identity(path: str) -> list:
  """[absolute path, size, modification time]: what a corpus's fingerprint keeps of a file.

  Local files give the nanosecond mtime, as data dirs always recorded it; a
  URL gives what its store reports.
  """
  if is_url(path):
    st = _epath(path).stat()
    return [path, st.length, st.mtime]
  st = os.stat(path)
  return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def open_binary(path: str) -> IO[bytes]:
  """A file opened for reading bytes (seekable, for byte ranges and parquet footers)."""
  return _epath(path).open('rb') if is_url(path) else open(path, 'rb')


def open_write(path: str) -> IO[bytes]:
  """A file opened for writing bytes, its folders made first (a no-op in a bucket)."""
  if is_url(path):
    target = _epath(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.open('wb')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return open(path, 'wb')


def copy_tree(src: str, dst: str, last: Sequence[str] = ()) -> None:
  """Every file under `src` to the same place under `dst` (either may be a URL); the files
  named in `last` (relative paths) are copied after all others, so that their presence
  marks a complete copy."""
  files = walk_files(src)
  rel = {f: f[len(src.rstrip('/')) + 1:] for f in files}
  for f in sorted(files, key=lambda f: rel[f] in last):
    with open_binary(f) as reader, open_write(join(dst, *rel[f].split(os.sep))) as writer:
      shutil.copyfileobj(reader, writer, 1 << 24)


def read_text(path: str) -> str:
  with open_binary(path) as f:
    return f.read().decode('utf-8')
