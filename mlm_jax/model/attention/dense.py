"""'dense': ours, softmax over a dense mask, the reference every other kernel agrees with.

It takes any mask (a [B, Q, T] one built from the description) and applies
attention dropout; it is what 'blocked' runs per query chunk.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def softmax_attention(q: Array, k: Array, v: Array, key_mask: Array,
                      dropout=lambda w: w) -> Array:
  """softmax(q·kᵀ/√H, keys masked)·v for q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H].

  Q = T, or fewer queries (the last block at the masked slots only).
  key_mask: [B, T], the keys every query may see, or [B, Q, T], per query
  (e.g. a sliding window).

  The queries are scaled (not the [B, N, T, T] scores), masked keys get a
  large negative bias, and the unnormalised weights exp(s - max s) meet v
  before the division by their sum: one pass less over the scores than
  softmax-then-product, in both directions. `dropout` acts on those weights,
  which is dropout on the probabilities (it commutes with the division).
  The max is a constant to differentiation (softmax does not depend on it).
  Scores, weights and sums are float32 whatever the compute dtype.
  """
  scores = jnp.einsum('bqnh,bknh->bnqk', q * (1.0 / math.sqrt(q.shape[-1])), k)
  bias = jnp.where(key_mask, 0.0, -1e9)
  bias = bias[:, None, None, :] if key_mask.ndim == 2 else bias[:, None]  # [B, 1, 1|Q, T]
  scores = scores.astype(jnp.float32) + bias
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  total = jnp.swapaxes(jnp.sum(weights, axis=-1), 1, 2)[..., None]       # [B, Q, N, 1]
  out = jnp.einsum('bnqk,bknh->bqnh', dropout(weights).astype(v.dtype), v)
  return (out.astype(jnp.float32) / total).astype(v.dtype)
