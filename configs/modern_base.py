"""ModernBERT-base (Warner et al., 2024): L=22, d=768, 12 heads, GeGLU d_ff=1152, rotary positions.

The shape of answerdotai/ModernBERT-base (and of transformers' ModernBertConfig
defaults): layers 0, 3, 6, ... attend to the whole row with rotary base
160 000, the others to the tokens at most 64 positions away (a 128-token
window) with base 10 000; no biases, LayerNorm epsilon 1e-5, no dropout, a
50 368-token vocabulary and rows of up to 8192 tokens. Exports load as
transformers' ModernBertForMaskedLM.

The training recipe is base.py's (AdamW, linear warm-up and decay, T=128,
15% masking) with ModernBERT's Adam beta2 of 0.98. ModernBERT itself was
trained with StableAdamW, a trapezoidal schedule, 30% masking and rows of
1024 then 8192 tokens, which this config does not reproduce.
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  # Tokenizer vocabulary of ModernBERT (special tokens included).
  config.tokenizer.vocab_size = 50368
  # The ModernBERT encoder (model/modern.py).
  config.model.variant = 'modern'
  # Number of transformer blocks (L).
  config.model.num_layers = 22
  # Model width (d).
  config.model.hidden_size = 768
  # Attention heads (head size 64).
  config.model.num_heads = 12
  # GeGLU width (d_ff): Wi projects to 2 x d_ff (input and gate).
  config.model.intermediate_size = 1152
  # Longest row (rotary positions: no table to size).
  config.model.max_position_embeddings = 8192
  # No dropout anywhere, as ModernBERT.
  config.model.dropout_rate = 0.0
  # No dropout on attention probabilities or output (also allows the fused kernels).
  config.model.attention_dropout_rate = 0.0
  # LayerNorm epsilon of ModernBERT.
  config.model.layer_norm_eps = 1e-5
  # Layers 0, 3, 6, ... attend globally.
  config.model.global_attn_every_n_layers = 3
  # Local layers see 64 tokens on each side.
  config.model.local_attention = 128
  # Rotary base of the global layers.
  config.model.global_rope_theta = 160_000.0
  # Rotary base of the local layers.
  config.model.local_rope_theta = 10_000.0
  # Adam beta2 of ModernBERT's (and MosaicBERT's) pretraining.
  config.train.adam_b2 = 0.98
  return config
