"""Building blocks the encoders share: initialisers with logical axis names, LayerNorm,
the attention kernels (our XLA formulation, jax.nn.dot_product_attention or
cuDNN's fused kernel) and BERT's self-attention.

Dense layers, dropout and GELU are not defined here: every module takes them
from cfg.ops (runtime/platform_ops.py), the forms for the platform the step
is compiled for, which keep the library's parameter names and shapes.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.config import resolve_attention

# Logical names of parameter axes; sharding.LOGICAL_RULES maps them onto the
# mesh ('embed' onto 'fsdp'), so the model never names a mesh axis itself.
EMBED, MLP, HEADS, KV, VOCAB, TABLE = 'embed', 'mlp', 'heads', 'kv', 'vocab', 'table'

# What a block keeps for the backward pass (config.model.remat, besides 'none').
REMAT_POLICIES = {
    'full': None,  # Keep only each block's input; recompute the rest.
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # Keep matmul outputs.
}


def dense_init(cfg: ModelConfig, names: tuple[str, ...], std: float | None = None):
  """Truncated normal of `std` (default cfg.initializer_range), axes named `names`."""
  std = cfg.initializer_range if std is None else std
  return nn.with_logical_partitioning(nn.initializers.truncated_normal(std), names)


def zeros(names: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def layer_norm(cfg: ModelConfig, name: str, use_bias: bool = True) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype, name=name, use_bias=use_bias,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (EMBED,)),
                      bias_init=zeros((EMBED,)))


def attention_kernel(cfg: ModelConfig) -> str:
  """cfg.attention, 'auto' resolved for cfg.platform ('xla', 'dot_product' or 'cudnn')."""
  return resolve_attention(cfg.attention, cfg.platform or jax.default_backend(), cfg.dtype,
                           cfg.attention_dropout_rate)


def take_rows(x: Array, rows: Array) -> Array:
  """x [B, T, ...] at rows [B, Q] (indices into T) -> [B, Q, ...]; x's batch may be 1."""
  return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)


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


def attend(cfg: ModelConfig, q: Array, k: Array, v: Array, key_mask: Array,
           deterministic: bool) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H], by the kernel cfg.attention resolves to.

  key_mask: [B, T] bool (True = real token), or [B, Q, T] (what each query
  may see). Called inside a module's compact method (its dropout is one).
  Real tokens come first in every row and padding last, so a [B, T] mask is
  also a length per row: the fused cuDNN kernel takes those lengths rather
  than a dense [B, 1, T, T] mask (slow there). cuDNN has no two-sided window,
  so a [B, Q, T] mask goes to jax.nn.dot_product_attention's XLA path
  instead. Only our kernel ('xla') has dropout on the attention
  probabilities (config checks and 'auto' see to it).
  """
  dropout = 0.0 if deterministic else cfg.attention_dropout_rate
  kernel = attention_kernel(cfg)
  if dropout == 0.0 and kernel == 'cudnn' and key_mask.ndim == 2:
    lengths = jnp.sum(key_mask, axis=-1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                        implementation='cudnn')
  if dropout == 0.0 and kernel in ('dot_product', 'cudnn'):
    mask = key_mask[:, None, None, :] if key_mask.ndim == 2 else key_mask[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation='xla')
  return softmax_attention(q, k, v, key_mask,
                           lambda w: cfg.ops.dropout(dropout)(w, deterministic=dropout == 0.0))


class SelfAttention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool,
               context: Array | None = None) -> Array:
    """x [B, Q, d] attends to context [B, T, d] (default: x itself) -> [B, Q, d].

    key_mask: [B, T] bool (True = real token); the kernel: `attend`.
    """
    cfg = self.cfg
    context = x if context is None else context
    head_dim = cfg.hidden_size // cfg.num_heads
    proj = lambda name: cfg.ops.dense_general(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, HEADS, KV)),
        bias_init=zeros((HEADS, KV)), name=name)
    q, k, v = (cfg.batch_split(proj(name)(inputs))                      # [B, Q or T, N, H]
               for name, inputs in (('query', x), ('key', context), ('value', context)))
    out = attend(cfg, q, k, v, key_mask, deterministic)
    return cfg.ops.dense_general(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                                 kernel_init=dense_init(cfg, (HEADS, KV, EMBED)),
                                 bias_init=zeros((EMBED,)), name='out')(out)
