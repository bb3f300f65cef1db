"""Flax Linen encoders and the MLM head: pure functions of (params, batch); logical axis
names, no configs files or data.

  config.py   ModelConfig, the allowed values of config.model and their checks
  attention/  the mask description (Mask), the attention kernels, which one each call gets
  layers.py   initialisers, LayerNorm, row gathers, BERT's self-attention
  heads.py    the MLM head (gathered masked slots, tied embedding) and NSP/SOP
  encoder.py  the layer loop both encoders share (remat, scan, output rows)
  bert.py     the post-LN BERT encoder and BertForMLM
  modern.py   the ModernBERT encoder and ModernBertForMLM (same calls and outputs)

Dense layers, dropout and GELU come from the modules' `ops` field, passed
down from the model: the forms runtime/platform_ops.py gives for the platform
the step is compiled for (the builder's), or the library's by default.
Activations keep their batch axis split by the logical axis 'batch'
(layers.batch_split; runtime/sharding.py maps it onto the mesh).
"""

from mlm_jax.model.bert import BertForMLM
from mlm_jax.model.attention import Mask
from mlm_jax.model.attention import check_platform as check_attention_platform
from mlm_jax.model.attention import describe as describe_attention
from mlm_jax.model.attention import softmax_attention
from mlm_jax.model.bert import document_positions
from mlm_jax.model.bert import drop_tokens
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.config import compute_dtype
from mlm_jax.model.config import local_platform
from mlm_jax.model.encoder import EncoderInputs
from mlm_jax.model.encoder import stack_layers
from mlm_jax.model.encoder import unstack_layers
from mlm_jax.model.modern import ModernBertForMLM
from mlm_jax.runtime import platform_ops


def mlm_model(cfg: ModelConfig, ops: platform_ops.Ops = platform_ops.DEFAULT) -> BertForMLM:
  """The model of cfg.variant: ModernBertForMLM ('modern') or BertForMLM (the others).

  `ops`: the platform's dense, dropout and GELU (the builder passes
  platform_ops.for_platform of its mesh's platform); the library's by default.
  """
  return (ModernBertForMLM if cfg.variant == 'modern' else BertForMLM)(cfg, ops)


__all__ = ['BertForMLM', 'EncoderInputs', 'Mask', 'ModelConfig', 'ModernBertForMLM',
           'check_attention_platform', 'compute_dtype', 'describe_attention',
           'document_positions', 'drop_tokens', 'local_platform', 'mlm_model',
           'softmax_attention', 'stack_layers', 'unstack_layers']
