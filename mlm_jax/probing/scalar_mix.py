"""Probing classifiers on frozen features: one per layer, and one on a learned scalar mix.

Tenney et al. (2019, "BERT Rediscovers the Classical NLP Pipeline") read a
task out of all layers at once with a scalar mix, h = γ Σ_ℓ s_ℓ x_ℓ with
s = softmax(w), learned together with the classifier; the weights s show
where the task's information is, and Σ_ℓ ℓ s_ℓ is its expected layer.

Here every layer's features are first standardised (mean 0, variance 1 per
dimension, from the training examples), so that a layer's weight is not a
matter of its scale. The classifier is an MLP with one hidden ReLU layer
(as SentEval's probing tasks use), or linear with hidden=0. Training is full
batch Adam in one compiled loop; the parameters kept are those of the
(last) step with the best accuracy on a development split, and the figure reported is
the accuracy on a test split neither saw. The L + 1 single-layer probes
train together (vmapped).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
  hidden: int = 256           # 0: a linear classifier.
  learning_rate: float = 3e-3
  weight_decay: float = 1e-4
  steps: int = 400
  # Fractions of the examples for training and development; the rest is test.
  train_fraction: float = 0.7
  dev_fraction: float = 0.1


def split(num_examples: int, cfg: ProbeConfig, seed: int) -> tuple[np.ndarray, ...]:
  """(train, dev, test) indices: a permutation of the examples drawn with `seed`."""
  order = np.random.default_rng(seed).permutation(num_examples)
  a = int(num_examples * cfg.train_fraction)
  b = a + int(num_examples * cfg.dev_fraction)
  return order[:a], order[a:b], order[b:]


def _init(rng: jax.Array, dim: int, num_classes: int, cfg: ProbeConfig,
          num_layers: int = 0) -> Params:
  k1, k2 = jax.random.split(rng)
  width = cfg.hidden or num_classes
  p = {'w1': jax.random.normal(k1, (dim, width)) * np.sqrt(1.0 / dim),
       'b1': jnp.zeros(width)}
  if cfg.hidden:
    p |= {'w2': jax.random.normal(k2, (cfg.hidden, num_classes)) * np.sqrt(1.0 / cfg.hidden),
          'b2': jnp.zeros(num_classes)}
  if num_layers:
    p |= {'mix': jnp.zeros(num_layers), 'gamma': jnp.ones(())}
  return p


def mix_weights(params: Params) -> jax.Array:
  """s = softmax(w): the scalar mix's weight of each layer (they sum to 1)."""
  return jax.nn.softmax(params['mix'])


def _logits(params: Params, x: jax.Array) -> jax.Array:
  """x [N, d] (one layer) or [L + 1, N, d] (a mix: params hold 'mix' and 'gamma')."""
  if 'mix' in params:
    x = params['gamma'] * jnp.einsum('l,lnd->nd', mix_weights(params), x)
  h = x @ params['w1'] + params['b1']
  if 'w2' in params:
    h = jax.nn.relu(h) @ params['w2'] + params['b2']
  return h


def _accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(_logits(params, x), -1) == y)


def _fit(params: Params, data: tuple[jax.Array, ...], cfg: ProbeConfig) -> Params:
  """Full-batch AdamW; returns the parameters of the step with the best dev accuracy."""
  x_train, y_train, x_dev, y_dev = data
  tx = optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)

  def loss(p):
    return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x_train), y_train).mean()

  def step(carry, _):
    p, opt, best, best_acc = carry
    updates, opt = tx.update(jax.grad(loss)(p), opt, p)
    p = optax.apply_updates(p, updates)
    acc = _accuracy(p, x_dev, y_dev)
    better = acc >= best_acc  # At a tie, the later (longer trained) parameters.
    best = jax.tree_util.tree_map(lambda new, old: jnp.where(better, new, old), p, best)
    return (p, opt, best, jnp.maximum(acc, best_acc)), None

  init = (params, tx.init(params), params, _accuracy(params, x_dev, y_dev))
  (_, _, best, _), _ = jax.lax.scan(step, init, None, length=cfg.steps)
  return best


def standardise(features: np.ndarray, train: np.ndarray) -> np.ndarray:
  """[L + 1, N, d] -> per layer and dimension, mean 0 and variance 1 over the train examples."""
  mean = features[:, train].mean(axis=1, keepdims=True)
  std = features[:, train].std(axis=1, keepdims=True) + 1e-6
  return ((features - mean) / std).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _probe(x: jax.Array, y: jax.Array, indices: tuple[jax.Array, ...], rng: jax.Array,
           num_classes: int, cfg: ProbeConfig) -> tuple[jax.Array, ...]:
  """(test accuracy per layer, of the mix, mix weights, γ), compiled once per shape."""
  num_layers, _, dim = x.shape
  train, dev, test = indices
  rng_layers, rng_mix = jax.random.split(rng)
  # One classifier per layer, trained side by side.
  layer_init = jax.vmap(lambda r: _init(r, dim, num_classes, cfg))(
      jax.random.split(rng_layers, num_layers))
  per_layer = jax.vmap(lambda p, xl: _fit(p, (xl[train], y[train], xl[dev], y[dev]), cfg))(
      layer_init, x)
  layer_acc = jax.vmap(lambda p, xl: _accuracy(p, xl[test], y[test]))(per_layer, x)
  mixed = _fit(_init(rng_mix, dim, num_classes, cfg, num_layers),
               (x[:, train], y[train], x[:, dev], y[dev]), cfg)
  return layer_acc, _accuracy(mixed, x[:, test], y[test]), mix_weights(mixed), mixed['gamma']


def probe(features: np.ndarray, labels: np.ndarray, num_classes: int, seed: int,
          cfg: ProbeConfig = ProbeConfig()) -> dict[str, Any]:
  """Single-layer probes and the scalar-mix probe on features [L + 1, N, d].

  Returns test accuracy per layer and of the mix, the mix weights, γ and the
  expected layer Σ ℓ s_ℓ, and the sizes of the splits.
  """
  num_layers, n, _ = features.shape
  train, dev, test = split(n, cfg, seed)
  x = jnp.asarray(standardise(features, train))
  y = jnp.asarray(labels, jnp.int32)
  indices = tuple(jnp.asarray(i) for i in (train, dev, test))
  layer_acc, mix_acc, weights, gamma = jax.device_get(
      _probe(x, y, indices, jax.random.PRNGKey(seed), num_classes, cfg))
  weights = [float(w) for w in weights]
  return {
      'layer_accuracy': [float(a) for a in layer_acc],
      'mix_accuracy': float(mix_acc),
      'mix_weights': weights,
      'gamma': float(gamma),
      'expected_layer': float(np.dot(np.arange(num_layers), weights)),
      'chance': 1.0 / num_classes,
      'examples': {'train': len(train), 'dev': len(dev), 'test': len(test)},
  }
