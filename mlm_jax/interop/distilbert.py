"""DistilBERT interop: the BERT encoder without token types in `DistilBertForMaskedLM`'s layout.

DistilBERT computes what variant 'bert' computes with config.model.type_vocab_size=0
(model/config.py): word + position embeddings and a LayerNorm, post-LN blocks
(attention, add, LayerNorm; GELU MLP, add, LayerNorm), and BERT's MLM head
(dense, GELU, LayerNorm, tied decoder with a bias). Only the names differ
(d hidden, N heads, H = d / N, F MLP width, V the tokenizer's vocabulary):

  ours                                   Hugging Face
  embeddings/token/embedding [Vp, d]     distilbert.embeddings.word_embeddings.weight [V, d]
  embeddings/position/embedding          distilbert.embeddings.position_embeddings.weight
  embeddings/layer_norm                  distilbert.embeddings.LayerNorm
  layer_i/attention/query,key,value      distilbert.transformer.layer.i.attention.q_lin,k_lin,v_lin
  layer_i/attention/out                  distilbert.transformer.layer.i.attention.out_lin
  layer_i/attention_layer_norm           distilbert.transformer.layer.i.sa_layer_norm
  layer_i/intermediate, output           distilbert.transformer.layer.i.ffn.lin1, lin2
  layer_i/output_layer_norm              distilbert.transformer.layer.i.output_layer_norm
  mlm_head/transform, layer_norm         vocab_transform, vocab_layer_norm
  mlm_head/output_bias [Vp]              vocab_projector.bias [V]

DistilBERT's LayerNorms use eps 1e-12, fixed in its code: a model with
another eps has no DistilBERT form. Sinusoidal position tables
(sinusoidal_pos_embds) are refused on import: ours is learned.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop.layout import Format
from mlm_jax.interop.layout import Tensor
from mlm_jax.interop.layout import dense_tensors
from mlm_jax.interop.layout import layer_norm_tensors
from mlm_jax.interop.layout import special_token_ids

LAYER_NORM_EPS = 1e-12  # transformers' DistilBERT: nn.LayerNorm(dim, eps=1e-12) everywhere.


def layout(cfg: model_lib.ModelConfig, position_offset: int = 0) -> list[Tensor]:
  """Every tensor of DistilBertForMaskedLM, in the state dict's order."""
  del position_offset  # Positions start at row 0.
  d, n, f, v = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
  h = d // n

  layer_norm = functools.partial(layer_norm_tensors, width=d)
  dense = dense_tensors

  emb, p = ('encoder', 'embeddings'), 'distilbert.embeddings'
  positions = cfg.max_position_embeddings
  out = [Tensor(f'{p}.word_embeddings.weight', (*emb, 'token', 'embedding'), (v, d), (v, d)),
         Tensor(f'{p}.position_embeddings.weight', (*emb, 'position', 'embedding'),
                (positions, d), (positions, d)),
         *layer_norm(f'{p}.LayerNorm', (*emb, 'layer_norm'))]
  for i in range(cfg.num_layers):
    hf, ours = f'distilbert.transformer.layer.{i}', ('encoder', f'layer_{i}')
    for hf_name, name in (('q_lin', 'query'), ('k_lin', 'key'), ('v_lin', 'value')):
      out += dense(f'{hf}.attention.{hf_name}', (*ours, 'attention', name), (d,), (n, h))
    out += dense(f'{hf}.attention.out_lin', (*ours, 'attention', 'out'), (n, h), (d,))
    out += layer_norm(f'{hf}.sa_layer_norm', (*ours, 'attention_layer_norm'))
    out += dense(f'{hf}.ffn.lin1', (*ours, 'intermediate'), (d,), (f,))
    out += dense(f'{hf}.ffn.lin2', (*ours, 'output'), (f,), (d,))
    out += layer_norm(f'{hf}.output_layer_norm', (*ours, 'output_layer_norm'))
  out += dense('vocab_transform', ('mlm_head', 'transform'), (d,), (d,))
  out += layer_norm('vocab_layer_norm', ('mlm_head', 'layer_norm'))
  out += [Tensor('vocab_projector.bias', ('mlm_head', 'output_bias'), (v,), (v,))]
  return out


