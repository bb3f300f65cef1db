"""The tokenizer's training text: a uniform sample of the corpus's lines, the same for any
number of workers.

Sentencepiece ignores a sentence over MAX_SENTENCE_BYTES, so longer lines are
cut into pieces that fit (split_line); sentences holding U+2047, which
sentencepiece reserves, are counted and left out. The `tokenizers` trainers
take the same sample.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable
from collections.abc import Iterator

import numpy as np

# Sentencepiece's own limit (its default): it ignores longer training
# sentences, so sample_lines cuts longer lines into pieces of at most this.
MAX_SENTENCE_BYTES = 4192

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


