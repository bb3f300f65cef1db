"""The embedding model: the pretrained encoder, then pooling to one vector per text.

Parameters: encoder/... exactly as the pretraining model's (so a run's or a
Hugging Face checkpoint's encoder drops in), and with a learned temperature
`log_scale`, a scalar: log of the logit scale 1 / temperature (CLIP's).

Pooling, over the encoder's last layer [B, T, d] and the attention mask [B, T]
(padding last in every row), as sentence-transformers' Pooling module
computes it, so that an export encodes the same vectors:

  mean   the mean of the real tokens' vectors ('mean')
  cls    the first token's vector ('cls')
  last   the last real token's vector ('lasttoken')

The vectors are float32 and not normalised: similarity is their cosine
(loss.py normalises).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax import model as model_lib
from mlm_jax.model import bert
from mlm_jax.model import modern
from mlm_jax.runtime import platform_ops

Array = jax.Array
# config.model.pooling -> sentence-transformers' name for the same pooling (Pooling's mode).
ST_POOLING = {'mean': 'mean', 'cls': 'cls', 'last': 'lasttoken'}


def pool(sequence: Array, attention_mask: Array, pooling: str) -> Array:
  """sequence [B, T, d], attention_mask [B, T] -> [B, d] float32."""
  x = sequence.astype(jnp.float32)
  mask = attention_mask.astype(jnp.float32)
  if pooling == 'cls':
    return x[:, 0]
  if pooling == 'last':
    last = jnp.maximum(jnp.sum(attention_mask, axis=1) - 1, 0)                 # [B]
    return jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
  total = jnp.einsum('btd,bt->bd', x, mask)
  return total / jnp.maximum(jnp.sum(mask, axis=1), 1e-9)[:, None]


class Embedder(nn.Module):
  """model.apply(params, batch) -> vectors [B, d] float32, one per row of the batch."""

  cfg: model_lib.ModelConfig
  pooling: str
  # The initial log(1 / temperature) of a learned temperature; None: a fixed one.
  log_scale_init: float | None = None
  # The platform's dense, dropout and GELU (the builder's); the library's by default.
  ops: platform_ops.Ops = platform_ops.DEFAULT

  def setup(self):
    encoder = modern.ModernEncoder if self.cfg.variant == 'modern' else bert.Encoder
    self.encoder = encoder(self.cfg, self.ops)
    if self.log_scale_init is not None:
      self.log_scale = self.param('log_scale', nn.initializers.constant(self.log_scale_init),
                                  (), jnp.float32)

  def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    """batch: input_ids, segment_ids, attention_mask [B, T] -> [B, d]."""
    sequence = self.encoder(model_lib.EncoderInputs.of(batch), deterministic)
    return pool(sequence, batch['attention_mask'], self.pooling)
