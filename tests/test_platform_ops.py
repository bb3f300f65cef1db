"""The CPU forms of runtime/platform_ops compute what the library defaults compute.

A run on a CPU trains with these forms and the same config on a GPU or TPU
with the defaults: their parameters, checkpoints and (dropout aside, whose
distribution is the same) values must not depend on which was used.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mlm_jax import model as model_lib
from mlm_jax.config import fields
from mlm_jax.errors import ConfigError
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding
from tests.conftest import model_config

CPU, DEFAULT = platform_ops.CPU, platform_ops.DEFAULT


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_cpu_forms_are_chosen_for_cpu_only():
  assert platform_ops.for_platform('cpu') is CPU
  assert platform_ops.for_platform('gpu') is DEFAULT
  assert platform_ops.for_platform('tpu') is DEFAULT
  assert platform_ops.for_platform('') is CPU   # JAX's backend here (the tests run on a CPU).
  # The platform is not part of what a checkpoint must agree with.
  assert fields.shape_record(model_config(platform='tpu')) == fields.shape_record(model_config(platform='cpu'))


def test_model_config_takes_its_platform_from_the_caller_never_from_the_host():
  for platform in ('', 'cuda', None):
    with pytest.raises(ConfigError, match=r'ModelConfig.platform=.*one of .cpu., .gpu., .tpu.'):
      model_config(platform=platform)
  # A model made without a builder uses the library's forms, whatever the platform.
  assert model_lib.mlm_model(model_config(platform='cpu')).ops is DEFAULT


def test_the_builder_gives_the_model_the_forms_of_its_meshs_platform():
  from configs import bert_tiny
  from mlm_jax.training import build as build_lib
  config = bert_tiny.get_config()
  config.model.num_layers, config.data.seq_len = 1, 16
  built = build_lib.build(config, 100, sharding.make_mesh(devices=jax.devices()[:1]))
  assert built.model_cfg.platform == 'cpu'
  # The state's apply_fn is the model's: its ops are the CPU forms, its config holds no sharding.
  assert built.abstract_state.apply_fn.__self__.ops is CPU


@pytest.mark.parametrize('lhs_shape, rhs_shape, dims', [
    ((2, 5, 8), (8, 4, 3), (((2,), (0,)), ((), ()))),             # [d] -> [N, H]: a query.
    ((2, 5, 4, 3), (4, 3, 8), (((2, 3), (0, 1)), ((), ()))),     # [N, H] -> [d]: the output one.
    ((2, 5, 8), (8, 3, 2, 4), (((2,), (0,)), ((), ()))),          # [d] -> [3, N, H]: a fused qkv.
    ((2, 5, 8), (3, 8, 4), (((2,), (1,)), ((), ()))),             # Not leading: lax.dot_general.
    ((3, 5, 8), (3, 8, 4), (((2,), (1,)), ((0,), (0,)))),         # Batch axes: lax.dot_general.
])
def test_flat_dot_general_is_dot_general(lhs_shape, rhs_shape, dims):
  lhs, rhs = _normal(0, lhs_shape), _normal(1, rhs_shape)
  want = jax.lax.dot_general(lhs, rhs, dims)
  got = platform_ops.flat_dot_general(lhs, rhs, dims)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # And its gradients (the backward pass is what it is for).
  loss = lambda f: lambda a, b: jnp.sum(f(a, b, dims) ** 2)
  for g, w in zip(jax.grad(loss(platform_ops.flat_dot_general), (0, 1))(lhs, rhs),
                  jax.grad(loss(jax.lax.dot_general), (0, 1))(lhs, rhs)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def _same_module(make_cpu, make_default, x):
  """Both modules on x with the same parameters: equal trees, outputs and gradients."""
  params = make_default().init(jax.random.key(0), x)
  assert (jax.tree_util.tree_map(jnp.shape, make_cpu().init(jax.random.key(0), x))
          == jax.tree_util.tree_map(jnp.shape, params))
  def loss(module):
    return lambda p, v: jnp.sum(jnp.sin(module.apply(p, v)))
  np.testing.assert_allclose(make_cpu().apply(params, x), make_default().apply(params, x),
                             rtol=1e-5, atol=1e-5)
  got = jax.grad(loss(make_cpu()), (0, 1))(params, x)
  want = jax.grad(loss(make_default()), (0, 1))(params, x)
  jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4),
                         got, want)


@pytest.mark.parametrize('shape', [(7, 8), (2, 5, 8), (2, 3, 5, 8)])
def test_dense_is_nn_dense(shape):
  _same_module(lambda: CPU.dense(6), lambda: DEFAULT.dense(6), _normal(2, shape))


@pytest.mark.parametrize('shape, features, axis', [
    ((2, 5, 8), (4, 2), -1),          # Attention's q, k, v: [d] -> [N, H], kernel [d, N, H].
    ((2, 5, 4, 2), 8, (-2, -1)),      # Attention's output: [N, H] -> [d], kernel [N, H, d].
    ((2, 5, 8), (3, 4, 2), -1),       # ModernBERT's fused q/k/v: kernel [d, 3, N, H].
    ((6, 4, 2), 5, (-2, -1)),         # Rank 3 in, two contracted axes.
    ((2, 3, 4, 5), 6, (1, 2)),        # Axes not at the end: lax.dot_general's path.
])
def test_dense_general_is_nn_dense_general(shape, features, axis):
  _same_module(lambda: CPU.dense_general(features, axis=axis),
               lambda: DEFAULT.dense_general(features, axis=axis), _normal(3, shape))


def test_erf_gelu_is_the_exact_gelu_with_its_gradient():
  x = jnp.linspace(-8.0, 8.0, 1001)
  np.testing.assert_allclose(CPU.gelu(x), DEFAULT.gelu(x), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(CPU.gelu(x), jax.nn.gelu(x, approximate=False), atol=1e-6, rtol=1e-6)
  grad = lambda f: jax.vmap(jax.grad(f))(x)
  np.testing.assert_allclose(grad(CPU.gelu), grad(lambda v: jax.nn.gelu(v, approximate=False)),
                             atol=1e-6, rtol=1e-5)


def test_reduce_argmax_is_jnp_argmax_with_ties_to_the_first_index():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 6, 50)).astype(np.float32)
  x = np.array(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))  # Many ties.
  x[0, 0] = 1.0           # All equal: index 0.
  x[1, 1, 7:] = 9.0       # A tie from index 7 on.
  x[2, 2, 40:] = -1e9     # Masked-out tail.
  np.testing.assert_array_equal(CPU.argmax(jnp.asarray(x)), DEFAULT.argmax(jnp.asarray(x)))
  np.testing.assert_array_equal(CPU.argmax(jnp.asarray(x)), jnp.argmax(x, axis=-1))
  assert CPU.argmax(jnp.asarray(x))[1, 1] == 7


@pytest.mark.parametrize('max_norm', [0.05, 1.0, 1e3, float('inf')])
def test_scaled_clip_by_global_norm_is_optax_clip(max_norm):
  grads = {'a': _normal(0, (7, 5)), 'b': {'c': _normal(1, (3,))}}   # Norm about 6.
  ours = CPU.clip_by_global_norm(max_norm)
  theirs = optax.clip_by_global_norm(max_norm)
  got, state = ours.update(grads, ours.init(grads))
  want, _ = theirs.update(grads, theirs.init(grads))
  # The same state (checkpoints are interchangeable) and the same clipped values.
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(theirs.init(grads))
  jax.tree_util.tree_map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)
  norm = float(optax.tree.norm(got))
  if max_norm < 6:
    assert norm == pytest.approx(max_norm, rel=1e-6)
  else:   # Below the threshold the gradients pass bit for bit.
    jax.tree_util.tree_map(lambda g, w: np.testing.assert_array_equal(g, w), got, grads)


def _dropout(cls, rate, x, seed=0, deterministic=False):
  return cls(rate).apply({}, x, deterministic=deterministic, rngs={'dropout': jax.random.key(seed)})


@pytest.mark.parametrize('cls', [CPU.dropout, DEFAULT.dropout])
def test_half_word_dropout_keeps_as_many_as_nn_dropout_and_scales_them_alike(cls):
  rate, x = 0.1, _normal(0, (1000, 1000))
  out = np.asarray(_dropout(cls, rate, x))
  kept = out != 0
  # One million draws: the kept fraction is 1 - rate within 5 standard errors.
  assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / kept.size)
  np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
  # Rate 1 drops everything; deterministic (and rate 0) passes x through.
  np.testing.assert_array_equal(_dropout(cls, 1.0, x[:8]), 0.0)
  np.testing.assert_array_equal(_dropout(cls, rate, x, deterministic=True), x)
  np.testing.assert_array_equal(_dropout(cls, 0.0, x), x)


@pytest.mark.parametrize('shape', [(64, 32, 128), (64, 32, 127)])
def test_half_word_dropout_mask_depends_on_the_key_and_index_only(shape):
  x = _normal(0, shape)
  key = jax.random.key(3)
  out = np.asarray(platform_ops.half_word_dropout(x, 0.1, key))
  kept = out != 0
  # 262k draws: the kept fraction is 0.9 within 5 standard errors (0.003).
  assert abs(kept.mean() - 0.9) < 0.003
  # Elements of one row are not dropped in pairs (each 32-bit word decides two),
  # whether the last axis is even or odd.
  half = shape[-1] // 2
  assert abs(np.mean(kept[..., :half] == kept[..., shape[-1] - half:])
             - (0.9 ** 2 + 0.1 ** 2)) < 0.005
  # The same mask with the rows spread over the 8 devices as on one.
  mesh = sharding.make_mesh()
  spread = jax.jit(lambda v: platform_ops.half_word_dropout(v, 0.1, key),
                   in_shardings=sharding.batch_sharding(mesh),
                   out_shardings=sharding.batch_sharding(mesh))(x)
  np.testing.assert_array_equal(np.asarray(spread), out)
  assert not np.array_equal(np.asarray(platform_ops.half_word_dropout(x, 0.1, jax.random.key(4))),
                            out)


def test_half_word_dropout_takes_nn_dropouts_place_in_the_module_tree():
  # Flax folds an unnamed submodule's name into its dropout key: the CPU
  # form is named as nn.Dropout, so the keys do not depend on the platform.
  class Two(nn.Module):
    dropout: type

    @nn.compact
    def __call__(self, x):
      a = self.dropout(0.5)(x, deterministic=False)
      b = self.dropout(0.5)(x, deterministic=False)
      return jnp.stack([a, b])

  x = jnp.ones((4, 8))
  _, tree = Two(CPU.dropout).apply({}, x, rngs={'dropout': jax.random.key(0)},
                                   capture_intermediates=True)
  _, default_tree = Two(DEFAULT.dropout).apply({}, x, rngs={'dropout': jax.random.key(0)},
                                               capture_intermediates=True)
  assert set(tree['intermediates']) == set(default_tree['intermediates']) == {
      'Dropout_0', 'Dropout_1', '__call__'}


@pytest.mark.slow
@pytest.mark.parametrize('variant', ['bert', 'modern'])
def test_model_on_tpu_ops_equals_the_model_on_cpu_ops(variant):
  # The same config compiled for a TPU (library defaults) and for a CPU
  # (platform_ops.CPU): one parameter tree, the same outputs.
  b, t, p = 4, 16, 3
  rng = np.random.default_rng(0)
  mask = (np.arange(t)[None] < np.array([[16], [11], [16], [6]])).astype(np.int32)
  batch = {'input_ids': np.where(mask > 0, rng.integers(5, 100, (b, t)), 0).astype(np.int32),
           'attention_mask': mask, 'segment_ids': np.zeros((b, t), np.int32),
           'masked_positions': np.tile(np.arange(1, p + 1, dtype=np.int32), (b, 1))}
  fields = dict(vocab_size=100, padded_vocab_size=128, num_layers=3, hidden_size=32, num_heads=4,
                intermediate_size=64, max_position_embeddings=t, variant=variant,
                local_attention=4, sentence_pair_head=True)
  cpu, tpu = (model_lib.mlm_model(model_config(platform=name, **fields),
                                  platform_ops.for_platform(name)) for name in ('cpu', 'tpu'))
  assert (cpu.ops, tpu.ops) == (CPU, DEFAULT)
  params = tpu.init(jax.random.key(0), batch, method='pretrain')
  cpu_params = cpu.init(jax.random.key(0), batch, method='pretrain')
  assert jax.tree_util.tree_structure(cpu_params) == jax.tree_util.tree_structure(params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, cpu_params, params)
  want = tpu.apply(params, batch, method='pretrain')
  got = cpu.apply(params, batch, method='pretrain')
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
  np.testing.assert_allclose(cpu.apply(params, batch, method='all_layers'),
                             tpu.apply(params, batch, method='all_layers'), rtol=1e-5, atol=1e-5)
