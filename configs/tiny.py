"""The CPU quick start: a small ModernBERT on the default corpus, ~8 minutes on 2 cores.

The same data, tokenizer, depth, width, heads, batch and schedule as
bert_tiny.py, so the two variants compare run for run. Chosen by measurement
(docs/results.md): at this budget the ModernBERT block (pre-LN, GeGLU, rotary
positions) learns from context, and the post-LN BERT block hardly does. With
T=128 the local layers (1 and 2 of 4) see 64 tokens on each side.
"""

import ml_collections

from configs import bert_tiny


def get_config() -> ml_collections.ConfigDict:
  config = bert_tiny.get_config()
  # The ModernBERT encoder (model/modern.py).
  config.model.variant = 'modern'
  # GeGLU width: 2/3 of bert_tiny's d_ff=512, so that its three matrices hold
  # as many parameters as bert_tiny's two (3 x 128 x 344 ~ 2 x 128 x 512).
  config.model.intermediate_size = 344
  # LayerNorm epsilon of ModernBERT.
  config.model.layer_norm_eps = 1e-5
  # Layers 0 and 3 attend globally, 1 and 2 locally.
  config.model.global_attn_every_n_layers = 3
  # Local layers see 64 tokens on each side.
  config.model.local_attention = 128
  # Adam beta2 of ModernBERT's pretraining.
  config.train.adam_b2 = 0.98
  return config
