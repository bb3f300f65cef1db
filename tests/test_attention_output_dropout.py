"""model.attention_output_dropout_rate (FlexBERT's attn_out_dropout_prob): nothing at 0, a
training-time change only when above 0, in both encoders, and no change of attention kernel."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.recipes import common
from mlm_jax import model as model_lib
from mlm_jax.config import checks
from mlm_jax.model import attention
from tests.conftest import model_config

V, T, P = 120, 16, 4


def _cfg(variant: str, rate: float, **fields):
  """No other dropout, so that any change between training and evaluation is this one's."""
  shape = dict(vocab_size=V, padded_vocab_size=128, num_layers=3, hidden_size=32, num_heads=4,
               intermediate_size=48, max_position_embeddings=T, variant=variant,
               local_attention=8, dropout_rate=0.0, attention_dropout_rate=0.0,
               drop_token_rate=0.0, attention_output_dropout_rate=rate)
  return model_config(**(shape | fields))


def _batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(5, V, (2, T)).astype(np.int32)
  positions = np.stack([np.sort(rng.choice(np.arange(1, T), P, replace=False)) for _ in ids])
  return {'input_ids': ids, 'attention_mask': np.ones_like(ids),
          'segment_ids': np.zeros_like(ids), 'masked_positions': positions.astype(np.int32),
          'masked_ids': rng.integers(5, V, positions.shape).astype(np.int32),
          'masked_weights': np.ones(positions.shape, np.float32)}


def _logits(cfg, params, batch, train: bool, seed: int = 1):
  rngs = {'dropout': jax.random.key(seed)} if train else {}
  return np.asarray(model_lib.mlm_model(cfg).apply({'params': params}, batch,
                                                  deterministic=not train, rngs=rngs))


@pytest.mark.parametrize('variant', ['bert', 'modern'])
def test_the_rate_drops_only_the_attention_output_and_only_in_training(variant):
  batch = _batch()
  off, on = _cfg(variant, 0.0), _cfg(variant, 0.5)
  params = nn.unbox(model_lib.mlm_model(off).init(jax.random.key(0), batch)['params'])
  # A rate adds no parameters: the same checkpoint serves both.
  assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(nn.unbox(
      model_lib.mlm_model(on).init(jax.random.key(0), batch)['params']))
  evaluated = _logits(off, params, batch, train=False)
  # At 0 a training step computes what evaluation does, bit for bit.
  np.testing.assert_array_equal(_logits(off, params, batch, train=True), evaluated)
  # Above 0 evaluation is unchanged; training is not, and differs from draw to draw.
  np.testing.assert_array_equal(_logits(on, params, batch, train=False), evaluated)
  trained = _logits(on, params, batch, train=True)
  assert np.abs(trained - evaluated).max() > 1e-3
  assert np.abs(trained - _logits(on, params, batch, train=True, seed=2)).max() > 1e-3


def test_the_fused_kernels_still_serve_a_model_with_the_rate():
  """The dropout acts after the kernel's output: on GPUs in bfloat16 the plan of kernels is the
  one without it (documents apart: 'flash'), unlike attention_dropout_rate's."""
  kernels = lambda cfg: [c.kernel for c in attention.plan(cfg, 1024, 320)]
  gpu = dict(platform='gpu', dtype=jnp.bfloat16, document_mask=True, num_layers=4)
  with_rate = kernels(_cfg('modern', 0.1, **gpu))
  assert with_rate == kernels(_cfg('modern', 0.0, **gpu))
  assert 'dense' not in with_rate and 'blocked' not in with_rate
  assert kernels(_cfg('modern', 0.0, attention_dropout_rate=0.1, **gpu)) != with_rate


def test_flexbert_sets_the_yamls_rate_and_the_check_bounds_it():
  config = common.flexbert(seed=0, seq_len=1024, select_rate=0.3, rope_theta=1e4,
                           learning_rate=8e-4, betas=(0.9, 0.98), eps=1e-6,
                           decoupled_weight_decay=1e-5, batch_size=64, micro_batches=2,
                           batch_warmup_start=0, batch_warmup_tokens=0, eval_batch_size=8,
                           eval_every=10, log_every=1, checkpoint_every=10)
  assert config.model.attention_output_dropout_rate == 0.1  # attn_out_dropout_prob: 0.1
  checks.validate(config, 1, check_paths=False)
  config.model.attention_output_dropout_rate = 1.0
  with pytest.raises(Exception, match='attention_output_dropout_rate=1.0 must be in'):
    checks.validate(config, 1, check_paths=False)
