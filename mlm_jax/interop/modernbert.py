"""ModernBERT interop: variant 'modern' in transformers' `ModernBertForMaskedLM` layout.

Shapes: d hidden, N heads, H = d / N, F MLP width, V the tokenizer's
vocabulary, Vp our padded vocabulary.

  ours                                   Hugging Face
  encoder/embeddings/token/embedding     model.embeddings.tok_embeddings.weight [V, d]
  encoder/embeddings/layer_norm/scale    model.embeddings.norm.weight
  layer_i/attention_norm/scale (i > 0)   model.layers.i.attn_norm.weight
  layer_i/attention/qkv/kernel [d,3,N,H] model.layers.i.attn.Wqkv.weight [3*N*H, d]
  layer_i/attention/out/kernel [N,H,d]   model.layers.i.attn.Wo.weight [d, N*H]
  layer_i/mlp_norm/scale                 model.layers.i.mlp_norm.weight
  layer_i/mlp/wi/kernel [d, 2F]          model.layers.i.mlp.Wi.weight [2F, d]
  layer_i/mlp/wo/kernel [F, d]           model.layers.i.mlp.Wo.weight [d, F]
  encoder/final_norm/scale               model.final_norm.weight
  mlm_head/transform/kernel [d, d]       head.dense.weight
  mlm_head/layer_norm/scale              head.norm.weight
  mlm_head/output_bias [Vp]              decoder.bias [V]

Nothing has a bias but the decoder, whose weight is tied to the token
embedding (transformers 5 writes no decoder.weight). The config is written
both ways transformers has spelled it: global_attn_every_n_layers and
global/local_rope_theta (transformers 4) and layer_types and rope_parameters
(transformers 5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop.layout import Format
from mlm_jax.interop.layout import Tensor
from mlm_jax.interop.layout import special_token_ids
from mlm_jax.model import modern

_FULL, _SLIDING = 'full_attention', 'sliding_attention'
# What transformers assumes where a config leaves these out.
_DEFAULT_EVERY_N, _DEFAULT_THETAS = 3, (160_000.0, 10_000.0)


def layout(cfg: model_lib.ModelConfig, position_offset: int = 0) -> list[Tensor]:
  """Every tensor of ModernBertForMaskedLM, in the state dict's order (no position table)."""
  del position_offset  # Rotary positions: no table to offset.
  d, n, f, v = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
  h = d // n

  def norm(hf_name, path):
    return Tensor(f'{hf_name}.weight', (*path, 'scale'), (d,), (d,))

  def dense(hf_name, path, in_shape, out_shape):
    hf_shape = (math.prod(out_shape), math.prod(in_shape))
    return Tensor(f'{hf_name}.weight', (*path, 'kernel'), hf_shape, (*in_shape, *out_shape),
                  transpose=True)

  emb = ('encoder', 'embeddings')
  out = [Tensor('model.embeddings.tok_embeddings.weight', (*emb, 'token', 'embedding'), (v, d),
                (v, d)),
         norm('model.embeddings.norm', (*emb, 'layer_norm'))]
  for i in range(cfg.num_layers):
    hf, ours = f'model.layers.{i}', ('encoder', f'layer_{i}')
    if i > 0:  # Layer 0 has no attention norm (Identity in Hugging Face).
      out.append(norm(f'{hf}.attn_norm', (*ours, 'attention_norm')))
    out += [dense(f'{hf}.attn.Wqkv', (*ours, 'attention', 'qkv'), (d,), (3, n, h)),
            dense(f'{hf}.attn.Wo', (*ours, 'attention', 'out'), (n, h), (d,)),
            norm(f'{hf}.mlp_norm', (*ours, 'mlp_norm')),
            dense(f'{hf}.mlp.Wi', (*ours, 'mlp', 'wi'), (d,), (2 * f,)),
            dense(f'{hf}.mlp.Wo', (*ours, 'mlp', 'wo'), (f,), (d,))]
  out += [norm('model.final_norm', ('encoder', 'final_norm')),
          dense('head.dense', ('mlm_head', 'transform'), (d,), (d,)),
          norm('head.norm', ('mlm_head', 'layer_norm')),
          Tensor('decoder.bias', ('mlm_head', 'output_bias'), (v,), (v,))]
  return out


def canonical_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """ModernBertForMaskedLM names; ModernBertModel's lack 'model.' (and have no head)."""
  if 'embeddings.tok_embeddings.weight' not in tensors:
    return tensors
  return {name if name.startswith(('head.', 'decoder.')) else f'model.{name}': x
          for name, x in tensors.items()}


