"""Sentencepiece tokenizer: trained once per corpus, stored with the prepared data.

The only module that imports sentencepiece. Special tokens have fixed ids so
masking and the model never need to look them up:

  [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
# Literal special-token strings in corpus text would be read as the special
# tokens themselves; prepare rewrites them as plain words.
_LITERAL_SPECIALS = {tok: tok[1:-1] for tok in SPECIAL_TOKENS}


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
  """The model's embedding rows: vocab rounded up so matmuls tile evenly."""
  return -(-vocab_size // multiple) * multiple


def sanitize(text: str) -> str:
  """Rewrites literal '[MASK]' etc. in raw text so they are not special."""
  if '[' in text:
    for tok, plain in _LITERAL_SPECIALS.items():
      text = text.replace(tok, plain)
  return text


class Tokenizer:
  """A loaded sentencepiece model with our special-token layout."""

  def __init__(self, model_path: str):
    self.model_path = model_path
    self._sp = spm.SentencePieceProcessor(model_file=model_path)
    pieces = [self._sp.id_to_piece(i) for i in SPECIAL_IDS]
    if tuple(pieces) != SPECIAL_TOKENS:
      raise ValueError(
          f'{model_path} is not an mlm_jax tokenizer: ids 0-4 are {pieces}, '
          f'expected {list(SPECIAL_TOKENS)}. Delete the data dir or point '
          'config.data.data_dir elsewhere to train a new one.')

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def model_proto(self) -> bytes:
    return self._sp.serialized_model_proto()

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text, without [CLS]/[SEP]."""
    return self._sp.encode(list(texts), out_type=int, num_threads=os.cpu_count() or 1)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def word_start_mask(self) -> np.ndarray:
    """[vocab] bool: pieces that begin a word (sentencepiece's '▁' prefix)."""
    return np.array([self._sp.id_to_piece(i).startswith('\u2581')
                     for i in range(self.vocab_size)])

  def spec(self) -> dict:
    """The model's algorithm, normalizer settings and pieces, for re-implementing it elsewhere.

    Returns {'model_type': 'unigram'|'bpe'|..., 'byte_fallback', 'add_dummy_prefix',
    'remove_extra_whitespaces', 'escape_whitespaces', 'treat_whitespace_as_suffix',
    'precompiled_charsmap': bytes, 'pieces': [(piece, score, kind)] in id order}, kind one of
    'normal', 'unknown', 'control', 'user_defined', 'unused', 'byte'.
    """
    from sentencepiece import sentencepiece_model_pb2  # Only the exporter needs the proto.
    proto = sentencepiece_model_pb2.ModelProto.FromString(self.model_proto)
    kinds = {v.number: v.name.lower() for v in proto.SentencePiece.Type.DESCRIPTOR.values}
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    return {
        'model_type': trainer.ModelType.Name(trainer.model_type).lower(),
        'byte_fallback': trainer.byte_fallback,
        'add_dummy_prefix': normalizer.add_dummy_prefix,
        'remove_extra_whitespaces': normalizer.remove_extra_whitespaces,
        'escape_whitespaces': normalizer.escape_whitespaces,
        'treat_whitespace_as_suffix': trainer.treat_whitespace_as_suffix,
        'precompiled_charsmap': normalizer.precompiled_charsmap,
        'pieces': [(p.piece, p.score, kinds[p.type]) for p in proto.pieces],
    }


def train_tokenizer(lines: Iterable[str], model_path: str, *, vocab_size: int,
                    model_type: str, character_coverage: float,
                    max_sentences: int, seed: int) -> Tokenizer:
  """Trains a sentencepiece model on `lines` and writes it to `model_path`."""
  if not model_path.endswith('.model'):
    raise ValueError(f'tokenizer path must end in .model, got {model_path}')
  spm.set_random_generator_seed(seed)
  prefix = model_path[:-len('.model')]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines),
      model_prefix=prefix,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      input_sentence_size=max_sentences,
      shuffle_input_sentence=True,
      # A small corpus may not support the requested size; take what it has
      # rather than failing after minutes of work.
      hard_vocab_limit=False,
      byte_fallback=True,
      pad_id=PAD_ID, pad_piece='[PAD]',
      unk_id=UNK_ID, unk_piece='[UNK]',
      bos_id=-1, eos_id=-1,
      user_defined_symbols=list(SPECIAL_TOKENS[2:]),
      num_threads=os.cpu_count() or 1,
      minloglevel=2,
  )
  vocab_file = prefix + '.vocab'
  if os.path.exists(vocab_file):
    os.remove(vocab_file)
  return Tokenizer(model_path)
