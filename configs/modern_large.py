"""ModernBERT-large: ModernBERT-base with L=28, d=1024, 16 heads, GeGLU d_ff=2624.

The shape of answerdotai/ModernBERT-large; attention pattern, rotary bases,
vocabulary and training recipe as configs/modern_base.py.
"""

import ml_collections

from configs import modern_base


def get_config() -> ml_collections.ConfigDict:
  config = modern_base.get_config()
  # Number of transformer blocks (L).
  config.model.num_layers = 28
  # Model width (d).
  config.model.hidden_size = 1024
  # Attention heads (head size 64).
  config.model.num_heads = 16
  # GeGLU width (d_ff).
  config.model.intermediate_size = 2624
  return config
