"""The fine-tuned model: the pretrained encoder and a fresh head, laid out as Hugging Face's.

  variant 'bert'    sequence: pooler (dense + tanh on [CLS]), dropout, classifier
                    (BertForSequenceClassification); tokens: dropout, classifier
                    on every position (BertForTokenClassification)
  DistilBERT        (variant 'bert' with type_vocab_size 0) sequence: as 'bert' with
                    ReLU for tanh (pre_classifier, DistilBertForSequenceClassification);
                    tokens: as 'bert' (DistilBertForTokenClassification)
  variant 'roberta' sequence: dropout, then as 'bert' (RobertaClassificationHead:
                    dense + tanh on <s>, dropout, out_proj); tokens: as 'bert'
                    (RobertaForTokenClassification)
  variant 'modern'  sequence: [CLS] -> dense (no bias) + GELU + LayerNorm (no
                    bias), dropout, classifier (ModernBertForSequenceClassification,
                    classifier_pooling='cls'); tokens: the same on every position
                    (ModernBertForTokenClassification)

The classifier has a bias in both. Parameters: encoder/... exactly as the
pretraining model's (so its checkpoint's encoder drops in), head/{pooler |
transform, layer_norm, classifier}. Shapes: see mlm_jax/model/config.py; K
outputs (the labels, or 1 for regression).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mlm_jax import model as model_lib
from mlm_jax.model import bert
from mlm_jax.model import modern
from mlm_jax.model.config import Array
from mlm_jax.model.layers import EMBED
from mlm_jax.model.layers import MLP
from mlm_jax.model.layers import dense_init
from mlm_jax.model.layers import layer_norm
from mlm_jax.model.layers import zeros
from mlm_jax.runtime import platform_ops


def is_distilbert(cfg: model_lib.ModelConfig) -> bool:
  """The encoder DistilBERT's layout holds: BERT's without a token-type table."""
  return cfg.variant == 'bert' and cfg.type_vocab_size == 0


class ClassifierHead(nn.Module):
  """Encoder output -> logits, at [CLS] (per_token False) or at every position."""

  cfg: model_lib.ModelConfig
  num_outputs: int
  per_token: bool
  dropout_rate: float
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, sequence: Array, deterministic: bool) -> Array:
    """sequence [B, T, d] -> logits [B, K] or [B, T, K] (float32)."""
    cfg, ops = self.cfg, self.ops
    x = sequence if self.per_token else sequence[:, 0]
    if cfg.variant == 'modern':
      x = ops.dense(cfg.hidden_size, use_bias=False, dtype=cfg.dtype,
                    kernel_init=dense_init(cfg, (EMBED, MLP), modern.out_std(cfg)),
                    name='transform')(x)
      x = layer_norm(cfg, 'layer_norm', use_bias=False)(ops.gelu(x))
    elif not self.per_token:
      if cfg.variant == 'roberta':
        x = ops.dropout(self.dropout_rate)(x, deterministic=deterministic)
      x = ops.dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=dense_init(cfg, (EMBED, MLP)),
                    bias_init=zeros((MLP,)), name='pooler')(x)
      # DistilBERT's pre_classifier is followed by a ReLU, BERT's pooler by a tanh.
      x = nn.relu(x) if is_distilbert(cfg) else jnp.tanh(x)
    x = ops.dropout(self.dropout_rate)(x, deterministic=deterministic)
    return ops.dense(self.num_outputs, dtype=cfg.dtype,
                     kernel_init=dense_init(cfg, (MLP, None)), bias_init=zeros((None,)),
                     name='classifier')(x).astype(jnp.float32)


class FineTuned(nn.Module):
  """model.apply(params, batch) -> logits [B, K] (sequence tasks) or [B, T, K] (tag)."""

  cfg: model_lib.ModelConfig
  num_outputs: int
  per_token: bool
  classifier_dropout: float
  # The platform's dense, dropout and GELU (the builder's); the library's by default.
  ops: platform_ops.Ops = platform_ops.DEFAULT

  def setup(self):
    encoder = modern.ModernEncoder if self.cfg.variant == 'modern' else bert.Encoder
    self.encoder = encoder(self.cfg, self.ops)
    self.head = ClassifierHead(self.cfg, self.num_outputs, self.per_token,
                               self.classifier_dropout, self.ops)

  def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    """batch: input_ids, segment_ids, attention_mask [B, T] -> logits."""
    sequence = self.encoder(model_lib.EncoderInputs.of(batch), deterministic)
    return self.head(sequence, deterministic)
