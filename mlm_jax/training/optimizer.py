"""The optimizer: learning-rate schedules, AdamW or StableAdamW with its weight-decay mask,
gradient clipping.

Pretraining (training/build.py) and fine-tuning (finetuning/step.py) both
build their optimizer here, from the fields of a config.train section;
mlm_jax/train_checks.py holds their allowed values and checks them for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from mlm_jax.config import train_checks
from mlm_jax.runtime import platform_ops


def _linear(train: ml_collections.ConfigDict) -> optax.Schedule:
  """BERT's schedule: linear warm-up to the peak, then linear decay to 0."""
  warmup = optax.linear_schedule(0.0, train.learning_rate, max(train.warmup_steps, 1))
  decay = optax.linear_schedule(train.learning_rate, 0.0,
                                max(train.num_steps - train.warmup_steps, 1))
  return optax.join_schedules([warmup, decay], [train.warmup_steps])


def _wsd(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Warmup-stable-decay (a trapezoid): linear warm-up, the peak, then a decay to 0.

  The decay is linear by default, as in Cramming's trapezoid (Geiping &
  Goldstein, 2022); decay_shape='1-sqrt' is ModernBERT's (Warner et al.,
  2024, after Hägele et al., 2024). It takes the last `decay_fraction` of the
  steps, but never starts before the warm-up ends (a short trial run of a long
  config only warms up).
  """
  peak = train.learning_rate
  end = peak * train.get('final_lr_ratio', 0.0)
  decay_start = max(train.num_steps - max(round(train.decay_fraction * train.num_steps), 1),
                    train.warmup_steps)
  decay_steps = max(train.num_steps - decay_start, 1)
  warmup = optax.linear_schedule(0.0, peak, max(train.warmup_steps, 1))
  return optax.join_schedules(
      [warmup, optax.constant_schedule(peak), _decay(train.decay_shape, peak, end, decay_steps)],
      [train.warmup_steps, decay_start])


def _decay(shape: str, peak: float, end: float, steps: int) -> optax.Schedule:
  """From `peak` to `end` over `steps` steps, linearly or as 1 - sqrt (then held)."""
  if shape == 'linear':
    return optax.linear_schedule(peak, end, steps)
  # '1-sqrt': end + (peak - end) * (1 - sqrt(t / steps)); optax has no such
  # schedule, so it is the square root of optax's clipped linear ramp.
  ramp = optax.linear_schedule(0.0, 1.0, steps)

  def decay(step):
    return end + (peak - end) * (1.0 - jnp.sqrt(ramp(step)))
  return decay


def _constant(train: ml_collections.ConfigDict) -> optax.Schedule:
  """A phase that warms up and then holds the peak (the 'stable' of warmup-stable-decay)."""
  warmup = optax.linear_schedule(0.0, train.learning_rate, max(train.warmup_steps, 1))
  return optax.join_schedules([warmup, optax.constant_schedule(train.learning_rate)],
                              [train.warmup_steps])


def _decay_phase(train: ml_collections.ConfigDict) -> optax.Schedule:
  """A phase that decays from the peak over all its steps (the 'decay' of WSD)."""
  peak = train.learning_rate
  return _decay(train.decay_shape, peak, peak * train.get('final_lr_ratio', 0.0),
                max(train.num_steps, 1))


def _one_cycle(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Smith's one-cycle: a cosine up to the peak at the end of warm-up, then down.

  It starts at peak/25 and ends at peak/2.5e5 at num_steps (optax's default
  div_factor and final_div_factor).
  """
  # optax places the peak at int(pct_start * num_steps); half a step more than
  # warmup_steps keeps float rounding from moving it a step early.
  pct_start = (train.warmup_steps + 0.5) / train.num_steps
  return optax.cosine_onecycle_schedule(train.num_steps, train.learning_rate, pct_start)


# config.train.schedule -> the function that builds it.
_SCHEDULES = {'linear': _linear, 'wsd': _wsd, 'one_cycle': _one_cycle, 'constant': _constant,
              'decay': _decay_phase}
SCHEDULES = train_checks.SCHEDULES
assert tuple(_SCHEDULES) == SCHEDULES, 'train_checks.SCHEDULES names the schedules here'
# config.train.decay_shape: how 'wsd' falls from the peak to 0.
DECAY_SHAPES = train_checks.DECAY_SHAPES
# config.train.optimizer: 'adamw' or 'stable_adamw' (make_optimizer).
OPTIMIZERS = train_checks.OPTIMIZERS


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """The learning rate of each step, as config.train.schedule names it (see SCHEDULES)."""
  return _SCHEDULES[train.schedule](train)


