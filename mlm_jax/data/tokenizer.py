"""The tokenizer seam: what the rest of mlm_jax asks of a tokenizer, and where one comes from.

Two implementations:
  sp_tokenizer.SentencePieceTokenizer  sentencepiece, trained here (the default) or a
                                       `.model` written by mlm_jax;
  hf_tokenizer.HFTokenizer             Hugging Face `tokenizers`: any `tokenizer.json`
                                       (BERT's WordPiece, RoBERTa's and ModernBERT's
                                       byte-level BPE, XLM-R's unigram), a WordPiece
                                       `vocab.txt`, or WordPiece / byte-level BPE trained here.

Special tokens are found by role (pad, unk, cls, sep, mask) in the tokenizer
itself; no module assumes their ids. A tokenizer is stored in a directory
(a data dir, a workdir, an export) by `Tokenizer.save` and read back by `load`.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Iterable
from collections.abc import Sequence

import ml_collections
import numpy as np

from mlm_jax.config_check import one_of
from mlm_jax.config_check import require

# config.tokenizer.kind: what a run with no tokenizer file trains.
KINDS = ('sentencepiece', 'wordpiece', 'bpe')
ROLES = ('pad', 'unk', 'cls', 'sep', 'mask')
# The special tokens of the tokenizers trained here, in ROLES order.
SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
# Literal special-token strings in corpus text would be read as the special
# tokens of a tokenizer trained here; prepare rewrites them as plain words.
_LITERAL_SPECIALS = {tok: tok[1:-1] for tok in SPECIAL_TOKENS}
# The special tokens, 256 byte-fallback pieces, and room for some words.
MIN_VOCAB_SIZE = 300


@dataclasses.dataclass(frozen=True)
class Specials:
  """The ids of a tokenizer's special tokens by role, and their strings (in ROLES order)."""

  pad: int
  unk: int
  cls: int
  sep: int
  mask: int
  tokens: tuple[str, ...]

  @property
  def ids(self) -> tuple[int, ...]:
    return (self.pad, self.unk, self.cls, self.sep, self.mask)

  @property
  def never_masked(self) -> tuple[int, ...]:
    """Ids that structure a row ([PAD], [CLS], [SEP]): never selected for prediction."""
    return (self.pad, self.cls, self.sep)

  def token(self, role: str) -> str:
    return self.tokens[ROLES.index(role)]


