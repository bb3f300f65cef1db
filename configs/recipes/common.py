"""What the recipes share: the masked-slot count P for a rate, and the smoke variant of a tiny
recipe (its phases cut to a few steps, for tests).

Not a recipe itself: it has no get_config().
"""

import copy

import ml_collections

from mlm_jax.data import masking


def max_predictions(rate: float, seq_len: int, multiple: int = 1) -> int:
  """The static P that holds every selected slot of a full row at `rate`, rounded up to a
  multiple of `multiple`.

  A full row gets masking.full_row_slots(rate, seq_len) slots. The
  published recipes round P up to a multiple of 8: XLA's GPU compiler found
  no tiling for the head's [rows x P, d] matmuls at P = 307 (a prime), and the
  extra slots are padding that costs nothing in the loss.
  """
  return -(-masking.full_row_slots(rate, seq_len) // multiple) * multiple


def smoke(config: ml_collections.ConfigDict, steps: int = 3) -> ml_collections.ConfigDict:
  """A tiny recipe with every phase cut to `steps` optimizer steps (the first to steps + 1,
  so that a batch warm-up of one step fits in it) and the log, evaluation and checkpoint
  cadence at a step or two: the same phases, shapes and settings, run in seconds.

  What must stay true: every phase keeps its overrides (row length, masking,
  schedule, batch), so a smoke run goes through every boundary the tiny run
  does; only lengths and cadences shrink.
  """
  config = copy.deepcopy(config)
  train = config.train
  # A batch warm-up of one step at the start batch: it still grows inside the first phase.
  if train.batch_warmup_tokens:
    train.batch_warmup_tokens = train.batch_warmup_start * config.data.seq_len
  train.warmup_steps = min(train.warmup_steps, 1)
  train.log_every, train.eval_every, train.checkpoint_every = 1, 2, 2
  config.eval.max_batches = 2
  if config.masking.rate_change_tokens:
    config.masking.rate_change_tokens = 0  # The first phase's end.
  shortened = []
  for index, phase in enumerate(config.phases):
    phase = copy.deepcopy(dict(phase))
    phase.pop('tokens', None)
    phase['steps'] = steps + (1 if index == 0 and train.batch_warmup_tokens else 0)
    overrides = phase.get('overrides', {})
    if 'warmup_steps' in overrides.get('train', {}):
      overrides['train']['warmup_steps'] = min(overrides['train']['warmup_steps'], 1)
    if overrides.get('masking', {}).get('rate_change_tokens'):
      overrides['masking']['rate_change_tokens'] = 0  # The phase's end.
    shortened.append(phase)
  config.phases = tuple(shortened)
  return config
