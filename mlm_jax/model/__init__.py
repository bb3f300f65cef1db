"""Flax Linen encoders and the MLM head: pure functions of (params, batch); logical axis
names, no configs files or data.

  config.py   ModelConfig, the allowed values of config.model and their checks
  layers.py   initialisers, LayerNorm, GELU, the attention kernels, BERT's self-attention
  heads.py    the MLM head (gathered masked slots, tied embedding) and NSP/SOP
  bert.py     the post-LN BERT encoder and BertForMLM
  modern.py   the ModernBERT encoder and ModernBertForMLM (same calls and outputs)
"""

from mlm_jax.model.bert import BertForMLM
from mlm_jax.model.bert import drop_tokens
from mlm_jax.model.bert import stack_layers
from mlm_jax.model.bert import unstack_layers
from mlm_jax.model.config import STRUCTURE_DEFAULTS
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.config import compute_dtype
from mlm_jax.model.config import describe_attention
from mlm_jax.model.config import resolve_attention
from mlm_jax.model.layers import gelu
from mlm_jax.model.layers import softmax_attention
from mlm_jax.model.layers import uses_cudnn_attention
from mlm_jax.model.modern import ModernBertForMLM


def mlm_model(cfg: ModelConfig) -> BertForMLM:
  """The model of cfg.variant: ModernBertForMLM ('modern') or BertForMLM (the others)."""
  return ModernBertForMLM(cfg) if cfg.variant == 'modern' else BertForMLM(cfg)


__all__ = ['BertForMLM', 'ModelConfig', 'ModernBertForMLM', 'STRUCTURE_DEFAULTS', 'compute_dtype',
           'describe_attention', 'drop_tokens', 'gelu', 'mlm_model', 'resolve_attention',
           'softmax_attention', 'stack_layers', 'unstack_layers', 'uses_cudnn_attention']
