"""The pure train and eval steps (config.train is checked in mlm_jax/train_checks.py).

The train step is `(state, batch, rng) -> (state, metrics)` with
`fold_in(rng, state.step)` inside; jit it with the state donated. Its loss is
`sum(w * CE) / |M|`, |M| the number of masked tokens of the whole global
batch (objective.py), so micro-batches and concurrent chains add up to the
gradient of one batch. The optimizer comes with the state (optimizer.py,
state.py); the platform the step is compiled for picks the form of a few
operations (runtime/platform_ops.py), not what they compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mlm_jax.data import masking
from mlm_jax.runtime import platform_ops
from mlm_jax.training import objective
from mlm_jax.training.state import TrainState

Array = jax.Array
Batch = dict[str, Array]


def split_rows(batch: Batch, k: int) -> Batch:
  """[B, ...] leaves -> [k, B/k, ...]; part i holds rows i, i+k, i+2k, ...

  Each device's rows stay on that device in every part (no data movement),
  as long as each device holds a multiple of k rows.
  """
  return jax.tree_util.tree_map(
      lambda x: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1), batch)


def make_train_step(schedule: optax.Schedule, grad_accum_steps: int = 1,
                    sentence_pair_weight: float = 1.0, chains: int = 1,
                    baseline_token: int = objective.NO_BASELINE,
                    platform: str | None = None, ema_decay: float = 0.0,
                    growing_batch: bool = False) -> Callable:
  """Returns train_step(state, batch, rng) -> (state, metrics); jit it with donation.

  The objective is sum(w * CE) / |M| with |M| = sum(masked_weights) over the
  whole global batch (plus, with a sentence-pair head, sentence_pair_weight x
  its mean cross-entropy over the rows that hold a pair). Both denominators are known from
  the batch before the forward pass, so with grad_accum_steps = k > 1 the
  global batch is processed as k micro-batches of B/k rows whose gradients
  simply add up to the gradient of one batch of B rows (dropout aside) —
  not a mean of micro-batch means. Micro-batch i takes rows i, i+k, i+2k, ...:
  every device keeps contributing its own rows, with no data movement.

  `chains` > 1 splits each (micro-)batch the same way into that many parts
  whose forward and backward passes are written out side by side in one
  program and summed: the same update, but independent chains of operations
  that XLA's CPU runtime executes concurrently, one per core (its elementwise
  kernels are single-threaded; platform_ops.concurrent_chains picks the
  number). Chain j draws its dropout with fold_in(key, j); chains = 1 leaves
  the key as it is.

  Besides loss, accuracy, learning rate and gradient norm, the metrics hold
  the sums of objective.mlm_loss_terms per kind of slot
  (`objective.slot_metrics` turns those of a log interval into ratios);
  `baseline_token` is the most frequent token
  (PreparedData.most_frequent_token(); objective.NO_BASELINE where none is
  known). `platform` is the one the step is compiled for (default: JAX's
  backend here); it picks the form of the accuracy's argmax (platform_ops).

  With `ema_decay` > 0 (the state then keeps ema_params), the average moves
  toward the updated parameters: ema = decay * ema + (1 - decay) * params,
  in the parameters' dtype. With 0 the step is the same program as without it.

  `growing_batch` (a batch warm-up, phases.Plan): a step may fill only its
  first j of the k micro-batches with real rows (the rest are padding rows,
  all [PAD]); it then runs the forward and backward passes of those j only,
  in a loop whose trip count is read from the batch, so a batch of any
  number of micro-batches runs in the one compiled program. The loss is
  still divided by the |M| of the whole (real) batch.
  """
  argmax = platform_ops.for_platform(platform).argmax

  def train_step(state: TrainState, batch: Batch, rng: Array):
    dropout_rng = jax.random.fold_in(rng, state.step)
    denom = jnp.maximum(jnp.sum(batch['masked_weights']), 1.0)   # Global |M| of the batch.
    num_pairs = jnp.maximum(jnp.sum(batch.get('sentence_pair_weights', jnp.ones(1))), 1.0)

    def loss_fn(params, micro: Batch, key: Array):
      outputs = state.apply_fn({'params': params}, micro, deterministic=False,
                               rngs={'dropout': key}, method='pretrain')
      terms = objective.loss_terms(outputs, micro, baseline_token, argmax)
      loss = terms['loss_sum'] / denom
      if 'pair_loss_sum' in terms:
        loss += sentence_pair_weight * terms['pair_loss_sum'] / num_pairs
      return loss, terms

    single = jax.grad(loss_fn, has_aux=True)

    def grad_fn(params, micro: Batch, key: Array):
      if chains == 1:
        return single(params, micro, key)
      parts = split_rows(micro, chains)
      results = [single(params, jax.tree_util.tree_map(lambda x: x[j], parts),
                        jax.random.fold_in(key, j)) for j in range(chains)]
      return jax.tree_util.tree_map(lambda *xs: sum(xs[1:], xs[0]), *results)

    if grad_accum_steps == 1:
      grads, terms = grad_fn(state.params, batch, dropout_rng)
    else:
      grads, terms = _accumulated(grad_fn, state.params, batch, grad_accum_steps, dropout_rng,
                                  growing_batch)
    new_state = state.apply_gradients(grads=grads)
    if ema_decay > 0:
      new_state = new_state.replace(ema_params=jax.tree_util.tree_map(
          lambda e, p: ema_decay * e + (1 - ema_decay) * p, state.ema_params, new_state.params))
    return new_state, _metrics(terms, grads, batch, denom, num_pairs, schedule(state.step))

  return train_step


def _accumulated(grad_fn: Callable, params: Any, batch: Batch, k: int, key: Array,
                 growing_batch: bool) -> tuple[Any, dict[str, Array]]:
  """(grads, terms) of `batch` as k micro-batches of B/k rows (micro-batch i: rows i, i+k, ...,
  its dropout key fold_in(key, i)), summed: a scan over all k, or with `growing_batch` a loop
  over the first j that hold a real row (the real ones come first: phases.Plan.positions)."""
  micro_batches = split_rows(batch, k)                         # [k, B/k, ...]

  def micro_grads(micro: Batch, i):
    return grad_fn(params, micro, jax.random.fold_in(key, i))

  zero_terms = jax.tree_util.tree_map(
      jnp.zeros_like, jax.eval_shape(lambda: grad_fn(params, jax.tree_util.tree_map(
          lambda x: x[0], micro_batches), key)[1]))
  zeros = (jax.tree_util.tree_map(jnp.zeros_like, params), zero_terms)
  if growing_batch:
    used = jnp.sum(jnp.any(micro_batches['attention_mask'] > 0, axis=(1, 2)).astype(jnp.int32))

    def add_micro(i, carry):
      micro = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False),
                                     micro_batches)
      return jax.tree_util.tree_map(jnp.add, carry, micro_grads(micro, i))

    return jax.lax.fori_loop(0, used, add_micro, zeros)

  def accumulate(carry, xs):
    return jax.tree_util.tree_map(jnp.add, carry, micro_grads(*xs)), None

  (grads, terms), _ = jax.lax.scan(accumulate, zeros, (micro_batches, jnp.arange(k)))
  return grads, terms


def _metrics(terms: dict[str, Array], grads: Any, batch: Batch, denom: Array, num_pairs: Array,
             learning_rate: Array) -> dict[str, Array]:
  """A train step's metrics: loss and accuracy over the global |M|, the learning rate, the
  gradient norm, the slot sums of objective.mlm_loss_terms; the pair objective's if any."""
  metrics = {
      'loss': terms['loss_sum'] / denom,
      'mlm_accuracy': terms['correct_sum'] / denom,
      'learning_rate': learning_rate,
      'grad_norm': optax.tree.norm(grads),
      'num_masked': terms['weight_sum'],
      'num_tokens': jnp.sum(batch['attention_mask']),
      **{k: v for k, v in terms.items() if k.startswith(masking.SLOT_KINDS)},
      'baseline_sum': terms['baseline_sum'],
  }
  if 'pair_loss_sum' in terms:
    metrics['sentence_pair_loss'] = terms['pair_loss_sum'] / num_pairs
    metrics['sentence_pair_accuracy'] = terms['pair_correct_sum'] / num_pairs
  return metrics


def make_eval_step(baseline_token: int = objective.NO_BASELINE,
                   platform: str | None = None) -> Callable:
  """Returns eval_step(state, batch) -> sums of objective.loss_terms over the global batch.

  `platform` as in make_train_step.
  """
  argmax = platform_ops.for_platform(platform).argmax

  def eval_step(state: TrainState, batch: Batch) -> dict[str, Array]:
    outputs = state.apply_fn({'params': state.params}, batch, deterministic=True,
                             method='pretrain')
    return objective.loss_terms(outputs, batch, baseline_token, argmax)

  return eval_step
