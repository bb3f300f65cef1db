"""grain's index_shuffle over a whole array of indices at once, bit for bit.

`grain.experimental.index_shuffle(i, max_index, seed, rounds)` gives the
position of i in a pseudorandom permutation of [0, max_index]: a Simon-style
Feistel cipher on the smallest even block of at least 16 bits that holds
max_index, applied again while the result is out of range (cycle walking),
with round keys drawn from C++'s std::seed_seq{seed}. grain's function
takes one index per Python call and computes the key schedule each time;
here the same arithmetic runs over a numpy array, the keys computed once per
seed, so a chunk of rows costs a few vectorised passes rather than a call
per row. tests/test_pipeline.py checks it against grain's own function.
"""

from __future__ import annotations

import functools
import math

import numpy as np

_MIN_BLOCK_BITS = 16
_U32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=64)
def round_keys(seed: int, rounds: int) -> tuple[int, ...]:
  """std::seed_seq{seed}.generate(keys, keys + rounds), as the C++ standard defines it."""
  n, v = rounds, [seed & _U32]
  s = len(v)
  out = [0x8B8B8B8B] * n
  t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
  p = (n - t) // 2
  q = p + t
  m = max(s + 1, n)

  def mix(x: int) -> int:
    return x ^ (x >> 27)

  for k in range(m):
    r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _U32
    r2 = (r1 + (s if k == 0 else (k % n + v[k - 1] if k <= s else k % n))) & _U32
    out[(k + p) % n] = (out[(k + p) % n] + r1) & _U32
    out[(k + q) % n] = (out[(k + q) % n] + r2) & _U32
    out[k % n] = r2
  for k in range(m, m + n):
    r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _U32)) & _U32
    r4 = (r3 - k % n) & _U32
    out[(k + p) % n] ^= r3
    out[(k + q) % n] ^= r4
    out[k % n] = r4
  return tuple(out)


def _block_bits(max_index: int) -> int:
  bits = math.ceil(math.log2(max_index))
  return max(bits + bits % 2, _MIN_BLOCK_BITS)


# Blocks of up to this many bits are encrypted once, whole, into a table
# (8 MiB at most): below 2**16 indices the 16-bit minimum block makes each
# index walk 2**16 / (max_index + 1) encryptions on average, which a table
# turns into lookups.
_TABLE_BITS = 20


def _encrypt(value: np.ndarray, w: int, keys: tuple[int, ...]) -> np.ndarray:
  """The cipher on blocks of 2w bits (uint64 in and out)."""
  mask, shift = np.uint64((1 << w) - 1), np.uint64(w)

  def rotl(x: np.ndarray, r: int) -> np.ndarray:
    return ((x << np.uint64(r)) | (x >> np.uint64(w - r))) & mask

  def f(x: np.ndarray) -> np.ndarray:
    return (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2)

  left, right = (value >> shift) & mask, value & mask
  for i in range(0, len(keys), 2):
    # The key is a uint32 assigned to a w-bit bitset: its low w bits.
    left = left ^ f(right) ^ np.uint64(keys[i] & ((1 << w) - 1))
    right = right ^ f(left) ^ np.uint64(keys[i + 1] & ((1 << w) - 1))
  return (left << shift) | right


@functools.lru_cache(maxsize=8)
def _table(w: int, seed: int, rounds: int) -> np.ndarray:
  return _encrypt(np.arange(1 << (2 * w), dtype=np.uint64), w, round_keys(seed, rounds))


def index_shuffle(index: np.ndarray, max_index: int, seed: int, rounds: int = 4) -> np.ndarray:
  """Positions [n] (int64) of `index` [n] in grain's permutation of [0, max_index]."""
  index = np.asarray(index, np.int64)
  if rounds < 4 or rounds % 2:
    raise ValueError(f'rounds must be an even integer >= 4, got {rounds}')
  if index.size and (index.min() < 0 or index.max() > max_index):
    raise ValueError(f'indices must be in [0, {max_index}]')
  if max_index == 0:
    return np.zeros_like(index)
  w = _block_bits(max_index) // 2
  if 2 * w <= _TABLE_BITS:
    table = _table(w, seed & _U32, rounds)
    encrypt = lambda v: table[v]  # pylint: disable=unnecessary-lambda-assignment
  else:
    keys = round_keys(seed & _U32, rounds)
    encrypt = lambda v: _encrypt(v, w, keys)  # pylint: disable=unnecessary-lambda-assignment
  out = encrypt(index.astype(np.uint64))
  todo = np.nonzero(out > np.uint64(max_index))[0]
  while todo.size:                      # Cycle walking: encrypt again until in range.
    out[todo] = encrypt(out[todo])
    todo = todo[out[todo] > np.uint64(max_index)]
  return out.astype(np.int64)
