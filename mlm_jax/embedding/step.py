"""The embedding model's state and pure train step on the mesh, built as fine-tuning builds its.

A batch is B pairs: input_ids and attention_mask [B, 2 + K, T] (each pair's
query, positive and K hard negatives), document_mask [B, 1 + K]. The train
step is `(state, batch, rng) -> (state, metrics)` with `fold_in(rng,
state.step)` inside and the state donated; the loss is loss.info_nce's sum
over the global batch divided by its denominator.

Two forms of the same step, which must give the same loss and gradient:

  plain      encode the whole batch, the loss, its gradient (activations of
             all B(2 + K) texts live at once)
  GradCache  (train.mini_batch_size > 0; Gao et al., 2021, "Scaling Deep
             Contrastive Learning Batch Size under Memory Limited Setup")
             encode the batch in C chunks without keeping activations; the
             loss and its gradient with respect to the vectors [B, 2 + K, d];
             then each chunk again, pulling its vectors' gradient back through
             the encoder (a VJP) and summing the parameter gradients. Memory:
             one chunk's activations, at the cost of a second forward pass.
             Chunk c holds the pairs c, c + C, c + 2C, ...: with the batch split
             in contiguous blocks over the devices, every device encodes its
             own pairs in every chunk, with no data moved. Each chunk draws its
             dropout from (step, c) in both passes, so the recomputation is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from mlm_jax import model as model_lib
from mlm_jax.embedding import config as config_lib
from mlm_jax.embedding import loss as loss_lib
from mlm_jax.embedding import model as embed_model
from mlm_jax.model.layers import BATCH
from mlm_jax.model.layers import batch_split
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding
from mlm_jax.training import checkpoint
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib

Array = jax.Array
Batch = dict[str, Array]


def batch_spec(batch_size: int, num_negatives: int,
               seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
  """input_ids, attention_mask [B, 2 + K, T] int32; document_mask [B, 1 + K] float32."""
  b, g, t = batch_size, 2 + num_negatives, seq_len
  return {'input_ids': jax.ShapeDtypeStruct((b, g, t), jnp.int32),
          'attention_mask': jax.ShapeDtypeStruct((b, g, t), jnp.int32),
          'document_mask': jax.ShapeDtypeStruct((b, g - 1), jnp.float32)}


def _vectors(apply_fn: Callable, params: Any, texts: Batch, rng: Array) -> Array:
  """texts' input_ids, attention_mask [b, G, T] -> vectors [b, G, d], in training mode."""
  b, g, t = texts['input_ids'].shape
  # [b * G, T]: each pair's texts stay on its device (the batch is split on b).
  flat = {k: batch_split(texts[k].reshape(b * g, t)) for k in ('input_ids', 'attention_mask')}
  flat['segment_ids'] = jnp.zeros_like(flat['input_ids'])
  out = apply_fn({'params': params}, flat, deterministic=False, rngs={'dropout': rng})
  return out.reshape(b, g, -1)


