"""The encoder's settings: ModelConfig, the allowed values of config.model, their checks.

Shapes: B batch, T sequence length, P masked slots per row, d hidden size,
N heads, H = d / N head size, V padded vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from mlm_jax.errors import one_of
from mlm_jax.errors import require
# Attention kernel names (config.model.attention) and the kernels' limits: the attention
# package's choice module, where the kernel of each call is picked.
from mlm_jax.model.attention.choice import ATTENTIONS
from mlm_jax.model.attention.choice import NO_DROPOUT_ATTENTIONS
from mlm_jax.model.attention.choice import RENAMED_ATTENTIONS
from mlm_jax.model.attention.choice import current_name as current_attention_name

Array = jax.Array

DTYPES = ('auto', 'float32', 'bfloat16')       # 'auto': float32 on CPU, bfloat16 elsewhere.
REMATS = ('none', 'dots', 'full')              # What a block keeps for the backward pass.
# Encoders: 'bert' the post-LN BERT of bert.py (BertForMaskedLM); 'roberta' the
# same encoder in RoBERTa's Hugging Face layout (RobertaForMaskedLM: one token
# type, positions offset past its pad id on export); 'modern' the ModernBERT
# encoder of modern.py (ModernBertForMaskedLM). Every variant but 'modern' is
# the BERT encoder.
VARIANTS = ('bert', 'roberta', 'modern')
# What ModelConfig.platform may be: JAX's names of the platforms a step compiles for.
PLATFORMS = ('cpu', 'gpu', 'tpu')



@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # Rows the model predicts over: the tokenizer's ids, or a checkpoint's table
  # (config.model.vocab_size), which may be larger (ModernBERT's is).
  vocab_size: int
  padded_vocab_size: int     # Embedding rows: vocab_size rounded up to 128.
  # The fields of config.model (configs/base.py documents and sets them all).
  num_layers: int
  hidden_size: int
  num_heads: int
  intermediate_size: int
  max_position_embeddings: int
  type_vocab_size: int       # 0: no token-type table (DistilBERT); segment ids are then unread.
  dropout_rate: float
  attention_dropout_rate: float
  initializer_range: float
  layer_norm_eps: float
  attention: str             # ATTENTIONS; attention.choose picks per call.
  scan_layers: bool          # One nn.scan over the blocks (params stacked).
  remat: str                 # REMATS: what a block keeps for the backward pass.
  drop_token_rate: float     # Training only: unmasked tokens dropped from the input.
  variant: str               # VARIANTS: which encoder (and MLM head) the model is.
  # The 'modern' variant only (rotary positions, local and global attention).
  global_attn_every_n_layers: int  # Layers 0, n, 2n, ... attend globally; the rest locally.
  local_attention: int       # A local layer's window: local_attention // 2 tokens each side.
  global_rope_theta: float   # Rotary base of the global layers.
  local_rope_theta: float    # Rotary base of the local layers.
  # Packed documents (the batch's document_ids): attention stays within each
  # document; positions restart at each document's first token.
  document_mask: bool
  restart_positions: bool
  # Dropout on the attention block's output projection alone (FlexBERT's
  # attn_out_dropout_prob; no Hugging Face config has it).
  attention_output_dropout_rate: float
  # Set by the trainer, not config.model.
  dtype: Any = jnp.float32   # Compute dtype; parameters are always float32.
  sentence_pair_head: bool = False  # Pooler + 2-way classifier on [CLS] (NSP/SOP).
  # The platform the model is compiled for (PLATFORMS): the builder's mesh's
  # devices, never guessed from the host here. It picks the attention kernels
  # ('auto'); the forms of dense, dropout and GELU reach the modules as their
  # `ops` field (runtime/platform_ops.py). Not part of the shape record
  # (config/fields.py): the parameters are the same on every platform.
  platform: str = dataclasses.field(kw_only=True)

  def __post_init__(self):
    require(self.platform in PLATFORMS,
            f'ModelConfig.platform={self.platform!r}: pass the platform the model is compiled '
            f"for, one of {', '.join(map(repr, PLATFORMS))} (a mesh's "
            "devices[0].platform, or jax.default_backend() where it runs here).")

  @classmethod
  def from_config(cls, model: ml_collections.ConfigDict, vocab_size: int, padded_vocab_size: int,
                  dtype: Any, *, platform: str, **overrides) -> 'ModelConfig':
    """From config.model (every field; `overrides` for the ones the trainer sets). A section
    saved by an older run is read with the field table's old values first (config/saved.py).

    `platform`: where the model is compiled for (PLATFORMS), always stated by the caller.
    """
    fields = {f.name for f in dataclasses.fields(cls)} - {
        'vocab_size', 'padded_vocab_size', 'dtype', 'sentence_pair_head', 'platform'}
    given = {k: model[k] for k in fields if k not in overrides}
    if 'attention' in given:   # A run saved before the kernels were renamed.
      given['attention'] = current_attention_name(given['attention'])
    return cls(vocab_size=vocab_size, padded_vocab_size=padded_vocab_size, dtype=dtype,
               platform=platform, **given, **overrides)


def local_platform() -> str:
  """The platform of this process's default devices, for a model applied here.

  What a tool that runs the model in this process passes as ModelConfig.platform
  (export, import, analysis, probes): there, the host is the target. A step
  built for a mesh takes the mesh's devices' platform instead (training/build.py).
  """
  return jax.default_backend()


def compute_dtype(name: str, platform: str):
  """config.model.dtype as a dtype; 'auto' is float32 on a CPU and bfloat16 on GPUs and TPUs.

  `platform` is where the step runs (PLATFORMS): the mesh's, not the host's.
  """
  if name == 'auto':
    return jnp.float32 if platform == 'cpu' else jnp.bfloat16
  return jnp.dtype(name)


def check_config(model: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.model field (see configs/base.py)."""
  for name in ('num_layers', 'hidden_size', 'num_heads', 'intermediate_size'):
    require(model[name] > 0, f'config.model.{name}={model[name]} must be positive.')
  require(model.get('vocab_size', 0) >= 0,
          f"config.model.vocab_size={model.get('vocab_size')} must be 0 (the tokenizer's) or "
          'the number of embedding rows.')
  require(model.hidden_size % model.num_heads == 0,
          f'config.model.hidden_size={model.hidden_size} is not divisible by '
          f'config.model.num_heads={model.num_heads}.')
  # 0: no token-type table at all (DistilBERT's layout, which only the BERT encoder
  # exports as); RoBERTa's and ModernBERT's layouts have one table or none to write.
  require(model.type_vocab_size >= 1 or (model.type_vocab_size == 0 and model.variant == 'bert'),
          f'config.model.type_vocab_size={model.type_vocab_size}: must be at least 1, or 0 (no '
          "token types, DistilBERT's layout) with variant='bert'.")
  for name in ('dropout_rate', 'attention_dropout_rate', 'attention_output_dropout_rate'):
    require(0.0 <= model[name] < 1.0, f'config.model.{name}={model[name]} must be in [0, 1).')
  one_of('model', 'dtype', model.dtype, DTYPES)
  require(model.attention not in RENAMED_ATTENTIONS,
          f'config.model.attention={model.attention!r} is now called '
          f'{RENAMED_ATTENTIONS.get(model.attention)!r} (the same kernel): set '
          f'--config.model.attention={RENAMED_ATTENTIONS.get(model.attention)}.')
  one_of('model', 'attention', model.attention, ATTENTIONS)
  require(model.attention not in NO_DROPOUT_ATTENTIONS or model.attention_dropout_rate == 0.0,
          f'config.model.attention={model.attention!r} with config.model.attention_dropout_rate='
          f'{model.attention_dropout_rate}: that kernel has no dropout on the attention '
          "probabilities; set the rate to 0, or attention='auto' (or 'dense') to use ours "
          'when the rate is above 0.')
  one_of('model', 'remat', model.remat, REMATS)
  require(0.0 <= model.drop_token_rate < 1.0,
          f'config.model.drop_token_rate={model.drop_token_rate} must be in [0, 1).')
  one_of('model', 'variant', model.variant, VARIANTS)
  if model.variant == 'modern':
    _check_modern(model)


def _check_modern(model: ml_collections.ConfigDict) -> None:
  """The fields only the 'modern' variant reads, and the options it lacks."""
  require(model.global_attn_every_n_layers >= 1,
          f'config.model.global_attn_every_n_layers={model.global_attn_every_n_layers} must be '
          'at least 1 (1: every layer global).')
  # The window is local_attention // 2 tokens each side: an odd value would
  # silently mean the even one below it.
  require(model.local_attention >= 2 and model.local_attention % 2 == 0,
          f'config.model.local_attention={model.local_attention} must be a positive even '
          'number (the window spans local_attention // 2 tokens on each side).')
  for name in ('global_rope_theta', 'local_rope_theta'):
    require(model[name] > 0, f'config.model.{name}={model[name]} must be positive.')
  head_dim = model.hidden_size // model.num_heads
  require(head_dim % 2 == 0,
          f'config.model.hidden_size / num_heads = {head_dim}: rotary positions rotate pairs '
          'of dimensions, so the head size must be even.')
  require(not model.scan_layers,
          "config.model.scan_layers=True with variant='modern': its layers differ (the first "
          'has no attention norm, local and global layers alternate), so they are not '
          'scanned; set scan_layers=False.')
