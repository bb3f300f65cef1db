"""A small BERT for a CPU quick start: trains on the default corpus in minutes."""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # Held-out documents: more than base, so eval accuracy is not noisy.
  config.data.val_fraction = 0.05
  # A small vocabulary suits the ~1.7 MB default corpus.
  config.tokenizer.vocab_size = 8000
  # Number of transformer blocks (L).
  config.model.num_layers = 4
  # Model width (d).
  config.model.hidden_size = 256
  # Attention heads.
  config.model.num_heads = 4
  # MLP width (d_ff).
  config.model.intermediate_size = 1024
  # Size of the learned position table.
  config.model.max_position_embeddings = 128
  # No dropout on attention probabilities: short runs do not overfit, and the
  # fused attention kernel is faster.
  config.model.attention_dropout_rate = 0.0
  # Rows per step.
  config.train.batch_size = 32
  # Total optimiser steps.
  config.train.num_steps = 2000
  # Small models take a larger peak learning rate.
  config.train.learning_rate = 1e-3
  # Linear warm-up steps.
  config.train.warmup_steps = 200
  # Log every this many steps.
  config.train.log_every = 50
  # Evaluate every this many steps.
  config.train.eval_every = 500
  # Checkpoint every this many steps.
  config.train.checkpoint_every = 500
  # Rows per evaluation batch.
  config.eval.batch_size = 64
  return config
