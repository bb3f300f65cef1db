"""The tokenizer interface: what the rest of mlm_jax asks of a tokenizer.

Both implementations (sp_tokenizer, hf_tokenizer) derive from `Tokenizer`
here and import nothing else of the seam; the factory (tokenizer.py: `load`,
`train`, `tokenizer_files`) imports them, so the seam has no import cycle.
Special tokens are found by role (pad, unk, cls, sep, mask) in the tokenizer
itself; no module assumes their ids.

The one rule of how many embedding rows a tokenizer needs is here too
(`model_vocab_size`, `padded_vocab_size`): every module that sizes a table
asks these two functions.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence

import numpy as np

ROLES = ('pad', 'unk', 'cls', 'sep', 'mask')
# The special tokens of the tokenizers trained here, in ROLES order.
SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
# Literal special-token strings in corpus text would be read as the special
# tokens of a tokenizer trained here; prepare rewrites them as plain words.
_LITERAL_SPECIALS = {tok: tok[1:-1] for tok in SPECIAL_TOKENS}


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
    """Writes the tokenizer's files into `directory` (a path or a bucket URL); returns the path
    `load` takes."""

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


# Embedding tables have a multiple of this many rows, so that the vocabulary
# matmul tiles evenly (the TPU's 128 lanes; a multiple of 64 for GPU tensor
# cores too). The rows past the vocabulary are never predicted (model/heads.py).
VOCAB_MULTIPLE = 128


def model_vocab_size(table: int, tokenizer_vocab: int) -> int:
  """The ids the model predicts over: a checkpoint's embedding table (`table`; 0 for a fresh
  model), or the tokenizer's ids where it has more (words added beyond the table).

  Never padded: padding is `padded_vocab_size`'s alone. A table grown for added words has
  exactly the tokenizer's ids, so that an exported model's vocab_size is len(tokenizer), as
  transformers' `resize_token_embeddings(len(tokenizer))` makes it, and no logit is spent on an
  id no tokenizer produces.
  """
  return max(table, tokenizer_vocab)


def padded_vocab_size(vocab_size: int) -> int:
  """The model's embedding rows: `vocab_size` rounded up to a multiple of VOCAB_MULTIPLE."""
  return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def sanitize(text: str) -> str:
  """Rewrites literal '[MASK]' etc. in raw text so they are not special."""
  if '[' in text:
    for tok, plain in _LITERAL_SPECIALS.items():
      text = text.replace(tok, plain)
  return text
