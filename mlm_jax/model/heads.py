"""Output heads: the MLM head on the gathered masked slots, and BERT's sentence-pair head."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.layers import EMBED
from mlm_jax.model.layers import MLP
from mlm_jax.model.layers import VOCAB
from mlm_jax.model.layers import batch_split
from mlm_jax.model.layers import dense_init
from mlm_jax.model.layers import layer_norm
from mlm_jax.model.layers import take_rows
from mlm_jax.model.layers import zeros
from mlm_jax.runtime import platform_ops


class MLMHead(nn.Module):
  """Gather at masked positions -> dense + GELU + LayerNorm -> tied logits (+ a bias).

  BERT's head by default; ModernBERT's has no bias in the dense layer and
  the LayerNorm (use_bias=False) and initialises the dense kernel with a
  smaller std (transform_std).
  """

  cfg: ModelConfig
  use_bias: bool = True
  transform_std: float | None = None  # None: cfg.initializer_range.
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, sequence: Array, masked_positions: Array | None, embedding: Array) -> Array:
    """sequence [B, T, d], masked_positions [B, P], embedding [V, d] -> logits [B, P, V].

    masked_positions None: sequence is already at the masked slots, [B, P, d].
    """
    cfg, ops = self.cfg, self.ops
    if masked_positions is not None:
      sequence = take_rows(sequence, masked_positions)
    x = batch_split(sequence)                                               # [B, P, d]
    x = ops.dense(cfg.hidden_size, dtype=cfg.dtype, use_bias=self.use_bias,
                  kernel_init=dense_init(cfg, (EMBED, MLP), self.transform_std),
                  bias_init=zeros((MLP,)), name='transform')(x)
    x = layer_norm(cfg, 'layer_norm', self.use_bias)(ops.gelu(x))
    bias = self.param('output_bias', zeros((VOCAB,)), (cfg.padded_vocab_size,))
    # As [B·P, d] @ [d, V]: the embedding's gradient contracts one axis, not B and P.
    b, p, d = x.shape
    logits = jnp.einsum('nd,vd->nv', x.reshape(b * p, d), embedding.astype(cfg.dtype))
    logits = logits.reshape(b, p, -1)
    logits = logits.astype(jnp.float32) + bias
    if cfg.padded_vocab_size > cfg.vocab_size:
      # Rows past the tokenizer's vocabulary exist only for alignment.
      real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
      logits = jnp.where(real, logits, -1e9)
    return logits


class SentencePairHead(nn.Module):
  """BERT's pooler (dense + tanh on [CLS]) and a 2-way classifier (NSP or SOP)."""

  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, sequence: Array, deterministic: bool) -> Array:
    """sequence [B, T or fewer, d], its row 0 the [CLS] token's -> logits [B, 2]."""
    cfg, ops = self.cfg, self.ops
    x = ops.dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, MLP)),
                  bias_init=zeros((MLP,)), name='pooler')(sequence[:, 0])
    x = ops.dropout(cfg.dropout_rate)(jnp.tanh(x), deterministic=deterministic)
    return ops.dense(2, kernel_init=dense_init(cfg, (MLP, None)), bias_init=zeros((None,)),
                     name='classifier')(x).astype(jnp.float32)
