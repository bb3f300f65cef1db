"""BERT-large: BERT-base with L=24, d=1024, 16 heads, d_ff=4096."""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # Number of transformer blocks (L).
  config.model.num_layers = 24
  # Model width (d).
  config.model.hidden_size = 1024
  # Attention heads.
  config.model.num_heads = 16
  # MLP width (d_ff).
  config.model.intermediate_size = 4096
  return config