def _chunked(x: Array, chunks: int) -> Array:
  """[B, ...] -> [C, B / C, ...]: chunk c holds rows c, c + C, ... (each device's own)."""
  y = x.reshape(x.shape[0] // chunks, chunks, *x.shape[1:]).swapaxes(0, 1)
  return flax.linen.with_logical_constraint(y, (None, BATCH) + (None,) * (y.ndim - 2),
                                            rules=sharding.LOGICAL_RULES)


def _unchunked(y: Array) -> Array:
  """_chunked's inverse: [C, B / C, ...] -> [B, ...] in the batch's order."""
  x = y.swapaxes(0, 1).reshape(y.shape[0] * y.shape[1], *y.shape[2:])
  return batch_split(x)


def make_train_step(loss: ml_collections.ConfigDict, schedule: optax.Schedule,
                    chunks: int = 1) -> Callable:
  """Returns train_step(state, batch, rng) -> (state, metrics); jit it with donation.

  `chunks` > 1: the GradCache form, the batch encoded in that many chunks.
  """
  texts_of = lambda batch: {k: batch[k] for k in ('input_ids', 'attention_mask')}

  def objective(vectors: Array, params: Any, document_mask: Array):
    scale = loss_lib.logit_scale(params, loss.temperature, config_lib.MAX_LOGIT_SCALE)
    terms = loss_lib.info_nce(vectors[:, 0], vectors[:, 1:], document_mask, scale,
                              loss.symmetric)
    return terms['loss_sum'] / terms['weight_sum'], {**terms, 'logit_scale': scale}

  def plain_grads(state, batch, rng):
    def loss_fn(params):
      return objective(_vectors(state.apply_fn, params, texts_of(batch), rng), params,
                       batch['document_mask'])
    return jax.grad(loss_fn, has_aux=True)(state.params)

  def cached_grads(state, batch, rng):
    pieces = jax.tree_util.tree_map(lambda x: _chunked(x, chunks), texts_of(batch))
    index = jnp.arange(chunks)

    def encode(params, piece, c):
      return _vectors(state.apply_fn, params, piece, jax.random.fold_in(rng, c))

    # Pass 1: every chunk's vectors, no activations kept.
    vectors = _unchunked(jax.lax.map(lambda xs: encode(state.params, *xs), (pieces, index)))
    (vector_grads, direct), terms = jax.grad(objective, argnums=(0, 1), has_aux=True)(
        vectors, state.params, batch['document_mask'])

    # Pass 2: each chunk again, its vectors' gradient pulled back to the parameters.
    def pull_back(total, xs):
      piece, g, c = xs
      _, vjp = jax.vjp(lambda p: encode(p, piece, c), state.params)
      return jax.tree_util.tree_map(jnp.add, total, vjp(g)[0]), None

    # `direct` holds what reaches the parameters not through the vectors (the temperature).
    grads, _ = jax.lax.scan(pull_back, direct, (pieces, _chunked(vector_grads, chunks), index))
    return grads, terms

  grads_of = cached_grads if chunks > 1 else plain_grads

  def train_step(state: state_lib.TrainState, batch: Batch, rng: Array):
    grads, terms = grads_of(state, batch, jax.random.fold_in(rng, state.step))
    metrics = {**terms, 'loss': terms['loss_sum'] / terms['weight_sum'],
               'learning_rate': schedule(state.step), 'grad_norm': optax.tree.norm(grads),
               'num_tokens': jnp.sum(batch['attention_mask'])}
    return state.apply_gradients(grads=grads), metrics

  return train_step


@dataclasses.dataclass(frozen=True)
class Built:
  """The model's config, its state's layout and the jitted step (nothing allocated)."""

  model_cfg: model_lib.ModelConfig
  abstract_state: state_lib.TrainState
  train_step: Any   # (state, batch, rng) -> (state, metrics); donates the state.
  dropout_rng: jax.Array
  init_state: Callable[[], state_lib.TrainState]   # Random encoder; in its sharding.


def build(model_cfg: model_lib.ModelConfig, pooling: str, loss: ml_collections.ConfigDict,
          train: ml_collections.ConfigDict, seq_len: int, seed: int, mesh) -> Built:
  """The model, optimizer, state shardings and jitted step on `mesh` (`train` resolved).

  train.mini_batch_size > 0 builds the GradCache form (batch_size / mini_batch_size chunks).
  """
  log_scale = float(np.log(1.0 / loss.temperature)) if loss.learn_temperature else None
  model = embed_model.Embedder(model_cfg, pooling, log_scale,
                               platform_ops.for_platform(model_cfg.platform))
  tx = optimizer.make_optimizer(train)
  init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
  example = {'input_ids': jnp.ones((1, seq_len), jnp.int32),
             'segment_ids': jnp.zeros((1, seq_len), jnp.int32),
             'attention_mask': jnp.ones((1, seq_len), jnp.int32)}
  abstract, state_sh, init = state_lib.sharded_state_init(model, tx, init_rng, example, mesh)
  repl, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
  chunks = train.batch_size // train.mini_batch_size if train.mini_batch_size else 1
  step = make_train_step(loss, optimizer.learning_rate_schedule(train), chunks)
  train_step = jax.jit(sharding.traced_on(step, mesh), in_shardings=(state_sh, batch_sh, repl),
                       out_shardings=(state_sh, repl), donate_argnums=0)
  return Built(model_cfg, abstract, train_step, dropout_rng, init)


def with_encoder(state: state_lib.TrainState, encoder: dict[str, Any],
                 where: str) -> state_lib.TrainState:
  """`state` with a pretrained encoder (host arrays) in place of its random one, each array on
  the sharding of the one it replaces."""
  params = flax.core.unfreeze(state.params)
  ours = params['encoder']
  if jax.tree_util.tree_structure(encoder) != jax.tree_util.tree_structure(ours):
    raise checkpoint.CheckpointMismatchError(
        f'the encoder of {where} does not have the layout this model builds from its config.')

  def place(a, b):
    if a.shape != np.shape(b):
      raise checkpoint.CheckpointMismatchError(
          f'{where}: a pretrained tensor of shape {np.shape(b)} where the model has {a.shape}.')
    return jax.device_put(np.asarray(b, a.dtype), a.sharding)

  params['encoder'] = jax.tree_util.tree_map(place, ours, encoder)
  return state.replace(params=params)