def canonical_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """DistilBertForMaskedLM names; DistilBertModel's lack 'distilbert.' (and the head)."""
  if 'embeddings.word_embeddings.weight' not in tensors:
    return tensors
  return {f'distilbert.{k}' if k.startswith(('embeddings.', 'transformer.')) else k: x
          for k, x in tensors.items()}


def to_hf_config(cfg: model_lib.ModelConfig, specials: tok_lib.Specials) -> dict[str, Any]:
  """Our model shape -> a `DistilBertConfig` dict; ValueError where DistilBERT cannot hold it."""
  if cfg.type_vocab_size != 0 or cfg.variant != 'bert':
    raise ValueError(f'DistilBERT has no token types: only variant bert with type_vocab_size=0 '
                     f'exports as DistilBertForMaskedLM, not {cfg.variant} with '
                     f'{cfg.type_vocab_size}.')
  if cfg.layer_norm_eps != LAYER_NORM_EPS:
    raise ValueError(f'config.model.layer_norm_eps={cfg.layer_norm_eps}: DistilBertForMaskedLM '
                     f'fixes it at {LAYER_NORM_EPS}, so this model has no DistilBERT form.')
  return {
      'architectures': [FORMAT.architecture],
      'model_type': FORMAT.model_type,
      'vocab_size': cfg.vocab_size,
      'dim': cfg.hidden_size,
      'n_layers': cfg.num_layers,
      'n_heads': cfg.num_heads,
      'hidden_dim': cfg.intermediate_size,
      'activation': 'gelu',  # The exact erf GELU, as ours.
      'dropout': cfg.dropout_rate,
      'attention_dropout': cfg.attention_dropout_rate,
      'max_position_embeddings': cfg.max_position_embeddings,
      'sinusoidal_pos_embds': False,
      'initializer_range': cfg.initializer_range,
      **special_token_ids(specials),
      'tie_word_embeddings': True,
      'dtype': 'float32',
  }


def checkpoint_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """A `DistilBertConfig` dict -> the ModelConfig fields it decides (transformers' defaults
  where it leaves a key out); ValueError for what our encoder does not compute."""
  expected = {'activation': 'gelu', 'sinusoidal_pos_embds': False, 'tie_word_embeddings': True}
  for key, allowed in expected.items():
    if hf.get(key, allowed) != allowed:
      raise ValueError(f'DistilBERT config {key}={hf[key]!r} is not supported (only {allowed!r}).')
  return {
      'variant': 'bert',
      'vocab_size': hf['vocab_size'],
      'num_layers': hf.get('n_layers', 6),
      'hidden_size': hf.get('dim', 768),
      'num_heads': hf.get('n_heads', 12),
      'intermediate_size': hf.get('hidden_dim', 3072),
      'max_position_embeddings': hf.get('max_position_embeddings', 512),
      'type_vocab_size': 0,
      'dropout_rate': hf.get('dropout', 0.1),
      'attention_dropout_rate': hf.get('attention_dropout', 0.1),
      'initializer_range': hf.get('initializer_range', 0.02),
      'layer_norm_eps': LAYER_NORM_EPS,
  }


FORMAT = Format(
    name='DistilBERT', variant='bert', model_type='distilbert',
    architecture='DistilBertForMaskedLM', base_model='DistilBertModel', layout=layout,
    canonical_names=canonical_names, head_tensor='vocab_transform.weight',
    embedding_tensor='distilbert.embeddings.word_embeddings.weight',
    decoder_tensor='vocab_projector.weight', to_config=to_hf_config, fields=checkpoint_fields,
    input_names=('input_ids', 'attention_mask'))
