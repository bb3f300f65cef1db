"""Fine-tuning's model, state and pure steps, built as training/build.py builds pretraining's.

The loss is `sum(w * loss) / sum(w)` over the whole global batch (rows for
sequence tasks, labelled word starts for tag): cross-entropy for
classify/pair/tag, squared error for regress. The train step is
`(state, batch, rng) -> (state, metrics)` with `fold_in(rng, state.step)`
inside and the state donated; the eval step returns the logits, which the
host scores (metrics.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from mlm_jax import model as model_lib
from mlm_jax.finetuning import heads
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding
from mlm_jax.training import checkpoint
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib

Array = jax.Array
Batch = dict[str, Array]


def batch_spec(task: str, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """input_ids, segment_ids, attention_mask [B, T] int32; targets, weights [B] or [B, T] (tag)."""
  b, t = batch_size, seq_len
  target_shape = (b, t) if task == 'tag' else (b,)
  return {'input_ids': jax.ShapeDtypeStruct((b, t), jnp.int32),
          'segment_ids': jax.ShapeDtypeStruct((b, t), jnp.int32),
          'attention_mask': jax.ShapeDtypeStruct((b, t), jnp.int32),
          'targets': jax.ShapeDtypeStruct(target_shape,
                                          jnp.float32 if task == 'regress' else jnp.int32),
          'weights': jax.ShapeDtypeStruct(target_shape, jnp.float32)}


def loss_terms(task: str, logits: Array, batch: Batch) -> dict[str, Array]:
  """logits [B, K] or [B, T, K] -> sums over the batch (the caller divides by weight_sum)."""
  weights = batch['weights']
  if task == 'regress':
    error = logits[:, 0] - batch['targets']
    return {'loss_sum': jnp.sum(weights * error ** 2), 'weight_sum': jnp.sum(weights)}
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
  correct = (jnp.argmax(logits, -1) == batch['targets']).astype(jnp.float32)
  return {'loss_sum': jnp.sum(weights * ce), 'correct_sum': jnp.sum(weights * correct),
          'weight_sum': jnp.sum(weights)}


def make_train_step(task: str, schedule: optax.Schedule) -> Callable:
  """Returns train_step(state, batch, rng) -> (state, metrics); jit it with donation."""

  def train_step(state: state_lib.TrainState, batch: Batch, rng: Array):
    dropout_rng = jax.random.fold_in(rng, state.step)
    denom = jnp.maximum(jnp.sum(batch['weights']), 1.0)    # Global: the batch is sharded.

    def loss_fn(params):
      logits = state.apply_fn({'params': params}, batch, deterministic=False,
                              rngs={'dropout': dropout_rng})
      terms = loss_terms(task, logits, batch)
      return terms['loss_sum'] / denom, terms

    grads, terms = jax.grad(loss_fn, has_aux=True)(state.params)
    metrics = {**terms, 'loss': terms['loss_sum'] / denom,
               'learning_rate': schedule(state.step), 'grad_norm': optax.tree.norm(grads),
               'num_tokens': jnp.sum(batch['attention_mask'])}
    return state.apply_gradients(grads=grads), metrics

  return train_step


def make_eval_step() -> Callable:
  """Returns eval_step(state, batch) -> logits [B, K] or [B, T, K], float32."""

  def eval_step(state: state_lib.TrainState, batch: Batch) -> Array:
    return state.apply_fn({'params': state.params}, batch, deterministic=True)

  return eval_step


def fine_tuned_model(cfg: model_lib.ModelConfig, task: str, num_outputs: int,
                     classifier_dropout: float,
                     ops: platform_ops.Ops = platform_ops.DEFAULT) -> heads.FineTuned:
  """`ops`: the platform's dense, dropout and GELU (the builder's); the library's by default."""
  return heads.FineTuned(cfg, num_outputs, per_token=task == 'tag',
                         classifier_dropout=classifier_dropout, ops=ops)


@dataclasses.dataclass(frozen=True)
class Built:
  """The fine-tuned model's config, its state's layout and the jitted steps (nothing allocated)."""

  model_cfg: model_lib.ModelConfig
  abstract_state: state_lib.TrainState
  train_step: Any   # (state, batch, rng) -> (state, metrics); donates the state.
  eval_step: Any    # (state, batch) -> logits, replicated.
  dropout_rng: jax.Array
  init_state: Callable[[], state_lib.TrainState]   # Fresh head, random encoder; in its sharding.


