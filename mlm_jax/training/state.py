"""The train state and the batch it steps on: shapes, and a state made where it will live.

`sharded_state_init` derives the state's shardings from `jax.eval_shape` and
creates it under jit straight into them, so no device ever holds the whole
state; `create_state` makes a plain one on the default device for tests and
small tools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from mlm_jax.runtime import sharding

Array = jax.Array
Batch = dict[str, Array]


class TrainState(train_state.TrainState):
  """step, params, opt_state, ema_params (+ static apply_fn and tx).

  ema_params: the exponential moving average of the parameters
  (config.train.ema_decay > 0), of the params' tree, dtypes and shardings;
  None when there is none, which leaves the state's tree, its checkpoints and
  the step exactly as they are without it.
  """
  ema_params: Any = None


def batch_spec(batch_size: int, seq_len: int, max_predictions: int,
               sentence_pair: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes and dtypes of a batch as the host pipeline (masking.Masker) makes it.

  input_ids, segment_ids, attention_mask, document_ids [B, T] int32; masked_positions,
  masked_ids, masked_kinds [B, P] int32, masked_weights [B, P] float32; with a
  sentence-pair task also sentence_pair_labels [B] int32 and
  sentence_pair_weights [B] float32.
  """
  b, t, p = batch_size, seq_len, max_predictions
  spec = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in (
      ('input_ids', (b, t), jnp.int32), ('segment_ids', (b, t), jnp.int32),
      ('attention_mask', (b, t), jnp.int32), ('document_ids', (b, t), jnp.int32),
      ('masked_positions', (b, p), jnp.int32),
      ('masked_ids', (b, p), jnp.int32), ('masked_weights', (b, p), jnp.float32),
      ('masked_kinds', (b, p), jnp.int32))}
  if sentence_pair:
    spec['sentence_pair_labels'] = jax.ShapeDtypeStruct((b,), jnp.int32)
    spec['sentence_pair_weights'] = jax.ShapeDtypeStruct((b,), jnp.float32)
  return spec


def example_batch(seq_len: int, max_predictions: int, sentence_pair: bool = False) -> Batch:
  """A one-row batch of batch_spec's shapes (all tokens real) to initialise a model with."""
  spec = batch_spec(1, seq_len, max_predictions, sentence_pair)
  batch = {k: jnp.zeros(x.shape, x.dtype) for k, x in spec.items()}
  batch['attention_mask'] += 1
  batch['document_ids'] += 1
  if sentence_pair:
    batch['sentence_pair_weights'] += 1
  return batch


def _boxed_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                 rng: Array, example_batch: Batch, ema: bool = False) -> TrainState:
  """A fresh state whose parameters and Adam moments still carry their logical axis names;
  with `ema`, an average of the parameters that starts at them (named like them)."""
  params = model.init(rng, example_batch, deterministic=True)['params']
  state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return state.replace(ema_params=params) if ema else state


def ema_from_params(state: TrainState) -> TrainState:
  """The state with its average restarted at its parameters (new buffers: the step donates
  both); as it is when it keeps no average. For weights loaded into a fresh state."""
  if state.ema_params is None:
    return state
  return state.replace(ema_params=jax.tree_util.tree_map(jnp.copy, state.params))


def create_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                 rng: Array, example_batch: Batch, ema: bool = False) -> TrainState:
  """A fresh state of plain arrays, on the default device (tests, small tools)."""
  return flax.linen.unbox(_boxed_state(model, tx, rng, example_batch, ema))


def sharded_state_init(model: flax.linen.Module, tx: optax.GradientTransformation,
                       rng: Array, example_batch: Batch, mesh,
                       ema: bool = False) -> tuple[TrainState, Any, Callable[[], TrainState]]:
  """(abstract state, its shardings, init): the state's layout, and how to make it.

  The abstract state has jax.ShapeDtypeStruct leaves that carry their
  shardings (from jax.eval_shape: nothing is allocated). `init()` creates the
  state under jit straight into those shardings: parameters and optimizer
  moments split on the mesh by their logical axis names (see
  sharding.LOGICAL_RULES), so no device ever holds the whole state when
  fsdp > 1. The state has plain arrays (no logical boxes). With `ema`, the
  state keeps an average of the parameters, sharded like them.
  """
  boxed = lambda r: _boxed_state(model, tx, r, example_batch, ema)
  shardings = sharding.state_shardings(jax.eval_shape(boxed, rng), mesh)
  shapes = jax.eval_shape(lambda r: flax.linen.unbox(boxed(r)), rng)
  abstract = jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)
  init = jax.jit(lambda r: flax.linen.unbox(boxed(r)), out_shardings=shardings)
  return abstract, shardings, lambda: init(rng)


def create_sharded_state(model: flax.linen.Module, tx: optax.GradientTransformation,
                         rng: Array, example_batch: Batch, mesh,
                         ema: bool = False) -> tuple[TrainState, Any]:
  """(state, its shardings): initialised under jit straight into its sharding."""
  _, shardings, init = sharded_state_init(model, tx, rng, example_batch, mesh, ema)
  return init(), shardings
