"""A train state that continues a Composer training checkpoint of FlexBERT (ModernBERT, Ettin,
mmBERT; read by interop/composer.py): its weights, and where the file holds them StableAdamW's
moments, step count and the run's step.

Composer's StableAdamW (optimi's) keeps Adam's moments bias-corrected; ours (optax's
scale_by_adam inside optimizer.clip_by_update_rms) keeps them uncorrected beside its count,
so the moments are converted (Checkpoint.adam_moments) and every ScaleByAdamState of the
optimizer state takes them with the file's step count; every ScaleByScheduleState (the
learning rate's count) and the state's step take the run's step, the file's (Timestamp's
batch): the run goes on from there, its train.num_steps and phases counting the file's steps
too. The learning rate itself is the config's schedule at that step: the file's last rate
(Checkpoint.learning_rate) is what it should give there, and `continue_run` logs both.

What must stay true: the arrays are placed on the shardings of the state they replace (no
process gathers the state); a file without an optimizer leaves the moments as created (its
step still counts); one update of ours from the returned state equals the source optimizer's
next step (tests/test_composer.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from absl import logging

from mlm_jax import model as model_lib
from mlm_jax.errors import ConfigError
from mlm_jax.interop import composer
from mlm_jax.training import init_from

FLAG = 'config.init.composer'


def _put(old: Any, new: Any) -> Any:
  """`new` (a host array or number) on `old`'s sharding and dtype; a Python number stays one."""
  if not isinstance(old, jax.Array):
    return type(old)(new) if isinstance(old, (int, float)) else np.asarray(new, old.dtype)
  host = np.asarray(new).astype(old.dtype)
  if host.shape != old.shape:
    raise ValueError(f'a continued tensor has shape {host.shape}, its state {old.shape}')
  return jax.make_array_from_callback(old.shape, old.sharding, lambda index: host[index])


def read(name: str) -> composer.Checkpoint:
  """config.init.composer's checkpoint, read once per process (composer.read); ConfigError in
  one line for a file that cannot be found or read."""
  try:
    return composer.read(name, FLAG)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def initial_state(state: Any, checkpoint: composer.Checkpoint,
                  model_cfg: model_lib.ModelConfig, schedule_count: int | None = None) -> Any:
  """`state` (training/state.TrainState, as built for `model_cfg`) with the checkpoint's
  weights (and EMA, if the state keeps one, started at them), its optimizer moments and their
  count where the file has them, and its step.

  `schedule_count`: the learning rate's count, where the optimizer's schedule counts from
  another step than 0 (a phase's fresh optimizer: the file's step less that phase's start,
  phases.learning_rate_offset); default the file's step.
  """
  params = checkpoint.params(model_cfg)
  state = init_from.place(state, params)
  if getattr(state, 'ema_params', None) is not None:
    state = state.replace(ema_params=jax.tree_util.tree_map(_put, state.ema_params, params))
  moments = checkpoint.adam_moments(model_cfg)
  count = checkpoint.step if schedule_count is None else schedule_count
  kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)

  def continued(part: Any) -> Any:
    if isinstance(part, optax.ScaleByAdamState) and moments is not None:
      mu, nu = moments
      return part._replace(count=_put(part.count, checkpoint.optimizer_step),
                           mu=jax.tree_util.tree_map(_put, part.mu, mu),
                           nu=jax.tree_util.tree_map(_put, part.nu, nu))
    if isinstance(part, optax.ScaleByScheduleState):
      return part._replace(count=_put(part.count, count))
    return part

  opt_state = jax.tree_util.tree_map(continued, state.opt_state,
                                     is_leaf=lambda x: isinstance(x, kinds))
  return state.replace(opt_state=opt_state, step=_put(state.step, checkpoint.step))


def continue_run(state: Any, name: str, model_cfg: model_lib.ModelConfig, *,
                 schedule_offset: int = 0, schedule: Callable[[int], Any] | None = None,
                 train: ml_collections.ConfigDict | None = None) -> tuple[Any, int]:
  """(`state` continuing config.init.composer's checkpoint `name`, the step the run goes on
  from: the file's). `schedule_offset` as initial_state's; `schedule`: the run's learning rate
  by global step, whose value at the file's step is logged beside the file's last rate, in the
  one line that says what was carried. `train` (config.train): its Adam betas and epsilon,
  a warning where they are not the file's (the moments' averages would change pace). The
  checkpoint is let go afterwards (composer.forget).
  """
  checkpoint = read(name)
  state = initial_state(state, checkpoint, model_cfg, checkpoint.step - schedule_offset)
  rate = None if schedule is None else float(schedule(checkpoint.step))
  logging.info('%s', describe(checkpoint, rate))
  pairs = (('adam_b1', 'beta1'), ('adam_b2', 'beta2'), ('adam_eps', 'eps'))
  differ = [f"config.train.{ours}={train[ours]!r} (the file's {theirs} "
            f'{checkpoint.hyper[theirs]!r})' for ours, theirs in pairs
            if train is not None and checkpoint.moments is not None
            and not np.isclose(train[ours], checkpoint.hyper[theirs], rtol=1e-6, atol=0.0)]
  if differ:
    logging.warning('The moments of %s continue under %s: set them to the file\'s to continue '
                    'its run as it went.', checkpoint.path, ', '.join(differ))
  composer.forget()
  return state, checkpoint.step


def describe(checkpoint: composer.Checkpoint, learning_rate: float | None = None) -> str:
  """One line: what a run takes from the checkpoint, and the learning rates at its step."""
  moments = (f"StableAdamW's moments at its step {checkpoint.optimizer_step:,}"
             if checkpoint.moments is not None else 'no optimizer state in the file: moments '
             'fresh')
  rates = []
  if checkpoint.learning_rate is not None:
    rates.append(f"the file's last {checkpoint.learning_rate:.3g}")
  if learning_rate is not None:
    rates.append(f"the config's schedule {learning_rate:.3g}")
  rate = f"; learning rate at step {checkpoint.step:,}: {', '.join(rates)}" if rates else ''
  return (f'Continued from the Composer checkpoint {checkpoint.path} at step '
          f'{checkpoint.step:,}: its weights; {moments}{rate}')