def run_schedule(phases: Sequence[Any], offset: int = 0) -> optax.Schedule:
  """The learning rate of a run in phases (phases.Phase), at the optimizer's count + `offset`.

  Each phase's schedule spans its own steps (Phase.schedule_train), joined at
  the phases' first steps; one phase is its schedule alone. `offset` is the
  global step at which the optimizer's count restarted (a phase's
  fresh_optimizer), so that the rate is the run's at every global step.
  """
  parts = [learning_rate_schedule(p.schedule_train()) for p in phases]
  joined = parts[0] if len(parts) == 1 else optax.join_schedules(
      parts, [p.start_step for p in phases[1:]])
  if not offset:
    return joined
  return lambda count: joined(count + offset)


def weight_decay_mask(params: Any) -> Any:
  """True for matrices (dense kernels, embeddings); False for biases and LayerNorm."""
  def decays(path, _):
    # The last dict key names the tensor (a boxed leaf adds an attribute key).
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return name in ('kernel', 'embedding')
  return jax.tree_util.tree_map_with_path(decays, params)


class _UpdateRmsClipState(NamedTuple):
  inner: optax.OptState


def clip_by_update_rms(inner: optax.GradientTransformation, b2: float,
                       eps: float) -> optax.GradientTransformation:
  """StableAdamW's clip (Wortsman et al., 2023; ModernBERT): each tensor's update of `inner`
  (optax.scale_by_adam, possibly chained with the decoupled weight decay) divided by
  max(1, RMS), RMS = sqrt(mean(g^2 / max(v_hat, eps^2))) over that tensor.

  g is this step's gradient, v_hat Adam's second moment after this step (in
  `inner`'s state, its `nu` and `count`) bias-corrected with `b2`, the beta2
  `inner` was built with. Dividing the
  update is dividing that tensor's learning rate, decay included: where a
  gradient is far larger than Adam's running estimate of it (the moment
  that makes Adam's step explode), the step stays an RMS of 1.
  """
  def init(params):
    return _UpdateRmsClipState(inner.init(params))

  def update(grads, state, params=None):
    updates, inner_state = inner.update(grads, state.inner, params)
    adam = [s for s in jax.tree_util.tree_leaves(
        inner_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1, 'clip_by_update_rms wraps one optax.scale_by_adam'
    nu, count = adam[0].nu, adam[0].count
    correction = 1 - b2 ** count.astype(jnp.float32)

    def clipped(u, g, v):
      v_hat = v / correction
      rms = jnp.sqrt(jnp.mean(jnp.square(g) / jnp.maximum(v_hat, eps * eps)))
      return u / jnp.maximum(1.0, rms).astype(u.dtype)
    return (jax.tree_util.tree_map(clipped, updates, grads, nu),
            _UpdateRmsClipState(inner_state))

  return optax.GradientTransformation(init, update)


def _stable_adamw(train: ml_collections.ConfigDict,
                  schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW whose per-tensor learning rate is divided by max(1, RMS) (clip_by_update_rms)."""
  adam_and_decay = optax.chain(
      optax.scale_by_adam(b1=train.adam_b1, b2=train.adam_b2, eps=train.adam_eps),
      optax.add_decayed_weights(train.weight_decay, weight_decay_mask))
  return optax.chain(clip_by_update_rms(adam_and_decay, train.adam_b2, train.adam_eps),
                     optax.scale_by_learning_rate(schedule))


def make_optimizer(train: ml_collections.ConfigDict, platform: str | None = None,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """Clipping by the global norm, then AdamW (or StableAdamW, config.train.optimizer) on
  config.train's schedule.

  `platform` is where the step that applies it runs (default: JAX's backend
  here); it picks the form of the clipping (platform_ops), never its result
  beyond the last bit or two, nor the optimizer state's structure.
  `schedule`: the learning rate by the optimizer's count (a run in phases:
  run_schedule); default config.train's.
  """
  schedule = schedule or learning_rate_schedule(train)
  # The chain keeps one shape whatever the settings, so a run can be resumed
  # with clipping switched off (an infinite threshold never clips).
  clip = train.grad_clip_norm if train.grad_clip_norm > 0 else float('inf')
  clip_norm = platform_ops.for_platform(platform).clip_by_global_norm(clip)
  # Fine-tuning's config.train has no optimizer field: AdamW.
  if train.get('optimizer', 'adamw') == 'stable_adamw':
    return optax.chain(clip_norm, _stable_adamw(train, schedule))
  return optax.chain(
      clip_norm,
      optax.adamw(schedule, b1=train.adam_b1, b2=train.adam_b2,
                  eps=train.adam_eps, weight_decay=train.weight_decay, mask=weight_decay_mask))