class Tokenizer(abc.ABC):
  """Text <-> ids, with the special ids by role and the word starts whole-word masking needs."""

  kind: str  # 'sentencepiece', 'wordpiece', 'bpe' or 'unigram' (a tokenizer.json's model)
  specials: Specials

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Number of ids the tokenizer can produce (its pieces and added tokens)."""

  @abc.abstractmethod
  def encode(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    """Ids of each text, without [CLS]/[SEP]; a special token spelled in the text is that token
    (as a user writes 'A [MASK] B'). num_threads 0: one per core."""

  @abc.abstractmethod
  def encode_documents(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    """Ids of corpus documents: special-token strings in them are plain text."""

  @abc.abstractmethod
  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`."""

  @abc.abstractmethod
  def id_to_piece(self, i: int) -> str:
    """The piece (token string) of id i."""

  @abc.abstractmethod
  def special_ids(self) -> np.ndarray:
    """[n] int64: every special id (the roles' and any other the tokenizer marks special)."""

  @abc.abstractmethod
  def word_start_mask(self) -> np.ndarray:
    """[vocab] bool: ids whose piece begins a word (special and added tokens do)."""

  @abc.abstractmethod
  def save(self, directory: str) -> str:
    """Writes the tokenizer's files into `directory`; returns the path `load` takes."""

  @abc.abstractmethod
  def digest(self) -> str:
    """sha256 of the tokenizer's content: the same files give the same digest anywhere."""

  def pieces(self) -> list[str]:
    """Every piece, by id."""
    return [self.id_to_piece(i) for i in range(self.vocab_size)]

  def describe(self) -> str:
    s = self.specials
    return (f'{self.kind} tokenizer, {self.vocab_size:,} ids; '
            + ', '.join(f'{t}={i}' for t, i in zip(s.tokens, s.ids)))


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """The model's embedding rows: vocab rounded up so matmuls tile evenly."""
  return -(-vocab_size // multiple) * multiple


def sanitize(text: str) -> str:
  """Rewrites literal '[MASK]' etc. in raw text so they are not special."""
  if '[' in text:
    for tok, plain in _LITERAL_SPECIALS.items():
      text = text.replace(tok, plain)
  return text


def tokenizer_files(directory: str) -> str | None:
  """The file or directory in `directory` that `load` reads, or None if it holds no tokenizer.

  In order: this project's sentencepiece model (tokenizer.model), a
  tokenizer/ folder (a data dir's or workdir's Hugging Face tokenizer),
  tokenizer.json, a WordPiece vocab.txt.
  """
  from mlm_jax.data import sp_tokenizer  # pylint: disable=import-outside-toplevel
  sp = os.path.join(directory, sp_tokenizer.FILE_NAME)
  if os.path.isfile(sp) and sp_tokenizer.is_mlm_jax_model(sp):
    return sp
  sub = os.path.join(directory, 'tokenizer')
  if os.path.isdir(sub) and tokenizer_files(sub):
    return sub
  for name in ('tokenizer.json', 'vocab.txt'):
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def load(path: str) -> Tokenizer:
  """The tokenizer at `path`: a .model, tokenizer.json or vocab.txt file, or a directory with one.

  Raises ValueError naming what is missing or wrong.
  """
  from mlm_jax.data import hf_tokenizer  # pylint: disable=import-outside-toplevel
  from mlm_jax.data import sp_tokenizer  # pylint: disable=import-outside-toplevel
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    found = tokenizer_files(path)
    if found is None:
      raise ValueError(f'{path} holds no tokenizer: no tokenizer.json, vocab.txt or mlm_jax '
                       'tokenizer.model. Copy the tokenizer files the model was published with '
                       'into it (tokenizer.json and tokenizer_config.json).')
    path = found if os.path.isfile(found) else tokenizer_files(found)
  if not os.path.exists(path):
    raise ValueError(f'{path}: no such tokenizer file.')
  if path.endswith('.model'):
    return sp_tokenizer.SentencePieceTokenizer(path)
  return hf_tokenizer.HFTokenizer.from_path(path)


def train(kind: str, lines: Iterable[str], directory: str, tok: ml_collections.ConfigDict,
          seed: int) -> Tokenizer:
  """Trains a tokenizer of `kind` (KINDS) on `lines` by config.tokenizer; saves it in `directory`."""
  from mlm_jax.data import hf_tokenizer  # pylint: disable=import-outside-toplevel
  from mlm_jax.data import sp_tokenizer  # pylint: disable=import-outside-toplevel
  if kind == 'sentencepiece':
    return sp_tokenizer.train(lines, directory, vocab_size=tok.vocab_size,
                              model_type=tok.model_type,
                              character_coverage=tok.character_coverage,
                              max_sentences=tok.max_sentences, seed=seed)
  return hf_tokenizer.train(kind, lines, directory, vocab_size=tok.vocab_size,
                            lowercase=tok.lowercase)


def check_config(tok: ml_collections.ConfigDict, check_paths: bool = True) -> None:
  """ConfigError for an invalid config.tokenizer (and, if asked, a missing model file)."""
  from mlm_jax.data import sp_tokenizer  # pylint: disable=import-outside-toplevel
  one_of('tokenizer', 'kind', tok.kind, KINDS)
  require(tok.vocab_size >= MIN_VOCAB_SIZE,
          f'config.tokenizer.vocab_size={tok.vocab_size} is too small: it must hold the '
          f'{len(SPECIAL_TOKENS)} special tokens and 256 byte-fallback pieces; use at least '
          f'{MIN_VOCAB_SIZE}.')
  one_of('tokenizer', 'model_type', tok.model_type, sp_tokenizer.MODEL_TYPES)
  require(tok.max_sentences > 0, 'config.tokenizer.max_sentences must be positive.')
  if not check_paths:
    return
  require(not tok.model_file or os.path.exists(os.path.expanduser(tok.model_file)),
          f'config.tokenizer.model_file={tok.model_file!r}: no such file or directory. Give a '
          'sentencepiece model written by mlm_jax (WORKDIR/tokenizer.model), a tokenizer.json, '
          "a WordPiece vocab.txt or a directory holding one, or '' to train one.")
  require(not tok.add_tokens or os.path.isfile(os.path.expanduser(tok.add_tokens)),
          f'config.tokenizer.add_tokens={tok.add_tokens!r}: no such file (one word per line).')
