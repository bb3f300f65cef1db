"""configs/tiny.py's shape and recipe with the BERT encoder (post-LN, learned positions).

The quick start's data, tokenizer, depth, width, heads, batch and schedule
with variant 'bert': ~10 minutes on 2 cores. Sizes were chosen by measurement
on a 2-core CPU: at this budget a narrow 4-layer model with a small
vocabulary and batch reaches a higher held-out MLM accuracy than wider models
or larger batches that see fewer updates. At this budget BERT learns little
from context (docs/results.md); it is the CPU config for what only the BERT
variant has (`bench --compare=hf`, the sentence-pair heads).
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # Held-out documents: more than base, so eval accuracy is not noisy.
  config.data.val_fraction = 0.05
  # A small vocabulary suits the ~1.6 MB default corpus.
  config.tokenizer.vocab_size = 1000
  # Number of transformer blocks (L).
  config.model.num_layers = 4
  # Model width (d).
  config.model.hidden_size = 128
  # Attention heads (head size 32).
  config.model.num_heads = 4
  # MLP width (d_ff).
  config.model.intermediate_size = 512
  # Size of the learned position table.
  config.model.max_position_embeddings = 128
  # No dropout: a run this short is far from overfitting.
  config.model.dropout_rate = 0.0
  # No dropout on attention probabilities either (it also allows the fused
  # attention kernel).
  config.model.attention_dropout_rate = 0.0
  # Rows per step.
  config.train.batch_size = 16
  # Total optimiser steps.
  config.train.num_steps = 3000
  # Small models take a larger peak learning rate (4e-3 diverged here).
  config.train.learning_rate = 2e-3
  # Linear warm-up steps.
  config.train.warmup_steps = 100
  # Log every this many steps.
  config.train.log_every = 50
  # Evaluate every this many steps.
  config.train.eval_every = 500
  # Checkpoint every this many steps.
  config.train.checkpoint_every = 500
  # Rows per evaluation batch.
  config.eval.batch_size = 64
  return config
