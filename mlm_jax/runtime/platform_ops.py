"""The operations whose best form depends on the platform a step is compiled for.

Everywhere, the library defaults are the code path: flax's nn.Dense,
nn.DenseGeneral and nn.Dropout, jax.nn.gelu, jnp.argmax and optax's
clip_by_global_norm. XLA's CPU backend runs a few of them in ways that waste
most of a small step, so on 'cpu' `for_platform` returns replacements that
compute the same function (dropout: the same distribution) in a form that
backend handles well. The choice is made once, where a step is built
(training/build.py, for the platform of the mesh's devices, not the host's),
and reaches the model as its modules' `ops` field. Every replacement has a test
that it computes what the default computes (tests/test_platform_ops.py);
what each one gains on a CPU is measured in docs/benchmarks.md.

The CPU-only settings of the train step live here too: how many concurrent
chains a step is split into (`concurrent_chains`) and the XLA:CPU compiler
options that go with them (`train_compiler_options`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from mlm_jax.runtime import cores

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Ops:
  """One platform's forms of the operations that differ; each has the default's signature."""

  name: str
  dense: Callable[..., nn.Module]           # nn.Dense
  dense_general: Callable[..., nn.Module]   # nn.DenseGeneral
  dropout: Callable[..., nn.Module]         # nn.Dropout (rate; call(x, deterministic))
  gelu: Callable[[Array], Array]            # exact GELU, x·Φ(x)
  argmax: Callable[[Array], Array]          # over the last axis, the first index of the max
  clip_by_global_norm: Callable[[float], optax.GradientTransformation]


# ---------------------------------------------------------------------------
# The CPU forms.


def flat_dot_general(lhs: Array, rhs: Array, dimension_numbers, precision=None,
                     preferred_element_type=None) -> Array:
  """lax.dot_general, as one 2-D matmul when lhs's trailing axes meet rhs's leading ones.

  XLA:CPU's matmul library takes one contracting axis and no batch axes.
  nn.DenseGeneral's attention kernels ([d, N, H] in, [N, H, d] out) contract
  or produce two axes at once, and any Dense on [B, T, d] has a weight
  gradient that contracts B and T together; XLA:CPU then copies an operand
  into a transposed layout every step, or falls back to a slower loop.
  Merging the axes is a reshape of contiguous memory, after which the
  product, in both directions, is that of a plain 2-D Dense. Other
  dimension numbers go to lax.dot_general unchanged. Parameters keep their
  shapes and names, so checkpoints do not depend on the platform.
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


def erf_gelu(x: Array) -> Array:
  """The exact GELU, x·Φ(x), written with erf as PyTorch does.

  The same function as jax.nn.gelu(approximate=False), which XLA lowers
  through erfc; the erf form is the one XLA:CPU vectorises well.
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def half_word_dropout(x: Array, rate: float, key: Array) -> Array:
  """Inverted dropout: each element zeroed with probability `rate`, the rest scaled by 1/(1-rate).

  nn.Dropout draws 32 random bits per element; 16 bits are enough to place
  the rate (0.1 is 6554/65536), so each 32-bit word decides two elements,
  its low and high halves laid side by side along the last axis. Random-bit
  generation is the costly part of dropout on a CPU, and this halves it.
  The last axis is never sharded, so an element's bits still depend only on
  the key and its index, whatever the mesh. The mask's distribution is
  nn.Dropout's (to 16-bit resolution of the rate); its draws differ.
  """
  threshold = jnp.uint32(round(rate * 65536))
  *lead, n = x.shape
  if n % 2:
    keep = (jax.random.bits(key, x.shape, jnp.uint32) & 0xFFFF) >= threshold
  else:
    words = jax.random.bits(key, (*lead, n // 2), jnp.uint32)
    keep = jnp.concatenate([(words & 0xFFFF) >= threshold, (words >> 16) >= threshold], axis=-1)
  return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


class HalfWordDropout(nn.Module):
  """nn.Dropout's fields and call, its mask drawn by `half_word_dropout`."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if self.rate == 0.0 or deterministic:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    return half_word_dropout(x, self.rate, self.make_rng('dropout'))


# Flax names an unnamed submodule after its class ('Dropout_0', 'Dropout_1', ...)
# and folds that name into the submodule's 'dropout' key. Named as nn.Dropout,
# this one takes nn.Dropout's place in the module tree and receives the same
# key, so the tree and the keys do not depend on the platform.
HalfWordDropout.__name__ = nn.Dropout.__name__