def to_hf_config(cfg: model_lib.ModelConfig, specials: tok_lib.Specials) -> dict[str, Any]:
  """Our model shape -> a `ModernBertConfig` dict for `config.json`, with `specials`' ids."""
  layer_types = [_FULL if modern.is_global(cfg, i) else _SLIDING for i in range(cfg.num_layers)]
  return {
      'architectures': ['ModernBertForMaskedLM'],
      'model_type': 'modernbert',
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.hidden_size,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'intermediate_size': cfg.intermediate_size,
      'max_position_embeddings': cfg.max_position_embeddings,
      'hidden_activation': 'gelu',       # transformers' 'gelu' is the exact erf GELU, as ours.
      'classifier_activation': 'gelu',
      'norm_eps': cfg.layer_norm_eps,
      'norm_bias': False, 'attention_bias': False, 'mlp_bias': False, 'classifier_bias': False,
      'decoder_bias': True,
      'embedding_dropout': cfg.dropout_rate,
      'mlp_dropout': cfg.dropout_rate,
      'attention_dropout': cfg.attention_dropout_rate,
      'initializer_range': cfg.initializer_range,
      'local_attention': cfg.local_attention,
      # transformers 4 reads these three ...
      'global_attn_every_n_layers': cfg.global_attn_every_n_layers,
      'global_rope_theta': cfg.global_rope_theta,
      'local_rope_theta': cfg.local_rope_theta,
      # ... and transformers 5 these two (the same facts).
      'layer_types': layer_types,
      'rope_parameters': {
          _FULL: {'rope_type': 'default', 'rope_theta': cfg.global_rope_theta},
          _SLIDING: {'rope_type': 'default', 'rope_theta': cfg.local_rope_theta}},
      **special_token_ids(specials),
      'tie_word_embeddings': True,
      'dtype': 'float32',
  }


def _every_n_layers(hf: dict[str, Any]) -> int:
  """global_attn_every_n_layers of a config: written out, or read off its layer_types."""
  types = hf.get('layer_types')
  if not types:
    return hf.get('global_attn_every_n_layers', _DEFAULT_EVERY_N)
  globals_ = [i for i, t in enumerate(types) if t == _FULL]
  every_n = globals_[1] if len(globals_) > 1 else len(types)
  if types != [_FULL if i % every_n == 0 else _SLIDING for i in range(len(types))]:
    raise ValueError(f'ModernBERT config layer_types={types} is not supported (only every n-th '
                     'layer global, starting with layer 0).')
  return every_n


def _rope_thetas(hf: dict[str, Any]) -> tuple[float, float]:
  """(global, local) rotary bases: rope_parameters (transformers 5) or the older keys."""
  params = hf.get('rope_parameters')
  if params:
    for kind in (_FULL, _SLIDING):
      if params[kind].get('rope_type', 'default') != 'default':
        raise ValueError(f'ModernBERT config rope_parameters[{kind!r}] = {params[kind]} is not '
                         "supported (only rope_type 'default').")
    return float(params[_FULL]['rope_theta']), float(params[_SLIDING]['rope_theta'])
  if hf.get('rope_scaling'):
    raise ValueError(f"ModernBERT config rope_scaling={hf['rope_scaling']} is not supported.")
  global_theta = hf.get('global_rope_theta', _DEFAULT_THETAS[0])
  local_theta = hf.get('local_rope_theta', _DEFAULT_THETAS[1])
  # transformers 4: local layers without their own theta use the global one.
  return float(global_theta), float(global_theta if local_theta is None else local_theta)


def checkpoint_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """A `ModernBertConfig` dict -> the ModelConfig fields it decides (transformers' defaults
  where it leaves a key out); ValueError for what our encoder does not compute."""
  expected = {'hidden_activation': 'gelu', 'classifier_activation': 'gelu', 'norm_bias': False,
              'attention_bias': False, 'mlp_bias': False, 'classifier_bias': False,
              'decoder_bias': True, 'tie_word_embeddings': True}
  for key, allowed in expected.items():
    if hf.get(key, allowed) != allowed:
      raise ValueError(f'ModernBERT config {key}={hf[key]!r} is not supported (only {allowed!r}).')
  dropout = hf.get('mlp_dropout', 0.0)
  if hf.get('embedding_dropout', 0.0) != dropout:
    raise ValueError(f"ModernBERT config embedding_dropout={hf['embedding_dropout']} differs from "
                     f'mlp_dropout={dropout}; config.model.dropout_rate is both.')
  global_theta, local_theta = _rope_thetas(hf)
  return {
      'variant': 'modern',
      'vocab_size': hf['vocab_size'],
      'num_layers': hf['num_hidden_layers'],
      'hidden_size': hf['hidden_size'],
      'num_heads': hf['num_attention_heads'],
      'intermediate_size': hf['intermediate_size'],
      'max_position_embeddings': hf.get('max_position_embeddings', 8192),
      'dropout_rate': dropout,
      'attention_dropout_rate': hf.get('attention_dropout', 0.0),
      'initializer_range': hf.get('initializer_range', 0.02),
      'layer_norm_eps': hf.get('norm_eps', 1e-5),
      'global_attn_every_n_layers': _every_n_layers(hf),
      'local_attention': hf.get('local_attention', 128),
      'global_rope_theta': global_theta,
      'local_rope_theta': local_theta,
  }


FORMAT = Format(
    name='ModernBERT', variant='modern', model_type='modernbert',
    architecture='ModernBertForMaskedLM', base_model='ModernBertModel', layout=layout,
    canonical_names=canonical_names, head_tensor='head.dense.weight',
    embedding_tensor='model.embeddings.tok_embeddings.weight', decoder_tensor='decoder.weight',
    to_config=to_hf_config, fields=checkpoint_fields,
    input_names=('input_ids', 'attention_mask'))
