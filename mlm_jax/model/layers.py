"""Building blocks the encoders share: initialisers with logical axis names, LayerNorm,
the activations' batch constraint, row gathers and BERT's self-attention (its kernels:
model/attention/).

Dense layers, dropout and GELU are not defined here: every module that uses
them has an `ops` field (runtime/platform_ops.Ops), passed down from the
model, which the builder makes with the forms for the platform the step is
compiled for; a module made without one uses the library's (Ops DEFAULT).
Both keep the library's parameter names and shapes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax.model import attention
from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding

# Logical names of parameter axes; sharding.LOGICAL_RULES maps them onto the
# mesh ('embed' onto 'fsdp'), so the model never names a mesh axis itself.
EMBED, MLP, HEADS, KV, VOCAB, TABLE = 'embed', 'mlp', 'heads', 'kv', 'vocab', 'table'
# The logical name of the activations' leading axis (LOGICAL_RULES: every device).
BATCH = 'batch'

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


def batch_split(x: Array) -> Array:
  """x [B, ...] constrained to keep its batch axis split as sharding.LOGICAL_RULES place 'batch'.

  The other axes are not split. Traced outside a mesh (one device, tests,
  interop) it is x itself; the step is traced on its mesh
  (sharding.traced_on).
  """
  return nn.with_logical_constraint(x, (BATCH,) + (None,) * (x.ndim - 1),
                                    rules=sharding.LOGICAL_RULES)


def take_rows(x: Array, rows: Array) -> Array:
  """x [B, T, ...] at rows [B, Q] (indices into T) -> [B, Q, ...]; x's batch may be 1."""
  return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)


class SelfAttention(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, mask: attention.Mask, deterministic: bool,
               context: Array | None = None, rows: Array | None = None) -> Array:
    """x [B, Q, d] attends to context [B, T, d] (default: x itself) -> [B, Q, d].

    mask: what each token may see (attention.Mask); rows [B, Q]: x holds
    those rows of the context (the last block at the masked slots).
    """
    cfg, ops = self.cfg, self.ops
    context = x if context is None else context
    head_dim = cfg.hidden_size // cfg.num_heads
    proj = lambda name: ops.dense_general(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, HEADS, KV)),
        bias_init=zeros((HEADS, KV)), name=name)
    q, k, v = (batch_split(proj(name)(inputs))                          # [B, Q or T, N, H]
               for name, inputs in (('query', x), ('key', context), ('value', context)))
    out = attention.attend(cfg, q, k, v, mask, deterministic, rows, ops.dropout)
    out = ops.dense_general(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                            kernel_init=dense_init(cfg, (HEADS, KV, EMBED)),
                            bias_init=zeros((EMBED,)), name='out')(out)
    # The block's dropout_rate follows; this one is the attention output's alone.
    return ops.dropout(cfg.attention_output_dropout_rate)(out, deterministic=deterministic)
