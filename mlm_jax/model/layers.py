"""Building blocks the encoders share: initialisers with logical axis names, LayerNorm,
row gathers and BERT's self-attention (its kernels: model/attention/).

Dense layers, dropout and GELU are not defined here: every module takes them
from cfg.ops (runtime/platform_ops.py), the forms for the platform the step
is compiled for, which keep the library's parameter names and shapes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax.model import attention
from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig

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


def take_rows(x: Array, rows: Array) -> Array:
  """x [B, T, ...] at rows [B, Q] (indices into T) -> [B, Q, ...]; x's batch may be 1."""
  return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)


class SelfAttention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, mask: attention.Mask, deterministic: bool,
               context: Array | None = None, rows: Array | None = None) -> Array:
    """x [B, Q, d] attends to context [B, T, d] (default: x itself) -> [B, Q, d].

    mask: what each token may see (attention.Mask); rows [B, Q]: x holds
    those rows of the context (the last block at the masked slots).
    """
    cfg = self.cfg
    context = x if context is None else context
    head_dim = cfg.hidden_size // cfg.num_heads
    proj = lambda name: cfg.ops.dense_general(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, HEADS, KV)),
        bias_init=zeros((HEADS, KV)), name=name)
    q, k, v = (cfg.batch_split(proj(name)(inputs))                      # [B, Q or T, N, H]
               for name, inputs in (('query', x), ('key', context), ('value', context)))
    out = attention.attend(cfg, q, k, v, mask, deterministic, rows)
    return cfg.ops.dense_general(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                                 kernel_init=dense_init(cfg, (HEADS, KV, EMBED)),
                                 bias_init=zeros((EMBED,)), name='out')(out)