def build(model_cfg: model_lib.ModelConfig, task: str, num_outputs: int,
          classifier_dropout: float, train: ml_collections.ConfigDict, seq_len: int,
          seed: int, mesh) -> Built:
  """The model, optimizer, state shardings and jitted steps on `mesh` (`train` resolved).

  The model gets the operations of its platform (model_cfg.platform, the
  mesh's); the steps are traced on the mesh (sharding.traced_on), where the
  activations keep the batch's split. The programs depend on the arguments
  but the seed, and are made once per process for them: a sweep fine-tunes
  many runs of one shape and plan with several seeds (evaluation/sweep.py).
  """
  programs = {k: v for k, v in train.to_dict().items() if k not in _NOT_IN_PROGRAMS}
  key = (model_cfg, task, num_outputs, classifier_dropout,
         json.dumps(programs, sort_keys=True, default=repr), seq_len, mesh)
  if key not in _PROGRAMS:
    if len(_PROGRAMS) >= _PROGRAMS_KEPT:
      _PROGRAMS.pop(next(iter(_PROGRAMS)))   # The oldest: its executables go with it.
    _PROGRAMS[key] = _programs(model_cfg, task, num_outputs, classifier_dropout, train, seq_len,
                               mesh)
  abstract, train_step, eval_step, init = _PROGRAMS[key]
  init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
  return Built(model_cfg, abstract, train_step, eval_step, dropout_rng,
               lambda: init(init_rng))


# The programs of this process by build's arguments but the seed; the oldest is dropped past
# _PROGRAMS_KEPT.
_PROGRAMS: dict[tuple, tuple] = {}
_PROGRAMS_KEPT = 8
# config.train's fields that the loop reads and the optimizer and steps do not.
_NOT_IN_PROGRAMS = ('best_metric', 'eval_every', 'checkpoint_every', 'keep_checkpoints',
                    'log_every', 'tensorboard')


def _programs(model_cfg: model_lib.ModelConfig, task: str, num_outputs: int,
              classifier_dropout: float, train: ml_collections.ConfigDict, seq_len: int,
              mesh) -> tuple[state_lib.TrainState, Any, Any, Callable]:
  """(abstract state, train step, eval step, init(rng) -> state in its sharding), all jitted."""
  model = fine_tuned_model(model_cfg, task, num_outputs, classifier_dropout,
                           platform_ops.for_platform(model_cfg.platform))
  tx = optimizer.make_optimizer(train)   # For the platform of JAX's backend, where it runs.
  example = {k: jnp.ones(x.shape, x.dtype) for k, x in batch_spec(task, 1, seq_len).items()}
  # The layout does not depend on the rng's value; the init takes it as an argument.
  abstract, state_sh, _ = state_lib.sharded_state_init(model, tx, jax.random.key(0), example,
                                                       mesh)
  init = jax.jit(lambda rng: state_lib.create_state(model, tx, rng, example),
                 out_shardings=state_sh)
  repl, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
  train_step = jax.jit(
      sharding.traced_on(make_train_step(task, optimizer.learning_rate_schedule(train)), mesh),
      in_shardings=(state_sh, batch_sh, repl), out_shardings=(state_sh, repl), donate_argnums=0)
  eval_step = jax.jit(sharding.traced_on(make_eval_step(), mesh),
                      in_shardings=(state_sh, batch_sh), out_shardings=repl)
  return abstract, train_step, eval_step, init


def with_pretrained(state: state_lib.TrainState, pretrained: dict[str, Any],
                    where: str) -> state_lib.TrainState:
  """`state` with the pretrained encoder (host arrays) in place of its random one.

  The head starts where Hugging Face's classifiers start from the same
  checkpoint: a BERT pooler from the pretrained sentence-pair pooler when
  there is one (BertForPreTraining's); a ModernBERT head's dense layer and
  norm from the MLM head's (ModernBertForSequenceClassification's head has
  the same tensors). The classifier is always fresh. Each array lands on the
  sharding of the one it replaces.
  """
  params = flax.core.unfreeze(state.params)
  theirs, ours = pretrained['encoder'], params['encoder']
  if jax.tree_util.tree_structure(theirs) != jax.tree_util.tree_structure(ours):
    raise checkpoint.CheckpointMismatchError(
        f'the encoder of {where} does not have the layout this model builds from its config.')
  params['encoder'] = _placed_like(ours, theirs)
  head = params['head']
  pooler = pretrained.get('sentence_pair', {}).get('pooler')
  if pooler is not None and 'pooler' in head:
    head['pooler'] = _placed_like(head['pooler'], pooler)
  mlm_head = pretrained.get('mlm_head', {})
  for name in ('transform', 'layer_norm'):
    if name in head and name in mlm_head:
      head[name] = _placed_like(head[name], mlm_head[name])
  return state.replace(params=params)


def _placed_like(old: Any, new: Any) -> Any:
  def place(a, b):
    if a.shape != np.shape(b):
      raise checkpoint.CheckpointMismatchError(
          f'pretrained tensor of shape {np.shape(b)} where the model has {a.shape}.')
    return jax.device_put(np.asarray(b, a.dtype), a.sharding)
  return jax.tree_util.tree_map(place, old, new)
