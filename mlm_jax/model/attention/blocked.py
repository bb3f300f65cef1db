"""'blocked': XLA attention whose memory does not grow with T² (long rows).

A local layer runs banded (`banded_attention`): each block of queries
against its own and its two neighbouring blocks of keys, memory and time
O(T·w) for a window w. A layer without a window, or queries at chosen rows,
runs in query chunks instead (`chunked_attention`), whose memory grows with
T·chunk, not T².
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.model.attention.dense import softmax_attention
from mlm_jax.model.attention.mask import Mask

Array = jax.Array

# Queries per chunk of the chunked kernel (a layer without a window, or
# queries at chosen rows, under 'blocked').
QUERY_CHUNK = 512


def banded_attention(q: Array, k: Array, v: Array, mask: Mask, dropout=lambda w: w) -> Array:
  """Local attention in O(T·w): q, k, v [B, T, N, H] -> [B, T, N, H], mask.window = w.

  The row is cut into blocks of C = w tokens (the last one padded); block i's
  queries meet the keys of blocks i-1, i and i+1, which hold every key at
  most w positions away (DropToken only brings tokens closer in index than
  in position). Within those 3C keys the description decides, as in
  softmax_attention (same scaling, float32 scores, dropout on the weights).
  """
  b, t, n, h = q.shape
  c = min(mask.window, t)
  nb = -(-t // c)
  pad = nb * c - t

  def blocks(x: Array, fill) -> Array:        # [B, T, ...] -> [B, nb, C, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(x.shape[0], nb, c, *x.shape[2:])

  def neighbours(x: Array, fill) -> Array:    # [B, nb, C, ...] -> [B, nb, 3C, ...]
    x = jnp.pad(x, [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

  far = np.iinfo(np.int32).max // 4  # Outside every window.
  if mask.positions is None:          # Constants of the program.
    index = np.concatenate([np.arange(t), np.full(pad, far)])
    query_pos = index.reshape(1, nb, c)
    padded = np.pad(query_pos, [(0, 0), (1, 1), (0, 0)], constant_values=far)
    key_pos = np.concatenate([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], axis=2)
  else:
    positions = mask.positions.astype(jnp.int32)
    query_pos = blocks(positions, far)
    key_pos = neighbours(query_pos, far)
  allowed = jnp.abs(query_pos[..., :, None] - key_pos[..., None, :]) <= mask.window
  allowed = allowed & neighbours(blocks(mask.valid, False), False)[:, :, None, :]
  if mask.documents is not None:
    docs = blocks(mask.documents, -1)
    allowed = allowed & (docs[..., :, None] == neighbours(docs, -2)[..., None, :])
  # allowed: [B, nb, C, 3C]
  qb = blocks(q * (1.0 / math.sqrt(h)), 0)
  kb, vb = (neighbours(blocks(x, 0), 0) for x in (k, v))
  scores = jnp.einsum('bxqnh,bxknh->bxnqk', qb, kb).astype(jnp.float32)
  scores = scores + jnp.where(allowed, 0.0, -1e9)[:, :, None]
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  total = jnp.moveaxis(jnp.sum(weights, axis=-1), 2, 3)[..., None]      # [B, nb, C, N, 1]
  out = jnp.einsum('bxnqk,bxknh->bxqnh', dropout(weights).astype(v.dtype), vb)
  out = (out.astype(jnp.float32) / total).astype(v.dtype)
  return out.reshape(b, nb * c, n, h)[:, :t]


def chunked_attention(q: Array, k: Array, v: Array, mask: Mask, rows: Array | None,
                      chunk: int = QUERY_CHUNK) -> Array:
  """q [B, Q, N, H] in chunks of `chunk` queries, each dense over all T keys -> [B, Q, N, H].

  One chunk at a time (lax.map), each recomputed in the backward pass
  (jax.checkpoint): memory grows with chunk·T, not Q·T. rows [B, Q]: the
  queries' indices into T (None: Q = T, every token).
  """
  b, q_len, n, h = q.shape
  index = jnp.broadcast_to(jnp.arange(q_len)[None], (b, q_len)) if rows is None else rows
  nc = -(-q_len // chunk)
  pad = nc * chunk - q_len
  q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
  index = jnp.pad(index, [(0, 0), (0, pad)])   # Padding queries read row 0; dropped below.

  @jax.checkpoint
  def one(args):
    q_c, index_c = args                           # [B, chunk, N, H], [B, chunk]
    return softmax_attention(q_c, k, v, mask.allowed(index_c))

  chunks = (jnp.moveaxis(q.reshape(b, nc, chunk, n, h), 1, 0),
            jnp.moveaxis(index.reshape(b, nc, chunk), 1, 0))
  out = jax.lax.map(one, chunks)                  # [nc, B, chunk, N, H]
  return jnp.moveaxis(out, 0, 1).reshape(b, nc * chunk, n, h)[:, :q_len]