def reduce_argmax(x: Array) -> Array:
  """jnp.argmax(x, axis=-1) (the first index of the largest value), as two plain reductions.

  XLA:CPU runs argmax as one reduction over (value, index) pairs, which it
  does not vectorise; a max, then a min over the indices where it is
  reached, are two reductions it does. NaN aside, the same result.
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  n = x.shape[-1]
  return jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def scaled_clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm's update, as one scalar factor on every gradient.

  optax writes each clipped tensor as `select(norm < max_norm, g, g / norm *
  max_norm)`, which XLA:CPU computes as a pass of its own over every
  gradient. Here each gradient is multiplied by `max_norm / max(norm,
  max_norm)`: exactly 1 below the threshold, the same clip to the last bit
  or two above it, and the product fuses into the Adam moments' loops. Its
  state is optax's EmptyState, so checkpoints do not depend on the platform.
  `max_norm=inf` never clips.
  """
  def update_fn(updates, state, params=None):
    del params
    if math.isinf(max_norm):
      return updates, state
    g_norm = optax.tree.norm(updates)
    scale = max_norm / jnp.maximum(g_norm, max_norm)
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


DEFAULT = Ops(
    name='default',
    dense=nn.Dense,
    dense_general=nn.DenseGeneral,
    dropout=nn.Dropout,
    gelu=functools.partial(jax.nn.gelu, approximate=False),
    argmax=functools.partial(jnp.argmax, axis=-1),
    clip_by_global_norm=optax.clip_by_global_norm)

CPU = Ops(
    name='cpu',
    dense=functools.partial(nn.Dense, dot_general=flat_dot_general),
    dense_general=functools.partial(nn.DenseGeneral, dot_general=flat_dot_general),
    dropout=HalfWordDropout,
    gelu=erf_gelu,
    argmax=reduce_argmax,
    clip_by_global_norm=scaled_clip_by_global_norm)


def for_platform(platform: str | None = None) -> Ops:
  """The operations for a JAX platform ('cpu', 'gpu', 'tpu'; None: JAX's default backend)."""
  return CPU if (platform or jax.default_backend()) == 'cpu' else DEFAULT


# ---------------------------------------------------------------------------
# The CPU-only settings of the train step.


def concurrent_chains(train: ml_collections.ConfigDict, num_devices: int,
                      platform: str | None = None) -> int:
  """config.train.concurrent_chains with 0 (auto) resolved for `platform` (default: JAX's backend).

  XLA:CPU runs each elementwise kernel on one thread, so a step on one CPU
  device leaves cores idle; splitting each micro-batch into independent
  chains, written side by side in one program, lets the runtime run one per
  core. Auto is 2 on a single CPU device with at least 2 usable cores when
  each micro-batch splits evenly, else 1: an accelerator runs each kernel on
  the whole chip already, and smaller parts only shrink the kernels.
  """
  chains = train.concurrent_chains
  if chains:
    return chains
  rows = train.batch_size // (num_devices * train.grad_accum_steps)
  platform = platform or jax.default_backend()
  if platform == 'cpu' and num_devices == 1 and cores.usable_cores() >= 2 and rows % 2 == 0:
    return 2
  return 1


def train_compiler_options(platform: str, chains: int) -> dict[str, Any]:
  """XLA options for the train step: with concurrent chains on a CPU, single-threaded Eigen.

  The chains already keep every core busy; Eigen's matmuls (XLA:CPU gives
  it the products its own matmul library does not take) would otherwise
  split each product over threads the other chain needs. Elsewhere, none.
  """
  if platform == 'cpu' and chains > 1 and _cpu_compiler_accepts('xla_cpu_multi_thread_eigen',
                                                                 False):
    return {'xla_cpu_multi_thread_eigen': False}
  return {}


@functools.cache
def _cpu_compiler_accepts(option: str, value: Any) -> bool:
  """Whether this jaxlib's CPU compiler knows the option (names come and go between versions)."""
  try:
    x = jax.device_put(jnp.zeros(()), jax.local_devices(backend='cpu')[0])
    jax.jit(lambda v: v + 1).lower(x).compile(compiler_options={option: value})
  except jax.errors.JaxRuntimeError:
    return False
  return True
