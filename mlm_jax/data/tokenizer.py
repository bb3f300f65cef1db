"""Sentencepiece tokenizer: trained once per corpus, stored with the prepared data.

The only module that imports sentencepiece. Special tokens have fixed ids so
masking and the model never need to look them up:

  [PAD]=0  [UNK]=1  [CLS]=2  [SEP]=3  [MASK]=4
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import re
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence

import ml_collections
import numpy as np
import sentencepiece as spm

from mlm_jax.config_check import one_of
from mlm_jax.config_check import require
from mlm_jax.runtime import cores

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
FIRST_NORMAL_ID = len(SPECIAL_IDS)
# Literal special-token strings in corpus text would be read as the special
# tokens themselves; prepare rewrites them as plain words.
_LITERAL_SPECIALS = {tok: tok[1:-1] for tok in SPECIAL_TOKENS}
# Sentencepiece's own limit (its default): it ignores longer training
# sentences, so sample_lines cuts longer lines into pieces of at most this.
MAX_SENTENCE_BYTES = 4192
# Sentencepiece model types (config.tokenizer.model_type).
MODEL_TYPES = ('unigram', 'bpe')
# The special tokens, 256 byte-fallback pieces, and room for some words.
MIN_VOCAB_SIZE = 300


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

  def encode(self, texts: Sequence[str], num_threads: int = 0) -> list[list[int]]:
    """Ids of each text, without [CLS]/[SEP]; num_threads 0: one per core."""
    return self._sp.encode(list(texts), out_type=int,
                           num_threads=num_threads or cores.usable_cores())

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  def pieces(self) -> list[str]:
    """Every piece, by id."""
    return [self.id_to_piece(i) for i in range(self.vocab_size)]

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


# A sentence end: '.', '!' or '?' (then closing quotes or brackets) and
# whitespace, or a CJK full stop, exclamation or question mark. Bytes, so
# cuts fall at byte offsets.
_SENTENCE_END = re.compile(r'[.!?]+["\')\]]*\s+|(?:。|！|？)+\s*'.encode())
# sentencepiece skips a training sentence that holds this character (its
# stand-in for unknown characters).
_RESERVED = '\u2047'


def split_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> list[str]:
  """`line` cut into pieces of at most `max_bytes` UTF-8 bytes that join back into it.

  Each cut falls after the last sentence end that fits (see _SENTENCE_END),
  else after the last space or tab, else at the last UTF-8 character boundary
  that fits (max_bytes >= 4 always leaves room for one character).
  """
  data = line.encode()
  pieces, start = [], 0
  while len(data) - start > max_bytes:
    cut = _cut(data, start, start + max_bytes)
    pieces.append(data[start:cut].decode())
    start = cut
  pieces.append(data[start:].decode())
  return pieces


def _cut(data: bytes, start: int, limit: int) -> int:
  """Where the piece of data that begins at `start` ends: in (start, limit]."""
  ends = [m.end() for m in _SENTENCE_END.finditer(data, start, limit)]
  if ends:
    return ends[-1]
  space = max(data.rfind(b' ', start, limit), data.rfind(b'\t', start, limit))
  if space >= start:
    return space + 1
  cut = limit
  while data[cut] & 0xC0 == 0x80:  # A UTF-8 continuation byte: inside a character.
    cut -= 1
  return cut


def _sentences(lines: Iterable[str], counts: dict[str, int]) -> Iterator[tuple[str, int]]:
  """(sentence, its UTF-8 size) for the trainer: lines, long ones split; counts what it sees."""
  for line in lines:
    size = len(line.encode())
    counts['lines_seen'] += 1
    counts['bytes_seen'] += size
    if size <= MAX_SENTENCE_BYTES:
      pieces = [(line, size)]
    else:
      counts['lines_split'] += 1
      pieces = [(p, len(p.encode())) for p in split_line(line)]
    for piece, piece_size in pieces:
      counts['sentences_seen'] += 1
      if _RESERVED in piece:
        counts['reserved_sentences'] += 1
        counts['reserved_bytes'] += piece_size
      else:
        yield piece, piece_size


_COUNT_KEYS = ('lines_seen', 'bytes_seen', 'lines_split', 'sentences_seen', 'reserved_sentences',
               'reserved_bytes')


@dataclasses.dataclass
class LineSample:
  """A sample of training sentences from one part of the corpus, with what that part held.

  Each sentence of part p gets a random key, a pure function of (seed, p, its
  index in the part); a sample of at most k sentences is the k with the
  smallest keys. So samples of parts, drawn in any processes in any order,
  merge into the sample of the whole (merge_samples), the same whatever the
  number of workers.
  """
  keys: np.ndarray            # [n] uint64
  where: np.ndarray           # [n, 2] int64: (part, index in the part)
  sentences: list[str]
  sizes: np.ndarray           # [n] int64 UTF-8 bytes
  counts: dict[str, int]      # _COUNT_KEYS: everything the part held

  def smallest(self, k: int) -> LineSample:
    """The k sentences of smallest (key, part, index), in the order they are held."""
    if len(self.sentences) <= k:
      return self
    kth = np.partition(self.keys, k - 1)[k - 1]
    below, ties = np.flatnonzero(self.keys < kth), np.flatnonzero(self.keys == kth)
    ties = ties[np.lexsort((self.where[ties, 1], self.where[ties, 0]))][:k - len(below)]
    keep = np.sort(np.concatenate([below, ties]))
    return LineSample(self.keys[keep], self.where[keep], [self.sentences[i] for i in keep],
                      self.sizes[keep], self.counts)


def _keys(seed: int, part: int, indices: np.ndarray) -> np.ndarray:
  """uint64 keys of (seed, part, index): splitmix64 of a counter."""
  def mix(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
  with np.errstate(over='ignore'):
    base = mix(np.uint64(seed % 2**64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(part))
    return mix(base + mix(indices.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))


def _empty_sample(counts: dict[str, int]) -> LineSample:
  return LineSample(np.zeros(0, np.uint64), np.zeros((0, 2), np.int64), [],
                    np.zeros(0, np.int64), counts)


def _join(parts: list[LineSample], counts: dict[str, int]) -> LineSample:
  if len(parts) == 1:
    return dataclasses.replace(parts[0], counts=counts)
  return LineSample(np.concatenate([p.keys for p in parts]),
                    np.concatenate([p.where for p in parts]),
                    list(itertools.chain.from_iterable(p.sentences for p in parts)),
                    np.concatenate([p.sizes for p in parts]), counts)


def sample_part(lines: Iterable[str], max_lines: int, seed: int, part: int = 0,
                below: int = 2**64) -> LineSample:
  """The sentences of `lines` (one part of the corpus) that may be among the sample's max_lines.

  sentencepiece ignores a sentence over MAX_SENTENCE_BYTES, so a longer line
  is first cut into pieces that fit (split_line), each a sentence of its own;
  sentences holding U+2047, which sentencepiece reserves and skips, are
  counted and left out. Only sentences with keys below `below` are kept (a
  bound known to hold the sample's keys). Memory stays within about twice
  the sample.
  """
  counts = dict.fromkeys(_COUNT_KEYS, 0)
  kept, sentences, sizes, start = _empty_sample(counts), [], [], 0

  def add_batch() -> LineSample:
    indices = np.arange(start, start + len(sentences), dtype=np.int64)
    keys = _keys(seed, part, indices)
    low = np.flatnonzero(keys < np.uint64(below)) if below < 2**64 else np.arange(len(keys))
    batch = LineSample(keys[low], np.stack([np.full(len(low), part, np.int64), indices[low]],
                                           axis=1),
                       [sentences[i] for i in low], np.asarray(sizes, np.int64)[low], counts)
    return _join([kept, batch], counts).smallest(max_lines)

  for sentence, size in _sentences(lines, counts):
    sentences.append(sentence)
    sizes.append(size)
    if len(sentences) >= max(max_lines, 1 << 16):
      kept = add_batch()
      start += len(sentences)
      sentences.clear()
      sizes.clear()
  return add_batch()


def merge_samples(parts: Iterable[LineSample], max_lines: int,
                  bound: list[int] | None = None) -> tuple[list[str], dict]:
  """A uniform sample of at most `max_lines` sentences of all parts, in corpus order.

  Parts may come in any order; memory stays within about twice the sample.
  `bound[0]`, if given, is kept at the largest key that can still be in the
  sample (the max_lines-th smallest so far, which more parts can only
  lower): parts made after it changes need not hold sentences above it, so
  workers send back a few sentences instead of all of theirs, and the sample
  is the same.
  Returns (sample, counts): lines and their bytes seen, lines split,
  sentences seen and sampled with the bytes sampled, and what was left out:
  sentences (and bytes) over the `max_lines` cap, and reserved_* ones that
  sentencepiece would skip for holding U+2047.
  """
  counts = dict.fromkeys(_COUNT_KEYS, 0)
  held, size = [_empty_sample(counts)], 0  # Joined only when they outgrow 2 * max_lines.
  for part in parts:
    for k in _COUNT_KEYS:
      counts[k] += part.counts[k]
    held.append(part)
    size += len(part.sentences)
    if size > 2 * max_lines:
      held = [_join(held, counts).smallest(max_lines)]
      size = len(held[0].sentences)
    if bound is not None and size >= max_lines:
      keys = np.concatenate([p.keys for p in held])
      bound[0] = int(np.partition(keys, max_lines - 1)[max_lines - 1]) + 1
  kept = _join(held, counts).smallest(max_lines)
  order = np.lexsort((kept.where[:, 1], kept.where[:, 0]))
  sampled_bytes = int(kept.sizes.sum())
  usable = counts['sentences_seen'] - counts['reserved_sentences']
  counts = dict(counts, sentences_sampled=len(order), bytes_sampled=sampled_bytes,
                capped_sentences=usable - len(order),
                capped_bytes=counts['bytes_seen'] - counts['reserved_bytes'] - sampled_bytes)
  return [kept.sentences[i] for i in order], counts


def sample_lines(lines: Iterable[str], max_lines: int, seed: int) -> tuple[list[str], dict]:
  """A uniform sample of at most `max_lines` training sentences of one stream, in order."""
  return merge_samples([sample_part(lines, max_lines, seed)], max_lines)


def train_tokenizer(lines: Iterable[str], model_path: str, *, vocab_size: int,
                    model_type: str, character_coverage: float,
                    max_sentences: int, seed: int) -> Tokenizer:
  """Trains a sentencepiece model on `lines` and writes it to `model_path`."""
  if not model_path.endswith('.model'):
    raise ValueError(f'tokenizer path must end in .model, got {model_path}')
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
      max_sentence_length=MAX_SENTENCE_BYTES,
      # A small corpus may not support the requested size; take what it has
      # rather than failing after minutes of work.
      hard_vocab_limit=False,
      byte_fallback=True,
      pad_id=PAD_ID, pad_piece='[PAD]',
      unk_id=UNK_ID, unk_piece='[UNK]',
      bos_id=-1, eos_id=-1,
      user_defined_symbols=list(SPECIAL_TOKENS[2:]),
      num_threads=cores.usable_cores(),
      minloglevel=2,
  )
  with open(model_path, 'wb') as f:
    f.write(model.getvalue())
  return Tokenizer(model_path)


def check_config(tok: ml_collections.ConfigDict, check_paths: bool = True) -> None:
  """ConfigError for an invalid config.tokenizer (and, if asked, a missing model file)."""
  require(tok.vocab_size >= MIN_VOCAB_SIZE,
          f'config.tokenizer.vocab_size={tok.vocab_size} is too small: it must hold the '
          f'{len(SPECIAL_TOKENS)} special tokens and 256 byte-fallback pieces; use at least '
          f'{MIN_VOCAB_SIZE}.')
  one_of('tokenizer', 'model_type', tok.model_type, MODEL_TYPES)
  require(tok.max_sentences > 0, 'config.tokenizer.max_sentences must be positive.')
  require(not check_paths or not tok.model_file
          or os.path.isfile(os.path.expanduser(tok.model_file)),
          f'config.tokenizer.model_file={tok.model_file!r}: no such file. Give the path of a '
          "sentencepiece model written by mlm_jax (WORKDIR/tokenizer.model), or '' to train one.")
