"""Shell words: quoting as bash's `printf %q` does, for printed and remote command lines.

The launchers print each command as one line of shell words (a dry run is a
script a user can read or paste) and hand the TPU workers command lines that
their bash parses once more; both must survive spaces, globs and quotes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Words made only of these characters are printed as they are.
_PLAIN_WORD = re.compile(r'[-A-Za-z0-9_./:=,+@%]+')
# Characters bash's printf %q escapes with a backslash anywhere in a word.
_BACKSLASHED = frozenset(' !"$&\'()*,;<>?[\\]^`{|}')
# Escapes inside $'...' for the characters that have a letter.
_ANSI_C = {'\x1b': 'E', '\a': 'a', '\b': 'b', '\f': 'f', '\n': 'n', '\r': 'r', '\t': 't',
           '\v': 'v', '\\': '\\', "'": "'"}


def quote(word: str) -> str:
  """`word` as bash 5's printf %q writes it in a UTF-8 locale."""
  if not word:
    return "''"
  if any(_unprintable(c) for c in word):
    return _ansi_c_quote(word)
  return _backslash_quote(word)


def quote_words(words: Iterable[str]) -> str:
  """The words as one shell line, quoting only those that need it."""
  return ' '.join(w if _PLAIN_WORD.fullmatch(w) else quote(w) for w in words)


def remote_path(path: str) -> str:
  """`path` quoted for the workers' shell, leaving a leading ~ for it to expand."""
  if path == '~':
    return '~'
  if path.startswith('~/'):
    return '~/' + quote(path[2:])
  return quote(path)


def _unprintable(c: str) -> bool:
  # Control characters, and bytes that were not UTF-8 (kept as surrogates).
  code = ord(c)
  return code < 0x20 or code == 0x7f or 0xdc80 <= code <= 0xdcff


def _ansi_c_quote(word: str) -> str:
  parts = []
  for c in word:
    if c in _ANSI_C:
      parts.append('\\' + _ANSI_C[c])
    elif _unprintable(c):
      parts.append(f'\\{ord(c) & 0xff:03o}')
    else:
      parts.append(c)
  return "$'" + ''.join(parts) + "'"


def _backslash_quote(word: str) -> str:
  parts = []
  for i, c in enumerate(word):
    # '#' starts a comment only at the start of a word; '~' expands there and
    # after ':' or '=' (as in PATH=~/bin).
    if (c in _BACKSLASHED or (c == '#' and i == 0)
        or (c == '~' and (i == 0 or word[i - 1] in ':='))):
      parts.append('\\')
    parts.append(c)
  return ''.join(parts)
