"""The tokenizer seam's factory: where a tokenizer comes from (`load`, `train`) and its config.

Two implementations, both of the interface in tokenizer_base:
  sp_tokenizer.SentencePieceTokenizer  sentencepiece, trained here (the default) or a
                                       `.model` written by mlm_jax;
  hf_tokenizer.HFTokenizer             Hugging Face `tokenizers`: any `tokenizer.json`
                                       (BERT's WordPiece, RoBERTa's and ModernBERT's
                                       byte-level BPE, XLM-R's unigram), a WordPiece
                                       `vocab.txt`, or WordPiece / byte-level BPE trained here.

The interface's names (`Tokenizer`, `Specials`, `ROLES`, `sanitize`,
`model_vocab_size`, `padded_vocab_size`, ...) are importable from here too:
the rest of mlm_jax imports this one module. A tokenizer is stored in a
directory (a data dir, a workdir, an export) by `Tokenizer.save` and read
back by `load`; every path may be a bucket URL (data/paths.py).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable

import ml_collections

from mlm_jax.data import hf_tokenizer
from mlm_jax.data import paths
from mlm_jax.data import sp_tokenizer
from mlm_jax.data.tokenizer_base import ROLES
from mlm_jax.data.tokenizer_base import SPECIAL_TOKENS
from mlm_jax.data.tokenizer_base import Specials
from mlm_jax.data.tokenizer_base import Tokenizer
from mlm_jax.data.tokenizer_base import VOCAB_MULTIPLE
from mlm_jax.data.tokenizer_base import model_vocab_size
from mlm_jax.data.tokenizer_base import padded_vocab_size
from mlm_jax.data.tokenizer_base import sanitize
from mlm_jax.errors import one_of
from mlm_jax.errors import require

# The factory's own names and the interface's, which the rest of mlm_jax imports from here.
__all__ = ['KINDS', 'MIN_VOCAB_SIZE', 'ROLES', 'SPECIAL_TOKENS', 'Specials', 'Tokenizer',
           'VOCAB_MULTIPLE', 'check_config', 'load', 'model_vocab_size', 'padded_vocab_size',
           'sanitize', 'tokenizer_files', 'train']

# config.tokenizer.kind: what a run with no tokenizer file trains.
KINDS = ('sentencepiece', 'wordpiece', 'bpe')
# The special tokens, 256 byte-fallback pieces, and room for some words.
MIN_VOCAB_SIZE = 300
# Tokenizers loaded in this process, by the identity of the files they were read from: the
# command's config check, prepare and the loop ask for the same one, which is read once.
_LOADED: collections.OrderedDict[tuple, Tokenizer] = collections.OrderedDict()
_MAX_LOADED = 8


def tokenizer_files(directory: str) -> str | None:
  """The file or directory in `directory` that `load` reads, or None if it holds no tokenizer.

  In order: this project's sentencepiece model (tokenizer.model), a
  tokenizer/ folder (a data dir's or workdir's Hugging Face tokenizer),
  tokenizer.json, a WordPiece vocab.txt.
  """
  sp = paths.join(directory, sp_tokenizer.FILE_NAME)
  if paths.isfile(sp) and sp_tokenizer.is_mlm_jax_model(sp):
    return sp
  sub = paths.join(directory, 'tokenizer')
  if paths.isdir(sub) and tokenizer_files(sub):
    return sub
  for name in ('tokenizer.json', 'vocab.txt'):
    if paths.isfile(paths.join(directory, name)):
      return paths.join(directory, name)
  return None


def load(path: str) -> Tokenizer:
  """The tokenizer at `path`: a .model, tokenizer.json or vocab.txt file, or a directory with one
  (a local path or a bucket URL).

  Raises ValueError naming what is missing or wrong. Files read before and
  unchanged since give the same object again, not a second reading.
  """
  path = paths.expand(path)
  if paths.isdir(path):
    found = tokenizer_files(path)
    if found is None:
      raise ValueError(f'{path} holds no tokenizer: no tokenizer.json, vocab.txt or mlm_jax '
                       'tokenizer.model. Copy the tokenizer files the model was published with '
                       'into it (tokenizer.json and tokenizer_config.json).')
    path = found if paths.isfile(found) else tokenizer_files(found)
  if not paths.exists(path):
    raise ValueError(f'{path}: no such tokenizer file.')
  sentencepiece = path.endswith('.model')
  key = _identity(path, sentencepiece)
  if key in _LOADED:
    _LOADED.move_to_end(key)
    return _LOADED[key]
  if sentencepiece:
    tok: Tokenizer = sp_tokenizer.SentencePieceTokenizer(path)
  else:
    tok = hf_tokenizer.HFTokenizer.from_path(path)
  _LOADED[key] = tok
  if len(_LOADED) > _MAX_LOADED:
    _LOADED.popitem(last=False)
  return tok


def _identity(path: str, sentencepiece: bool) -> tuple:
  """The path, size and modification time of every file a tokenizer at `path` is read from."""
  if sentencepiece:
    return (paths.absolute(path), tuple(paths.identity(path)))
  directory = hf_tokenizer.directory_of(path)
  files = [paths.join(directory, n) for n in hf_tokenizer.FILES]
  return (paths.absolute(path),) + tuple(tuple(paths.identity(f)) for f in files
                                          if paths.isfile(f))


def train(kind: str, lines: Iterable[str], directory: str, tok: ml_collections.ConfigDict,
          seed: int) -> Tokenizer:
  """Trains a tokenizer of `kind` (KINDS) on `lines` by config.tokenizer; saves it in `directory`."""
  if kind == 'sentencepiece':
    return sp_tokenizer.train(lines, directory, vocab_size=tok.vocab_size,
                              model_type=tok.model_type,
                              character_coverage=tok.character_coverage,
                              max_sentences=tok.max_sentences, seed=seed)
  return hf_tokenizer.train(kind, lines, directory, vocab_size=tok.vocab_size,
                            lowercase=tok.lowercase)


def check_config(tok: ml_collections.ConfigDict, check_paths: bool = True) -> None:
  """ConfigError for an invalid config.tokenizer (and, if asked, a missing model file)."""
  one_of('tokenizer', 'kind', tok.kind, KINDS)
  require(tok.vocab_size >= MIN_VOCAB_SIZE,
          f'config.tokenizer.vocab_size={tok.vocab_size} is too small: it must hold the '
          f'{len(SPECIAL_TOKENS)} special tokens and 256 byte-fallback pieces; use at least '
          f'{MIN_VOCAB_SIZE}.')
  one_of('tokenizer', 'model_type', tok.model_type, sp_tokenizer.MODEL_TYPES)
  require(tok.max_sentences > 0, 'config.tokenizer.max_sentences must be positive.')
  if not check_paths:
    return
  require(not tok.model_file or paths.exists(paths.expand(tok.model_file)),
          f'config.tokenizer.model_file={tok.model_file!r}: no such file or directory. Give a '
          'sentencepiece model written by mlm_jax (WORKDIR/tokenizer.model), a tokenizer.json, '
          "a WordPiece vocab.txt or a directory holding one, or '' to train one.")
  # A local file: prepare reads the words with the standard library.
  require(not tok.add_tokens or os.path.isfile(os.path.expanduser(tok.add_tokens)),
          f'config.tokenizer.add_tokens={tok.add_tokens!r}: no such file (one word per line).')
