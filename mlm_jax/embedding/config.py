"""The embedding config: its defaults, its checks, and the plan it resolves to for a data set.

`python -m mlm_jax.embed` runs with `get_config()` unless fields are
overridden (`--config.loss.temperature=0.02`). What must stay true:

  - every field is checked here, before any file is read or step compiled,
    with a message that names the field and the fix;
  - a contrastive batch holds at least 2 pairs (each pair's in-batch
    negatives are the other pairs), over all devices;
  - `train.mini_batch_size` (GradCache) changes memory, never the loss or
    the gradient: it must divide the batch and split evenly over devices;
  - fields left 0 / None are resolved by `plan()` once the training pairs
    and the encoder are known, and the plan is recorded (OUT/config.json).
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
from ml_collections import config_dict

from mlm_jax.errors import one_of
from mlm_jax.errors import require
from mlm_jax.finetuning import config as finetune_config
from mlm_jax.training import optimizer

# How token vectors become one vector per text (model.py): the mean over real tokens,
# the first token ([CLS]), or the last real token ([SEP] for BERT rows; decoder-style models).
POOLINGS = ('mean', 'cls', 'last')
# A learned temperature is CLIP's: the logit scale 1/temperature is a parameter
# (trained in log space), clipped at this value (Radford et al., 2021).
MAX_LOGIT_SCALE = 100.0


def get_config() -> ml_collections.ConfigDict:
  """The defaults: one epoch of batches of 64 pairs, temperature 0.05 (sentence-transformers'
  scale 20), mean pooling, AdamW with 10% warm-up then linear decay."""
  config = ml_collections.ConfigDict()
  # Seed of the pair order, dropout and (a learned temperature aside) nothing else:
  # the encoder starts from the pretrained one.
  config.seed = 0

  config.data = ml_collections.ConfigDict()
  # Pieces per text ([CLS] and [SEP] included), queries and documents alike; None: the
  # pretraining run's data.seq_len (--workdir), or for --hf_dir the longest text of the
  # training data rounded up to a multiple of 8, at most 512. Longer texts are cut (counted).
  config.data.seq_len = config_dict.placeholder(int)
  # Field names of a jsonl or parquet pair: the query, its positive and its hard negatives
  # (a list of texts, or one text; optional).
  config.data.query_field = 'query'
  config.data.positive_field = 'positive'
  config.data.negatives_field = 'negatives'
  # Hard negatives per pair (a static shape); None: the most any pair has, where pairs with
  # fewer have the missing ones masked out. A pair with more keeps its first ones.
  config.data.num_negatives = config_dict.placeholder(int)
  # A BEIR directory's qrels split the pairs are read from (qrels/<split>.tsv).
  config.data.beir_split = 'train'
  # Text put before every query and every document (E5's 'query: ' and 'passage: '); the
  # export carries them as sentence-transformers prompts named 'query' and 'document'.
  config.data.query_prompt = ''
  config.data.document_prompt = ''

  config.model = ml_collections.ConfigDict()
  # POOLINGS: 'mean' over real tokens, 'cls' (the first token) or 'last' (the last real one).
  config.model.pooling = 'mean'
  # Dropout in the encoder; None: the pretrained model's model.dropout_rate.
  config.model.dropout_rate = config_dict.placeholder(float)

  config.loss = ml_collections.ConfigDict()
  # InfoNCE's temperature on cosine similarities: logits = cos / temperature
  # (sentence-transformers' MultipleNegativesRankingLoss scale 20 = 0.05).
  config.loss.temperature = 0.05
  # Learn it (CLIP's logit scale, starting at 1/temperature, at most MAX_LOGIT_SCALE).
  config.loss.learn_temperature = False
  # Also the documents -> queries direction (each positive against every query of the
  # batch), averaged with queries -> documents.
  config.loss.symmetric = False

  config.train = ml_collections.ConfigDict()
  # Pairs per step, over all devices; every other pair of the step is a negative.
  config.train.batch_size = 64
  # GradCache (Gao et al., 2021): encode the batch in chunks of this many pairs (over all
  # devices), keeping only one chunk's activations; the same loss and gradient as the
  # plain step, for batches whose activations exceed memory. 0: off.
  config.train.mini_batch_size = 0
  # Passes over the training pairs; ignored when num_steps > 0.
  config.train.num_epochs = 1.0
  # Steps to train; 0: num_epochs passes over the pairs.
  config.train.num_steps = 0
  # Peak learning rate; 0: 5e-5 x 768 / hidden_size, at most 1e-3 (as fine-tuning picks).
  config.train.learning_rate = 0.0
  # Warm-up, as a fraction of the steps; then config.train.schedule.
  config.train.warmup_fraction = 0.1
  # After warm-up: 'linear' (decay to 0), 'wsd' or 'one_cycle' (training/optimizer.py).
  config.train.schedule = 'linear'
  # 'wsd' only: the decay's shape and share of the steps.
  config.train.decay_shape = 'linear'
  config.train.decay_fraction = 0.1
  # AdamW; weight decay skips biases, LayerNorms and the temperature.
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.999
  config.train.adam_eps = 1e-6
  config.train.weight_decay = 0.01
  # Clip the global gradient norm at this (0: no clipping).
  config.train.grad_clip_norm = 1.0
  # Log the training loss and in-batch accuracy every this many steps.
  config.train.log_every = 10
  # Save a checkpoint every this many steps (and at the end); 0: five times over the run.
  config.train.checkpoint_every = 0
  # Checkpoints kept for resuming (the newest).
  config.train.keep_checkpoints = 2
  # Also write TensorBoard event files under OUT/tb.
  config.train.tensorboard = True

  config.eval = ml_collections.ConfigDict()
  # Texts per encoding batch when evaluating, over all devices (the last is padded).
  config.eval.batch_size = 64

  config.mesh = ml_collections.ConfigDict()
  # Devices that split the train state (1: plain data parallelism).
  config.mesh.fsdp = 1
  return config


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """ConfigError naming the first invalid field."""
  d, t = config.data, config.train
  require(d.seq_len is None or d.seq_len >= 8,
          f'config.data.seq_len={d.seq_len} must be at least 8.')
  for name in ('query_field', 'positive_field', 'negatives_field', 'beir_split'):
    require(bool(str(d[name]).strip()), f"config.data.{name} is empty; name it, e.g. "
            f"{get_config().data[name]!r}.")
  require(d.num_negatives is None or d.num_negatives >= 0,
          f'config.data.num_negatives={d.num_negatives} must be >= 0 (or None: the most any '
          'pair has).')
  one_of('model', 'pooling', config.model.pooling, POOLINGS)
  rate = config.model.dropout_rate
  require(rate is None or 0.0 <= rate < 1.0,
          f'config.model.dropout_rate={rate} must be in [0, 1) (or None: as pretrained).')
  tau = config.loss.temperature
  require(1.0 / MAX_LOGIT_SCALE <= tau <= 1.0,
          f'config.loss.temperature={tau} must be in [{1 / MAX_LOGIT_SCALE}, 1] (logits are '
          'cosines divided by it; 0.05 is usual).')
  require(t.batch_size >= 2,
          f'config.train.batch_size={t.batch_size}: a contrastive batch needs at least 2 pairs '
          '(the negatives of a pair are the other pairs of its batch).')
  require(t.batch_size % num_devices == 0,
          f'config.train.batch_size={t.batch_size} must be a multiple of the {num_devices} '
          'devices.')
  mini = t.mini_batch_size
  require(mini >= 0, f'config.train.mini_batch_size={mini} must be >= 0 (0: off).')
  require(not mini or (t.batch_size % mini == 0 and mini % num_devices == 0),
          f'config.train.mini_batch_size={mini} must divide config.train.batch_size='
          f'{t.batch_size} and be a multiple of the {num_devices} devices.')
  for name in ('log_every', 'keep_checkpoints'):
    require(t[name] > 0, f'config.train.{name}={t[name]} must be positive.')
  for name in ('num_steps', 'checkpoint_every'):
    require(t[name] >= 0, f'config.train.{name}={t[name]} must be >= 0 (0: automatic).')
  require(t.num_steps > 0 or t.num_epochs > 0,
          f'config.train.num_epochs={t.num_epochs} must be positive when num_steps is 0.')
  require(t.learning_rate >= 0, f'config.train.learning_rate={t.learning_rate} must be >= 0 '
          '(0: picked from the model width).')
  require(0.0 <= t.warmup_fraction < 1.0,
          f'config.train.warmup_fraction={t.warmup_fraction} must be in [0, 1).')
  one_of('train', 'schedule', t.schedule, ('linear', 'wsd', 'one_cycle'))
  one_of('train', 'decay_shape', t.decay_shape, optimizer.DECAY_SHAPES)
  require(0.0 < t.decay_fraction <= 1.0,
          f'config.train.decay_fraction={t.decay_fraction} must be in (0, 1].')
  for name in ('weight_decay', 'grad_clip_norm', 'adam_eps'):
    require(t[name] >= 0, f'config.train.{name}={t[name]} must be >= 0.')
  for name in ('adam_b1', 'adam_b2'):
    require(0.0 <= t[name] < 1.0, f'config.train.{name}={t[name]} must be in [0, 1).')
  require(config.mesh.fsdp >= 1 and num_devices % config.mesh.fsdp == 0,
          f'config.mesh.fsdp={config.mesh.fsdp} must divide the {num_devices} devices.')
  require(config.eval.batch_size > 0 and config.eval.batch_size % num_devices == 0,
          f'config.eval.batch_size={config.eval.batch_size} must be a positive multiple of the '
          f'{num_devices} devices.')


@dataclasses.dataclass(frozen=True)
class Plan:
  """What the config resolves to for one set of training pairs and one encoder."""

  num_steps: int
  steps_per_epoch: int
  warmup_steps: int
  learning_rate: float
  checkpoint_every: int

  def train_section(self, train: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """config.train with the resolved values: what optimizer.make_optimizer reads."""
    section = train.copy_and_resolve_references()
    with section.unlocked():
      section.num_steps, section.warmup_steps = self.num_steps, self.warmup_steps
      section.learning_rate = self.learning_rate
      section.checkpoint_every = self.checkpoint_every
    return section


def plan(train: ml_collections.ConfigDict, num_pairs: int, hidden_size: int) -> Plan:
  """Steps, warm-up, peak learning rate and checkpoint cadence for `num_pairs` pairs."""
  steps_per_epoch = max(math.ceil(num_pairs / train.batch_size), 1)
  num_steps = train.num_steps or max(math.ceil(train.num_epochs * steps_per_epoch), 1)
  return Plan(num_steps=num_steps, steps_per_epoch=steps_per_epoch,
              warmup_steps=round(train.warmup_fraction * num_steps),
              learning_rate=(train.learning_rate
                             or finetune_config.default_learning_rate(hidden_size)),
              checkpoint_every=train.checkpoint_every or max(math.ceil(num_steps / 5), 1))
