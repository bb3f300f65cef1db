"""Weight averaging (the EMA kept in training, `average` of checkpoints) and StableAdamW."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax.training import optimizer


def _train_section(**overrides) -> ml_collections.ConfigDict:
  from configs import base
  train = base.get_config().train
  train.update({'learning_rate': 0.1, 'warmup_steps': 0, 'num_steps': 100, 'schedule': 'wsd',
                'decay_fraction': 0.01, 'weight_decay': 0.1, 'grad_clip_norm': 0.0,
                'adam_eps': 1e-6, 'optimizer': 'stable_adamw', **overrides})
  return train


def _stable_adamw_reference(params, grads_seq, train):
  """StableAdamW written out in numpy, tensor by tensor (Wortsman et al., 2023)."""
  b1, b2, eps, lr, wd = (train.adam_b1, train.adam_b2, train.adam_eps, train.learning_rate,
                         train.weight_decay)
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, grads in enumerate(grads_seq, start=1):
    for k in p:
      g = np.array(grads[k], np.float64)
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
      rms = np.sqrt(np.mean(g * g / np.maximum(v_hat, eps * eps)))
      step_lr = lr / max(1.0, rms)
      decay = wd * p[k] if k == 'kernel' else 0.0  # Biases are not decayed.
      p[k] = p[k] - step_lr * (m_hat / (np.sqrt(v_hat) + eps) + decay)
  return p


def test_stable_adamw_matches_the_formula():
  rng = np.random.default_rng(0)
  params = {'kernel': rng.normal(size=(4, 3)).astype(np.float32),
            'bias': rng.normal(size=(3,)).astype(np.float32)}
  # A calm start, then a gradient far larger than Adam's estimate: the clip must act.
  grads_seq = [{k: (rng.normal(size=x.shape) * s).astype(np.float32) for k, x in params.items()}
               for s in (1.0, 1.0, 50.0, 1.0)]
  train = _train_section()
  tx = optimizer.make_optimizer(train)
  p, state = jax.tree_util.tree_map(jnp.asarray, params), tx.init(params)
  for grads in grads_seq:
    updates, state = tx.update(jax.tree_util.tree_map(jnp.asarray, grads), state, p)
    p = jax.tree_util.tree_map(lambda a, u: a + u, p, updates)
  expected = _stable_adamw_reference(params, grads_seq, train)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), expected[k], rtol=2e-5, atol=2e-6)
  # The clip changed something (else the test would not tell StableAdamW from AdamW).
  plain = optimizer.make_optimizer(_train_section(optimizer='adamw'))
  q, plain_state = jax.tree_util.tree_map(jnp.asarray, params), plain.init(params)
  for grads in grads_seq:
    updates, plain_state = plain.update(jax.tree_util.tree_map(jnp.asarray, grads),
                                        plain_state, q)
    q = jax.tree_util.tree_map(lambda a, u: a + u, q, updates)
  assert not np.allclose(np.asarray(q['kernel']), expected['kernel'], rtol=1e-3)


def test_bad_optimizer_and_ema_decay_are_one_line_errors():
  from configs import base
  from mlm_jax import training_config
  from mlm_jax.config_check import ConfigError
  for field, value, words in (('optimizer', 'lion', "'adamw' or 'stable_adamw'"),
                              ('ema_decay', 1.0, 'must be in [0, 1)')):
    train = base.get_config().train
    train[field] = value
    with pytest.raises(ConfigError, match=None) as error:
      training_config.check_train(train)
    assert words in str(error.value) and '\n' not in str(error.value)
