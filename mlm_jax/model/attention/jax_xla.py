"""'jax_xla': jax.nn.dot_product_attention(implementation='xla') over a dense mask.

JAX's own XLA formulation, with no dropout on the probabilities. On TPUs
'auto' keeps global rows under choice.SPLASH_FROM tokens without document
ids on it (BERT's 128 and 512) rather than on splash attention.
"""

from __future__ import annotations

import jax

Array = jax.Array


def jax_xla_attention(q: Array, k: Array, v: Array, allowed: Array) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H].

  allowed: [B, T], the keys every query may see, or [B, Q, T], per query
  (Mask.allowed).
  """
  dense = allowed[:, None, None, :] if allowed.ndim == 2 else allowed[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation='xla')
