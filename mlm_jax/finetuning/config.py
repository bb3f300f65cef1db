"""The fine-tuning config: its defaults, its checks, and the plan it resolves to for a data set.

`python -m mlm_jax.finetune` runs with `get_config()` unless fields are
overridden (`--config.train.learning_rate=3e-5`). Fields left to None (or
0 where noted) are resolved by `plan()` once the training file and the
pretrained model are known: the number of steps from the epochs (at least
`min_steps`), the warm-up from its fraction, the learning rate from the
model's width, the evaluation cadence from the epoch and the run's length.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
from ml_collections import config_dict

from mlm_jax.config import train_checks
from mlm_jax.errors import require

# The peak learning rate `plan` picks for BERT-base's width (Devlin et al.
# fine-tune at 2e-5..5e-5) ...
BASE_LEARNING_RATE, BASE_WIDTH = 5e-5, 768
# ... scaled by BASE_WIDTH / width for narrower models, at most this many
# times (small BERTs fine-tune best at 1e-4..1e-3: Turc et al., 2019).
MAX_LEARNING_RATE_SCALE = 20.0
# With eval_every 0, a run evaluates once per epoch, but at least MIN_EVALUATIONS
# and at most MAX_EVALUATIONS times over its steps (the best one is kept).
MIN_EVALUATIONS, MAX_EVALUATIONS = 5, 20
# config.data.seq_len None with a model of unknown row length (--hf_dir): the longest
# row of the files, rounded up to a multiple of SEQ_LEN_MULTIPLE, at most
# config.data.max_seq_len (AUTO_SEQ_LEN_LIMIT by default).
AUTO_SEQ_LEN_LIMIT, SEQ_LEN_MULTIPLE = 512, 8
# The scores a task reports (scores.py) and the one its best checkpoint is chosen by.
TASK_SCORES = {'classify': ('accuracy', 'mcc', 'loss'), 'pair': ('accuracy', 'mcc', 'loss'),
               'regress': ('pearson', 'spearman', 'mse', 'loss'),
               'tag': ('f1', 'accuracy', 'loss')}
# Scores where lower is better; every other one is maximised.
LOWER_IS_BETTER = ('loss', 'mse')


def get_config() -> ml_collections.ConfigDict:
  """The defaults: 3 epochs but at least 400 steps, batch 32, AdamW with 10% warm-up then
  linear decay, the best evaluation's checkpoint kept."""
  config = ml_collections.ConfigDict()
  # Seed of the head's initialisation, the epoch order and dropout.
  config.seed = 0

  config.data = ml_collections.ConfigDict()
  # Pieces per row, [CLS] and [SEP]s included; None: the pretraining run's data.seq_len
  # (--workdir), or for --hf_dir the longest row of the two files rounded up to a
  # multiple of 8, at most 512. Longer texts are truncated (and counted); at most the
  # model's position table.
  config.data.seq_len = config_dict.placeholder(int)
  # With seq_len None and a model of unknown row length: the most pieces the row length
  # chosen from the files may take (a protocol's cap: BERT's GLUE runs cut rows at 128).
  config.data.max_seq_len = AUTO_SEQ_LEN_LIMIT
  # Which field of a row (a column, a JSON key, a tfds feature) holds each input.
  # The text (classify, regress) or a pair's first text; None: 'text' (pair: the
  # first of finetuning/data.py's PAIR_FIELDS a row has; a tfds split without
  # 'text': its only text feature).
  config.data.text_field = config_dict.placeholder(str)
  # A pair's second text; set with text_field, or neither.
  config.data.text_pair_field = config_dict.placeholder(str)
  # The label (classify, pair, regress); a tfds ClassLabel is read as its name.
  config.data.label_field = 'label'
  # A tag row's words and their tags (lists of equal length).
  config.data.tokens_field = 'tokens'
  config.data.tags_field = 'tags'
  # Where tfds datasets named as --train_data=tfds:NAME:SPLIT are prepared (array_record);
  # None: tfds's default (~/tensorflow_datasets or $TFDS_DATA_DIR).
  config.data.tfds_data_dir = config_dict.placeholder(str)

  config.model = ml_collections.ConfigDict()
  # Dropout in the encoder; None: the pretraining run's model.dropout_rate.
  config.model.dropout_rate = config_dict.placeholder(float)
  # Dropout before the classifier; None: the encoder's dropout rate (BERT's choice).
  config.model.classifier_dropout = config_dict.placeholder(float)

  config.train = ml_collections.ConfigDict()
  # Rows per step, over all devices.
  config.train.batch_size = 32
  # Passes over the training file; ignored when num_steps > 0.
  config.train.num_epochs = 3.0
  # With num_steps 0: at least this many steps, however small the file (3 epochs
  # of 1,000 rows are only 94 steps, short of what the model reaches with more;
  # the best evaluation is kept, so extra passes cost time, not quality).
  config.train.min_steps = 400
  # Steps to train; 0: max(num_epochs passes over the training file, min_steps).
  config.train.num_steps = 0
  # Peak learning rate; 0: 5e-5 x 768 / hidden_size, at most 20x (1e-3 for d <= 38).
  config.train.learning_rate = 0.0
  # Warm-up, as a fraction of the steps.
  config.train.warmup_fraction = 0.1
  # After warm-up: 'linear' (decay to 0, BERT's), 'wsd' or 'one_cycle' (see training/step.py).
  config.train.schedule = 'linear'
  # 'wsd' only: the decay's shape and share of the steps.
  config.train.decay_shape = 'linear'
  config.train.decay_fraction = 0.1
  # AdamW; weight decay skips biases and LayerNorms.
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.999
  config.train.adam_eps = 1e-6
  config.train.weight_decay = 0.01
  # Clip the global gradient norm at this (0: no clipping).
  config.train.grad_clip_norm = 1.0
  # Log the training loss every this many steps.
  config.train.log_every = 10
  # Evaluate every this many steps (and at the end); 0: once per epoch, but at least
  # 5 and at most 20 times over the run (every num_steps/5 or num_steps/20 steps).
  config.train.eval_every = 0
  # The evaluation score that picks the model kept (OUT/best): '' for the task's
  # main one (classify, pair: accuracy; regress: pearson; tag: f1), or another the
  # task reports (mcc, spearman, mse, loss, ...; mse and loss are minimised). A tie goes
  # to the lower eval loss, then to the earlier step.
  config.train.best_metric = ''
  # Save a checkpoint every this many steps (and at the end); 0: at every evaluation.
  config.train.checkpoint_every = 0
  # Checkpoints kept for resuming (the newest); the best one is kept apart.
  config.train.keep_checkpoints = 2
  # Also write TensorBoard event files under OUT/tb.
  config.train.tensorboard = True

  config.eval = ml_collections.ConfigDict()
  # Rows per evaluation batch, over all devices (the last batch is padded, never dropped).
  config.eval.batch_size = 64

  config.mesh = ml_collections.ConfigDict()
  # Devices that split the train state (1: plain data parallelism).
  config.mesh.fsdp = 1
  return config


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """ConfigError naming the first invalid field."""
  t = config.train
  require(config.data.seq_len is None or config.data.seq_len >= 8,
          f'config.data.seq_len={config.data.seq_len} must be at least 8.')
  require(config.data.max_seq_len >= 8,
          f'config.data.max_seq_len={config.data.max_seq_len} must be at least 8.')
  for name in ('text_field', 'text_pair_field', 'label_field', 'tokens_field', 'tags_field'):
    value = config.data[name]
    require(value is None or bool(value.strip()),
            f"config.data.{name} is empty; name the field, e.g. 'sentence'.")
  for name in ('dropout_rate', 'classifier_dropout'):
    value = config.model[name]
    require(value is None or 0.0 <= value < 1.0,
            f'config.model.{name}={value} must be in [0, 1) (or None: as pretrained).')
  for name in ('batch_size', 'log_every', 'keep_checkpoints'):
    require(t[name] > 0, f'config.train.{name}={t[name]} must be positive.')
  for name in ('num_steps', 'min_steps', 'eval_every', 'checkpoint_every'):
    require(t[name] >= 0, f'config.train.{name}={t[name]} must be >= 0 (0: automatic).')
  scores = sorted({name for names in TASK_SCORES.values() for name in names})
  require(not t.best_metric or t.best_metric in scores,
          f'config.train.best_metric={t.best_metric!r} is none of the scores {scores} '
          "(or '': the task's main one).")
  require(t.num_steps > 0 or t.num_epochs > 0,
          f'config.train.num_epochs={t.num_epochs} must be positive when num_steps is 0.')
  require(t.learning_rate >= 0, f'config.train.learning_rate={t.learning_rate} must be >= 0 '
          '(0: picked from the model width).')
  require(0.0 <= t.warmup_fraction < 1.0,
          f'config.train.warmup_fraction={t.warmup_fraction} must be in [0, 1).')
  train_checks.check_optimizer(t)
  require(config.mesh.fsdp >= 1 and num_devices % config.mesh.fsdp == 0,
          f'config.mesh.fsdp={config.mesh.fsdp} must divide the {num_devices} devices.')
  for section in ('train', 'eval'):
    batch = config[section].batch_size
    require(batch > 0 and batch % num_devices == 0,
            f'config.{section}.batch_size={batch} must be a positive multiple of the '
            f'{num_devices} devices.')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the config resolves to for one training file and one pretrained model."""

  num_steps: int
  steps_per_epoch: int
  warmup_steps: int
  learning_rate: float
  eval_every: int
  checkpoint_every: int

  def train_section(self, train: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """config.train with the resolved values: what optimizer.make_optimizer reads."""
    section = train.copy_and_resolve_references()
    with section.unlocked():
      section.num_steps, section.warmup_steps = self.num_steps, self.warmup_steps
      section.learning_rate = self.learning_rate
      section.eval_every, section.checkpoint_every = self.eval_every, self.checkpoint_every
    return section


def default_num_steps(num_epochs: float, steps_per_epoch: int, min_steps: int) -> int:
  """max(num_epochs passes, min_steps): the length of a run that does not name its steps."""
  return max(math.ceil(num_epochs * steps_per_epoch), min_steps, 1)


def default_eval_every(steps_per_epoch: int, num_steps: int) -> int:
  """Once per epoch, clipped to MIN_EVALUATIONS..MAX_EVALUATIONS evaluations over num_steps."""
  fewest, most = math.ceil(num_steps / MAX_EVALUATIONS), math.ceil(num_steps / MIN_EVALUATIONS)
  return max(min(steps_per_epoch, most), fewest, 1)


def plan(train: ml_collections.ConfigDict, num_examples: int, hidden_size: int) -> Plan:
  """Steps, warm-up, peak learning rate and cadence for `num_examples` training rows."""
  steps_per_epoch = max(math.ceil(num_examples / train.batch_size), 1)
  num_steps = train.num_steps or default_num_steps(train.num_epochs, steps_per_epoch,
                                                   train.min_steps)
  learning_rate = train.learning_rate or default_learning_rate(hidden_size)
  eval_every = train.eval_every or default_eval_every(steps_per_epoch, num_steps)
  return Plan(num_steps=num_steps, steps_per_epoch=steps_per_epoch,
              warmup_steps=round(train.warmup_fraction * num_steps),
              learning_rate=learning_rate, eval_every=eval_every,
              checkpoint_every=train.checkpoint_every or eval_every)


@dataclasses.dataclass(frozen=True)
class Selection:
  """Which evaluation score picks the kept model, and which way is better."""

  metric: str
  higher_is_better: bool

  def better(self, result: dict[str, float], than: dict[str, float] | None) -> bool:
    """Whether evaluation `result` beats `than` (None: nothing yet).

    A tie on the metric (accuracy often ties on a small eval file) goes to
    the lower eval loss, the more confident model; a full tie keeps the earlier.
    """
    if than is None:
      return True
    value, best = result[self.metric], than[self.metric]
    if value != best:
      return value > best if self.higher_is_better else value < best
    return result['loss'] < than['loss']


def selection(task: str, best_metric: str, num_labels: int | None) -> Selection:
  """config.train.best_metric for `task` ('' -> its main score); ConfigError for one it lacks."""
  names = TASK_SCORES[task]
  metric = best_metric or names[0]
  require(metric in names, f'config.train.best_metric={metric!r}: task {task!r} reports '
          f'{", ".join(names)}.')
  require(metric != 'mcc' or num_labels == 2,
          f'config.train.best_metric=\'mcc\' needs two labels; the training file has '
          f'{num_labels}.')
  return Selection(metric, metric not in LOWER_IS_BETTER)


def default_learning_rate(hidden_size: int) -> float:
  """5e-5 at BERT-base's width, larger for narrower models (3e-4 at d=128), at most 1e-3."""
  return BASE_LEARNING_RATE * min(BASE_WIDTH / hidden_size, MAX_LEARNING_RATE_SCALE)
