"""configs/tiny.py with the ModernBERT encoder: a CPU quick start for variant 'modern'.

Same data, tokenizer, depth, width, heads, batch and schedule as tiny.py, so
the two variants can be compared run for run; its optimiser settings were
measured for the BERT variant, not tuned for this one. With T=128 the local
layers (1 and 2 of 4) see 64 tokens on each side.
"""

import ml_collections

from configs import tiny


def get_config() -> ml_collections.ConfigDict:
  config = tiny.get_config()
  # The ModernBERT encoder (model/modern.py).
  config.model.variant = 'modern'
  # GeGLU width: 2/3 of tiny's d_ff=512, so that its three matrices hold as
  # many parameters as tiny's two (3 x 128 x 344 ~ 2 x 128 x 512).
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
