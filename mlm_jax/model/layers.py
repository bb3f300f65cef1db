"""Building blocks the encoders share: initialisers with logical axis names, LayerNorm,
GELU, the attention kernels (our XLA formulation, jax.nn.dot_product_attention or
cuDNN's fused kernel) and BERT's self-attention."""

from __future__ import annotations

import functools
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


def gelu(x: Array) -> Array:
  """BERT's exact GELU, x·Φ(x), written with erf as PyTorch does.

  Same function as jax.nn.gelu(approximate=False), which uses erfc; in the
  tiny config's train step on a 2-core CPU this form made each block's
  forward+backward ~1.5x faster (together with the attention below).
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def flat_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                     preferred_element_type=None) -> Array:
  """lax.dot_general, as one 2-D matmul when lhs's trailing axes meet rhs's leading ones.

  XLA:CPU's matmul library takes one contracting axis. nn.DenseGeneral's
  kernels for attention ([d, N, H] in, [N, H, d] out) contract or produce two
  axes at once, so the backward pass copied each such kernel into a
  transposed layout every step (BERT-base on 2 CPU cores: about 10% of the
  step). And any Dense on [B, T, d] has a weight gradient that contracts B
  and T together: XLA:CPU copied the output gradient transposed and ran a
  matmul at a third of the speed (the tiny step: 15% of its time). Merging
  the axes is a reshape of contiguous memory (free), and the matmul, both
  ways, is that of a plain 2-D Dense. Given as nn.Dense's and
  nn.DenseGeneral's `dot_general` (`Dense`, `DenseGeneral` below); the
  parameters keep their shapes and names.
  """
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  k = len(lhs_contract)
  if (lhs_batch or rhs_batch or tuple(lhs_contract) != tuple(range(lhs.ndim - k, lhs.ndim))
      or tuple(rhs_contract) != tuple(range(k))):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  lead, inner, rest = lhs.shape[:lhs.ndim - k], rhs.shape[:k], rhs.shape[k:]
  out = jax.lax.dot_general(lhs.reshape(math.prod(lead), math.prod(inner)),
                            rhs.reshape(math.prod(inner), math.prod(rest)),
                            (((1,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=preferred_element_type)
  return out.reshape(*lead, *rest)


# nn.Dense and nn.DenseGeneral with their products as 2-D matmuls (flat_dot_general):
# the model's and the heads' dense layers, whatever the rank of their input.
Dense = functools.partial(nn.Dense, dot_general=flat_dot_general)
DenseGeneral = functools.partial(nn.DenseGeneral, dot_general=flat_dot_general)


def dropout(x: Array, rate: float, key: Array) -> Array:
  """Inverted dropout: each element zeroed with probability `rate`, the rest scaled by 1/(1-rate).

  nn.Dropout draws a float32 uniform (32 random bits) per element. 16 bits
  are enough for the rate (0.1 is drawn as 6554/65536), so each 32-bit word
  of threefry decides two elements, its low and its high half, laid side by
  side along the last axis, which is never sharded here: the bits of an
  element still depend only on the key and its index, whatever the mesh.
  This halves the random-number work, the costliest part of dropout on a
  CPU (BERT-base's train step on 2 cores: 1.7-2.4x faster dropout, fewer
  elementwise passes). The mask's distribution is nn.Dropout's; its draws
  differ.
  """
  threshold = jnp.uint32(round(rate * 65536))
  *lead, n = x.shape
  if n % 2:
    keep = (jax.random.bits(key, x.shape, jnp.uint32) & 0xFFFF) >= threshold
  else:
    words = jax.random.bits(key, (*lead, n // 2), jnp.uint32)
    keep = jnp.concatenate([(words & 0xFFFF) >= threshold, (words >> 16) >= threshold], axis=-1)
  return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


class Dropout(nn.Module):
  """nn.Dropout (same fields and call) drawing its mask with `dropout`."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if self.rate == 0.0 or deterministic:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    return dropout(x, self.rate, self.make_rng('dropout'))


def attention_kernel(cfg: ModelConfig) -> str:
  """cfg.attention, with 'auto' resolved for JAX's backend here ('xla', 'dot_product', 'cudnn')."""
  return resolve_attention(cfg.attention, jax.default_backend(), cfg.dtype,
                           cfg.attention_dropout_rate)


def uses_cudnn_attention(cfg: ModelConfig) -> bool:
  """The fused cuDNN (flash) kernel: asked for, or 'auto' resolved to it on this backend."""
  return attention_kernel(cfg) == 'cudnn'


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
                           lambda w: Dropout(dropout)(w, deterministic=dropout == 0.0))


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
    proj = lambda name: DenseGeneral(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, HEADS, KV)),
        bias_init=zeros((HEADS, KV)), name=name)
    q, k, v = (cfg.batch_split(proj(name)(inputs))                      # [B, Q or T, N, H]
               for name, inputs in (('query', x), ('key', context), ('value', context)))
    out = attend(cfg, q, k, v, key_mask, deterministic)
    return DenseGeneral(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                        kernel_init=dense_init(cfg, (HEADS, KV, EMBED)),
                        bias_init=zeros((EMBED,)), name='out')(out)
