"""A train state that continues a Composer training checkpoint of FlexBERT (ModernBERT, Ettin,
mmBERT; read by interop/composer.py): its weights, and where the file holds them StableAdamW's
moments, step count and the run's step.

Composer's StableAdamW (optimi's) keeps Adam's moments bias-corrected; ours (optax's
scale_by_adam inside optimizer.clip_by_update_rms) keeps them uncorrected beside its count,
so the moments are converted (Checkpoint.adam_moments) and every ScaleByAdamState of the
optimizer state takes them with the file's step count; every ScaleByScheduleState (the
learning rate's count) and the state's step take the run's step. The learning rate itself is
the config's schedule at that step: the file's last rate (Checkpoint.learning_rate) is what
it should give there.

What must stay true: the arrays are placed on the shardings of the state they replace (no
process gathers the state); a file without an optimizer leaves the optimizer as created; one
update of ours from the returned state equals the source optimizer's next step
(tests/test_composer.py).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from mlm_jax import model as model_lib
from mlm_jax.interop import composer
from mlm_jax.training import init_from


def _put(old: Any, new: Any) -> Any:
  """`new` (a host array or number) on `old`'s sharding and dtype; a Python number stays one."""
  if not isinstance(old, jax.Array):
    return type(old)(new) if isinstance(old, (int, float)) else np.asarray(new, old.dtype)
  host = np.asarray(new).astype(old.dtype)
  if host.shape != old.shape:
    raise ValueError(f'a continued tensor has shape {host.shape}, its state {old.shape}')
  return jax.make_array_from_callback(old.shape, old.sharding, lambda index: host[index])


def initial_state(state: Any, checkpoint: composer.Checkpoint,
                  model_cfg: model_lib.ModelConfig) -> Any:
  """`state` (training/state.TrainState, as built for `model_cfg`) with the checkpoint's
  weights (and EMA, if the state keeps one, started at them), and its optimizer moments and
  counts where the file has them."""
  params = checkpoint.params(model_cfg)
  state = init_from.place(state, params)
  if getattr(state, 'ema_params', None) is not None:
    state = state.replace(ema_params=jax.tree_util.tree_map(_put, state.ema_params, params))
  moments = checkpoint.adam_moments(model_cfg)
  if moments is None:
    return state
  mu, nu = moments
  kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)

  def continued(part: Any) -> Any:
    if isinstance(part, optax.ScaleByAdamState):
      return part._replace(count=_put(part.count, checkpoint.optimizer_step),
                           mu=jax.tree_util.tree_map(_put, part.mu, mu),
                           nu=jax.tree_util.tree_map(_put, part.nu, nu))
    if isinstance(part, optax.ScaleByScheduleState):
      return part._replace(count=_put(part.count, checkpoint.step))
    return part

  opt_state = jax.tree_util.tree_map(continued, state.opt_state,
                                     is_leaf=lambda x: isinstance(x, kinds))
  return state.replace(opt_state=opt_state, step=_put(state.step, checkpoint.step))
