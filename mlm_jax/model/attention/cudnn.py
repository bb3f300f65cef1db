"""'cudnn': cuDNN's fused flash attention (NVIDIA GPUs, 16-bit), given row lengths.

Reached through jax.nn.dot_product_attention(implementation='cudnn'). It
takes the keys of each row as a length, so it cannot keep documents apart
nor hold a two-sided window, and it trains on even lengths only: `choose`
hands such calls to another kernel.
"""

from __future__ import annotations

import jax

from mlm_jax.model.attention.mask import Mask

Array = jax.Array


def cudnn_attention(q: Array, k: Array, v: Array, mask: Mask) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H]; each query sees its row's real keys."""
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=mask.lengths(),
                                      implementation='cudnn')
