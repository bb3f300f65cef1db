"""config.train, config.eval and config.profile: their allowed values and limits, checked.

These sections configure training/, but their checks live here, beside
configuration.py and outside training/: configuration checks every section
before a run without importing training (config flows one way, from the
command down), and training/ imports the allowed values from here
(optimizer.py its schedule names). Fine-tuning shares `check_optimizer`.
"""

from __future__ import annotations

import ml_collections

from mlm_jax.errors import one_of
from mlm_jax.errors import require

# config.train.schedule: the learning-rate schedules of training/optimizer.py.
SCHEDULES = ('linear', 'wsd', 'one_cycle', 'constant', 'decay')
# config.train.decay_shape: how a 'wsd' schedule decays.
DECAY_SHAPES = ('linear', '1-sqrt')
# config.train.optimizer: the optimizers of training/optimizer.py.
OPTIMIZERS = ('adamw', 'stable_adamw')


def check_train(train: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.train (optimizer, schedule, cadence, step layout).

  The whole section is checked here, the run's cadence included;
  `check_optimizer` holds the fields fine-tuning shares.
  """
  for name in ('batch_size', 'num_steps', 'log_every', 'eval_every', 'checkpoint_every',
               'keep_checkpoints'):
    require(train[name] > 0, f'config.train.{name}={train[name]} must be positive.')
  require(train.learning_rate > 0,
          f'config.train.learning_rate={train.learning_rate} must be positive.')
  # warmup_steps > num_steps is allowed: a short trial run of a long config.
  require(train.warmup_steps >= 0, f'config.train.warmup_steps={train.warmup_steps} must be >= 0.')
  check_optimizer(train)
  one_of('train', 'optimizer', train.optimizer, OPTIMIZERS)
  require(0 <= train.ema_decay < 1,
          f'config.train.ema_decay={train.ema_decay} must be in [0, 1) (0: no average; '
          'e.g. 0.999).')
  # The one-cycle peak must fall inside the run for the cycle to exist.
  require(train.schedule != 'one_cycle' or train.warmup_steps < train.num_steps,
          f"config.train.schedule='one_cycle' needs warmup_steps={train.warmup_steps} < "
          f"num_steps={train.num_steps}: lower warmup_steps or use 'linear' or 'wsd'.")
  require(train.grad_accum_steps >= 1,
          f'config.train.grad_accum_steps={train.grad_accum_steps} must be at least 1.')
  require(train.concurrent_chains >= 0,
          f'config.train.concurrent_chains={train.concurrent_chains} must be >= 0 (0: auto).')


def check_optimizer(train: ml_collections.ConfigDict) -> None:
  """ConfigError for the fields the optimizer and its schedule read beyond the steps and the
  peak: schedule, its decay, weight decay, clipping (fine-tuning checks them so too)."""
  one_of('train', 'schedule', train.schedule, SCHEDULES)
  one_of('train', 'decay_shape', train.decay_shape, DECAY_SHAPES)
  require(0 <= train.get('final_lr_ratio', 0.0) < 1,
          f"config.train.final_lr_ratio={train.get('final_lr_ratio')} must be in [0, 1).")
  require(0 < train.decay_fraction <= 1,
          f'config.train.decay_fraction={train.decay_fraction} must be in (0, 1].')
  require(train.weight_decay >= 0, 'config.train.weight_decay must be >= 0.')
  require(train.grad_clip_norm >= 0, 'config.train.grad_clip_norm must be >= 0 (0 disables).')


def check_eval(eval_config: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.eval."""
  require(eval_config.batch_size > 0,
          f'config.eval.batch_size={eval_config.batch_size} must be positive.')
  require(eval_config.max_batches >= 0, 'config.eval.max_batches must be >= 0 (0: whole split).')


def check_profile(profile: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.profile."""
  require(profile.num_steps >= 0, 'config.profile.num_steps must be >= 0 (0: no trace).')
  require(profile.num_steps == 0 or profile.start_step >= 1,
          f'config.profile.start_step={profile.start_step} must be >= 1 (the first step is 1).')
  require(profile.peak_tflops >= 0, 'config.profile.peak_tflops must be >= 0 (0: from the chip).')
