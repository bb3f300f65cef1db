"""Optimizer, loss and the pure train/eval steps.

The loss is `sum(w * CE) / sum(w)` where both sums run over the whole global
batch: under `jax.jit` with the batch sharded over the mesh, `jnp.sum` is
already global, so the denominator is the global number of masked tokens |M|,
never a mean of per-device means.
"""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax.training import train_state

Array = jax.Array
Batch = dict[str, Array]


class TrainState(train_state.TrainState):
  """step, params, opt_state (+ static apply_fn and tx)."""


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """BERT's schedule: linear warm-up to the peak, then linear decay to 0."""
  warmup = optax.linear_schedule(0.0, train.learning_rate, max(train.warmup_steps, 1))
  decay = optax.linear_schedule(train.learning_rate, 0.0,
                                max(train.num_steps - train.warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [train.warmup_steps])


def weight_decay_mask(params: Any) -> Any:
  """True for matrices (dense kernels, embeddings); False for biases and LayerNorm."""
  def decays(path, _):
    return path[-1].key in ('kernel', 'embedding')
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: ml_collections.ConfigDict) -> optax.GradientTransformation:
  # The chain keeps one shape whatever the settings, so a run can be resumed
  # with clipping switched off (an infinite threshold never clips).
  clip = train.grad_clip_norm if train.grad_clip_norm > 0 else float('inf')
  return optax.chain(
      optax.clip_by_global_norm(clip),
      optax.adamw(learning_rate_schedule(train), b1=train.adam_b1, b2=train.adam_b2,
                  eps=train.adam_eps, weight_decay=train.weight_decay, mask=weight_decay_mask))


def mlm_loss_terms(logits: Array, masked_ids: Array, weights: Array) -> dict[str, Array]:
  """logits [B, P, V], masked_ids [B, P], weights [B, P] -> sums (caller divides)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), masked_ids)
  correct = (jnp.argmax(logits, axis=-1) == masked_ids).astype(jnp.float32)
  return {
      'loss_sum': jnp.sum(ce * weights),
      'correct_sum': jnp.sum(correct * weights),
      'weight_sum': jnp.sum(weights),
  }


def make_train_step(schedule: optax.Schedule, grad_accum_steps: int = 1) -> Callable:
  """Returns train_step(state, batch, rng) -> (state, metrics); jit it with donation.

  With grad_accum_steps = k > 1 the global batch [B, ...] is processed as k
  micro-batches of B/k rows inside the step, and the summed gradients are
  divided once by the masked-token count of the whole batch, so the update is
  the one a single batch of B rows would give (dropout aside), not a mean of
  micro-batch means. Micro-batch i takes rows i, i+k, i+2k, ...: every device
  keeps contributing its own rows, with no data movement.
  """

  def train_step(state: TrainState, batch: Batch, rng: Array):
    dropout_rng = jax.random.fold_in(rng, state.step)

    def sums_fn(params, micro: Batch, key: Array):
      logits = state.apply_fn({'params': params}, micro, deterministic=False,
                              rngs={'dropout': key})
      terms = mlm_loss_terms(logits, micro['masked_ids'], micro['masked_weights'])
      return terms['loss_sum'], terms

    grad_fn = jax.grad(sums_fn, has_aux=True)
    if grad_accum_steps == 1:
      grad_sums, terms = grad_fn(state.params, batch, dropout_rng)
    else:
      k = grad_accum_steps
      micro_batches = jax.tree_util.tree_map(                      # [k, B/k, ...]
          lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)

      def accumulate(carry, xs):
        micro, i = xs
        grads, terms = grad_fn(state.params, micro, jax.random.fold_in(dropout_rng, i))
        return jax.tree_util.tree_map(jnp.add, carry, (grads, terms)), None

      zeros = (jax.tree_util.tree_map(jnp.zeros_like, state.params),
               dict.fromkeys(('loss_sum', 'correct_sum', 'weight_sum'), jnp.zeros(())))
      (grad_sums, terms), _ = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(k)))
    denom = jnp.maximum(terms['weight_sum'], 1.0)   # Global |M| of the whole batch.
    grads = jax.tree_util.tree_map(lambda g: g / denom, grad_sums)
    new_state = state.apply_gradients(grads=grads)
    metrics = {
        'loss': terms['loss_sum'] / denom,
        'mlm_accuracy': terms['correct_sum'] / denom,
        'learning_rate': schedule(state.step),
        'grad_norm': optax.tree.norm(grads),
        'num_masked': terms['weight_sum'],
        'num_tokens': jnp.sum(batch['attention_mask']),
    }
    return new_state, metrics

  return train_step


def eval_step(state: TrainState, batch: Batch) -> dict[str, Array]:
  """Deterministic forward pass -> loss/accuracy sums over the global batch."""
  logits = state.apply_fn({'params': state.params}, batch, deterministic=True)
  return mlm_loss_terms(logits, batch['masked_ids'], batch['masked_weights'])


def create_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                 rng: Array, example_batch: Batch) -> TrainState:
  params = model.init(rng, example_batch, deterministic=True)['params']
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)
