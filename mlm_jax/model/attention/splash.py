"""'splash': Pallas splash attention (TPUs), and the keys it computes per query.

The mask is static: a LocalMask of the window (or a full mask) for every
row, with documents and padding as segment ids. Rows whose length is not a
multiple of the tile run padded to one (Ettin's 7,999 tokens as 8,064; rows
of 1,024 tokens or more only, choice.SPLASH_FROM): the added tokens
are padding, segment 0, which no real token attends to. Pallas
is imported when the kernel is built, so this module loads on any platform.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mlm_jax.model.attention.mask import Mask
from mlm_jax.model.attention.mask import tiled_keys
from mlm_jax.model.attention.sharded import per_device

Array = jax.Array

# Splash attention's tiles: rows are padded to a multiple of them.
SPLASH_BLOCK = 128


def padded_length(t: int) -> int:
  """The row length the kernel runs at: t rounded up to whole tiles."""
  return -(-t // SPLASH_BLOCK) * SPLASH_BLOCK


def splash_attention(q: Array, k: Array, v: Array, mask: Mask,
                     interpret: bool = False) -> Array:
  """Pallas splash attention (TPUs): q, k, v [B, T, N, H] -> [B, T, N, H].

  A static LocalMask of mask.window each side (or a full mask) and segment
  ids (mask.segments(): documents, padding apart), per device on its rows
  (sharded.per_device), at padded_length(T). `interpret` runs the kernel in
  Pallas's interpreter (any platform; for tests).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  b, t, n, h = q.shape
  padded = padded_length(t)
  shape = (padded, padded)
  base = (splash.LocalMask(shape, (mask.window, mask.window), 0) if mask.window is not None
          else splash.FullMask(shape))
  blocks = splash.BlockSizes(
      block_q=SPLASH_BLOCK, block_kv=SPLASH_BLOCK, block_kv_compute=SPLASH_BLOCK,
      block_q_dkv=SPLASH_BLOCK, block_kv_dkv=SPLASH_BLOCK, block_kv_dkv_compute=SPLASH_BLOCK,
      block_q_dq=SPLASH_BLOCK, block_kv_dq=SPLASH_BLOCK)
  kernel = splash.make_splash_mha(splash.MultiHeadMask([base] * n), head_shards=1,
                                  q_seq_shards=1, block_sizes=blocks, interpret=interpret)

  def run(q, k, v, segments):                     # This device's rows, [b, T, N, H].
    if padded != t:  # Padding to whole tiles: segment 0, as the rows' own padding.
      q, k, v = (jnp.pad(x, ((0, 0), (0, padded - t), (0, 0), (0, 0))) for x in (q, k, v))
      segments = jnp.pad(segments, ((0, 0), (0, padded - t)))
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [b, N, T, H], as the kernel takes them
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s))
    out = jax.vmap(one)(heads_first(q * (1.0 / math.sqrt(h))).astype(k.dtype),
                        heads_first(k), heads_first(v), segments)
    return jnp.swapaxes(out, 1, 2)[:, :t]

  return per_device(run, q, k, v, mask.segments())


def splash_keys(q_len: int, kv_len: int, window: int | None) -> float:
  """Keys per real query that splash attention computes: whole tiles of the padded rows, the
  masked ones skipped."""
  q, kv = padded_length(q_len), padded_length(kv_len)
  return tiled_keys(q, kv, window, SPLASH_BLOCK) * q / q_len
