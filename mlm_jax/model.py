"""BERT encoder and MLM head as Flax Linen modules.

Shapes: B batch, T sequence length, P masked slots per row, d hidden size,
N heads, H = d / N head size, V padded vocabulary.

The encoder is the original post-LayerNorm BERT; the MLM head follows
keras_nlp's MLMHead: gather the encoder output at the masked positions only,
then dense + GELU + LayerNorm and a projection tied to the token embedding
(plus a bias). No logits are computed for unmasked positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int            # Real vocabulary (tokenizer size).
  padded_vocab_size: int     # Embedding rows: vocab_size rounded up to 128.
  num_layers: int = 12
  hidden_size: int = 768
  num_heads: int = 12
  intermediate_size: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-12
  dtype: Any = jnp.float32   # Compute dtype; parameters are always float32.

  def shape_record(self) -> dict[str, int]:
    """What a checkpoint's parameters must agree with to be loaded into this model."""
    return {k: getattr(self, k) for k in (
        'vocab_size', 'padded_vocab_size', 'num_layers', 'hidden_size', 'num_heads',
        'intermediate_size', 'max_position_embeddings', 'type_vocab_size')}

  @classmethod
  def from_config(cls, model_config, vocab_size: int, padded_vocab_size: int,
                  dtype: Any) -> 'ModelConfig':
    fields = {f.name for f in dataclasses.fields(cls)} - {'vocab_size', 'padded_vocab_size', 'dtype'}
    return cls(vocab_size=vocab_size, padded_vocab_size=padded_vocab_size, dtype=dtype,
               **{k: model_config[k] for k in fields})


def _dense_init(cfg: ModelConfig):
  return nn.initializers.truncated_normal(cfg.initializer_range)


def _gelu(x: Array) -> Array:
  return nn.gelu(x, approximate=False)  # BERT's exact (erf) GELU.


class Embeddings(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, input_ids: Array, segment_ids: Array, deterministic: bool) -> Array:
    """input_ids, segment_ids: [B, T] -> [B, T, d]."""
    cfg = self.cfg
    token_table = nn.Embed(cfg.padded_vocab_size, cfg.hidden_size,
                           embedding_init=_dense_init(cfg), name='token')
    x = token_table(input_ids)
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x += nn.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                  embedding_init=_dense_init(cfg), name='position')(positions)
    x += nn.Embed(cfg.type_vocab_size, cfg.hidden_size,
                  embedding_init=_dense_init(cfg), name='segment')(segment_ids)
    x = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype, name='layer_norm')(x)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class SelfAttention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    """x: [B, T, d], key_mask: [B, T] bool (True = real token) -> [B, T, d]."""
    cfg = self.cfg
    head_dim = cfg.hidden_size // cfg.num_heads
    proj = lambda name: nn.DenseGeneral(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=_dense_init(cfg), name=name)
    q, k, v = proj('query')(x), proj('key')(x), proj('value')(x)  # [B, T, N, H]
    mask = key_mask[:, None, None, :]                               # [B, 1, 1, T]
    dropout = 0.0 if deterministic else cfg.attention_dropout_rate
    if dropout > 0.0:
      # jax.nn.dot_product_attention has no dropout on the probabilities.
      logits = jnp.einsum('bqnh,bknh->bnqk', q, k) / jnp.sqrt(head_dim).astype(cfg.dtype)
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
      probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(cfg.dtype)
      probs = nn.Dropout(dropout)(probs, deterministic=False)
      out = jnp.einsum('bnqk,bknh->bqnh', probs, v)
    else:
      out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    return nn.DenseGeneral(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                           kernel_init=_dense_init(cfg), name='out')(out)


class TransformerBlock(nn.Module):
  """Post-LN block: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    cfg = self.cfg
    ln = lambda name: nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype, name=name)
    dense = lambda features, name: nn.Dense(
        features, dtype=cfg.dtype, kernel_init=_dense_init(cfg), name=name)
    h = SelfAttention(cfg, name='attention')(x, key_mask, deterministic)
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    x = ln('attention_layer_norm')(x + h)
    h = _gelu(dense(cfg.intermediate_size, 'intermediate')(x))   # [B, T, d_ff]
    h = dense(cfg.hidden_size, 'output')(h)
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    return ln('output_layer_norm')(x + h)


class Encoder(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, input_ids: Array, segment_ids: Array, attention_mask: Array,
               deterministic: bool = True, return_all_layers: bool = False) -> Array:
    """[B, T] ids -> [B, T, d] contextual embeddings.

    With return_all_layers: [L + 1, B, T, d], the embeddings' output (index 0)
    and then every block's, the last being the usual output.
    """
    x = Embeddings(self.cfg, name='embeddings')(input_ids, segment_ids, deterministic)
    key_mask = attention_mask.astype(bool)
    layers = [x]
    for i in range(self.cfg.num_layers):
      x = TransformerBlock(self.cfg, name=f'layer_{i}')(x, key_mask, deterministic)
      layers.append(x)
    return jnp.stack(layers) if return_all_layers else x


class MLMHead(nn.Module):
  """Gather at masked positions -> dense + GELU + LayerNorm -> tied logits."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, sequence: Array, masked_positions: Array, embedding: Array) -> Array:
    """sequence [B, T, d], masked_positions [B, P], embedding [V, d] -> logits [B, P, V]."""
    cfg = self.cfg
    x = jnp.take_along_axis(sequence, masked_positions[..., None], axis=1)  # [B, P, d]
    x = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=_dense_init(cfg),
                 name='transform')(x)
    x = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype, name='layer_norm')(_gelu(x))
    bias = self.param('output_bias', nn.initializers.zeros, (cfg.padded_vocab_size,))
    logits = jnp.einsum('bpd,vd->bpv', x, embedding.astype(cfg.dtype))
    logits = logits.astype(jnp.float32) + bias
    if cfg.padded_vocab_size > cfg.vocab_size:
      # Rows past the tokenizer's vocabulary exist only for alignment.
      real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
      logits = jnp.where(real, logits, -1e9)
    return logits


class BertForMLM(nn.Module):
  """model.apply(params, batch) -> MLM logits [B, P, V] at the masked slots.

  For probing, `method=BertForMLM.all_layers` gives every layer's output and
  `method=BertForMLM.mlm_logits` runs the head on any one of them.
  """

  cfg: ModelConfig

  def setup(self):
    self.encoder = Encoder(self.cfg)
    self.mlm_head = MLMHead(self.cfg)

  def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    sequence = self.encoder(batch['input_ids'], batch['segment_ids'],
                            batch['attention_mask'], deterministic)
    return self.mlm_logits(sequence, batch['masked_positions'])

  def all_layers(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    """[L + 1, B, T, d]: the embeddings' output, then each block's."""
    return self.encoder(batch['input_ids'], batch['segment_ids'], batch['attention_mask'],
                        deterministic, return_all_layers=True)

  def mlm_logits(self, sequence: Array, masked_positions: Array) -> Array:
    """sequence [B, T, d], masked_positions [B, P] -> logits [B, P, V] (tied embedding)."""
    embedding = self.encoder.variables['params']['embeddings']['token']['embedding']
    return self.mlm_head(sequence, masked_positions, embedding)
