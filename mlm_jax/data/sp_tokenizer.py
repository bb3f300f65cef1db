"""Sentencepiece tokenizers: trained here (the default) or given as a `.model` file.

The only module that imports sentencepiece. A model trained here has the
special tokens at fixed ids, checked when it is loaded:

  [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

from mlm_jax.data import line_sample
from mlm_jax.data import paths
from mlm_jax.data import tokenizer_base as tok_lib
from mlm_jax.runtime import cores

FILE_NAME = 'tokenizer.model'
# Sentencepiece model types (config.tokenizer.model_type).
MODEL_TYPES = ('unigram', 'bpe')
# The layout of the models trained here: ids 0-4.
SPECIALS = tok_lib.Specials(pad=0, unk=1, cls=2, sep=3, mask=4,
                            tokens=tok_lib.SPECIAL_TOKENS)


def _read(path: str) -> bytes:
  """A model file's bytes (a local path or a bucket URL): sentencepiece loads them from memory."""
  with paths.open_binary(path) as f:
    return f.read()


def is_mlm_jax_model(path: str) -> bool:
  """Whether `path` is a sentencepiece model with this project's special-token layout."""
  try:
    sp = spm.SentencePieceProcessor(model_proto=_read(path))
  except (OSError, RuntimeError):
    return False
  return (sp.get_piece_size() > SPECIALS.mask
          and tuple(sp.id_to_piece(i) for i in SPECIALS.ids) == SPECIALS.tokens)


class SentencePieceTokenizer(tok_lib.Tokenizer):
  """A loaded sentencepiece model with this project's special-token layout."""

  kind = 'sentencepiece'

  def __init__(self, model_path: str):
    self.model_path = model_path
    # The file's bytes as they are: save() writes them back unchanged, digest() hashes them.
    self._file = _read(model_path)
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=self._file)
    except RuntimeError as e:
      raise ValueError(f'{model_path} is not a sentencepiece model: {e}') from e
    pieces = [self._sp.id_to_piece(i) for i in SPECIALS.ids]
    if tuple(pieces) != SPECIALS.tokens:
      raise ValueError(
          f'{model_path} is not an mlm_jax tokenizer: ids 0-4 are {pieces}, '
          f'expected {list(SPECIALS.tokens)}. Delete the data dir or point '
          'config.data.data_dir elsewhere to train a new one.')
    self.specials = SPECIALS

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def model_proto(self) -> bytes:
    return self._sp.serialized_model_proto()

  def encode(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    return self._sp.encode(list(texts), out_type=int,
                           num_threads=num_threads or cores.usable_cores())

  def encode_documents(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    # Corpus text reaches here through tok_lib.sanitize: no literal specials remain.
    return self.encode(texts, num_threads)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))

  def special_ids(self) -> np.ndarray:
    return np.asarray(SPECIALS.ids, np.int64)

  def word_start_mask(self) -> np.ndarray:
    """[vocab] bool: pieces that begin a word (sentencepiece's '▁' prefix)."""
    return np.array([p.startswith('\u2581') for p in self.pieces()], bool)

  def save(self, directory: str) -> str:
    """Writes DIRECTORY/tokenizer.model: the bytes of the file it was loaded from."""
    path = paths.join(directory, FILE_NAME)
    with paths.open_write(path) as f:
      f.write(self._file)
    return path

  def digest(self) -> str:
    return hashlib.sha256(self._file).hexdigest()

  def spec(self) -> dict:
    """The model's algorithm, normalizer settings and pieces, for re-implementing it elsewhere.

    Returns {'model_type': 'unigram'|'bpe'|..., 'byte_fallback', 'add_dummy_prefix',
    'remove_extra_whitespaces', 'escape_whitespaces', 'treat_whitespace_as_suffix',
    'precompiled_charsmap': bytes, 'pieces': [(piece, score, kind)] in id order}, kind one of
    'normal', 'unknown', 'control', 'user_defined', 'unused', 'byte'.
    """
    proto = _model_proto_module().ModelProto.FromString(self.model_proto)
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


def _model_proto_module():
  """The generated module of sentencepiece's ModelProto (only the exporter needs it).

  sentencepiece 0.2.3 generated its copy for protobuf >= 7.36.1 and refuses an
  older runtime at import, while Apache Beam (the .[beam] extra) needs
  protobuf < 7. transformers ships the same message generated without that
  check (its own tokenizer converter reads models with it).
  """
  from google.protobuf import runtime_version  # pylint: disable=import-outside-toplevel
  try:
    from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
    return sentencepiece_model_pb2
  except runtime_version.VersionError as e:
    try:
      from transformers.utils import sentencepiece_model_pb2_new  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise ImportError(f'Reading the tokenizer model needs a protobuf runtime that '
                        f'sentencepiece accepts ({e}), or transformers installed '
                        "(pip install -e '.[interop]').") from e
    return sentencepiece_model_pb2_new


def train(lines: Iterable[str], directory: str, *, vocab_size: int, model_type: str,
          character_coverage: float, max_sentences: int, seed: int) -> SentencePieceTokenizer:
  """Trains a sentencepiece model on `lines` and writes it to DIRECTORY/tokenizer.model."""
  spm.set_random_generator_seed(seed)
  # Written to memory, not to a path the model would record: the same corpus
  # and settings give the same model bytes in any directory.
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      character_coverage=character_coverage,
      input_sentence_size=max_sentences,
      shuffle_input_sentence=True,
      max_sentence_length=line_sample.MAX_SENTENCE_BYTES,
      # A small corpus may not support the requested size; take what it has
      # rather than failing after minutes of work.
      hard_vocab_limit=False,
      byte_fallback=True,
      pad_id=SPECIALS.pad, pad_piece='[PAD]',
      unk_id=SPECIALS.unk, unk_piece='[UNK]',
      bos_id=-1, eos_id=-1,
      user_defined_symbols=list(SPECIALS.tokens[2:]),
      num_threads=cores.usable_cores(),
      minloglevel=2,
  )
  path = paths.join(directory, FILE_NAME)
  with paths.open_write(path) as f:
    f.write(model.getvalue())
  return SentencePieceTokenizer(path)
