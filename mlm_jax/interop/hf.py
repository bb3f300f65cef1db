"""Hugging Face interop: weights, config and tokenizer in `transformers`' layout.

Variant 'bert' converts to and from `BertForMaskedLM` (below), variant
'modern' to and from `ModernBertForMaskedLM` (modernbert.py); each is a
layout.Format, picked by config.model.variant or config.json's model_type.

Our parameter tree and a `BertForMaskedLM` state dict hold the same numbers in
different layouts (shapes: d hidden, N heads, H = d / N, F MLP width, V the
tokenizer's vocabulary, Vp our padded vocabulary):

  ours                                   Hugging Face
  embeddings/token/embedding [Vp, d]     bert.embeddings.word_embeddings.weight [V, d]
  layer_i/attention/query/kernel [d,N,H] bert.encoder.layer.i.attention.self.query.weight [N*H, d]
  layer_i/attention/out/kernel [N,H,d]   bert.encoder.layer.i.attention.output.dense.weight [d, N*H]
  dense kernels [in, out]                torch Linear weights [out, in]
  LayerNorm scale / bias                 LayerNorm weight / bias
  mlm_head/output_bias [Vp]              cls.predictions.bias [V]

The MLM decoder is tied to the word embeddings in both, so a file holds no
`cls.predictions.decoder.*` tensor (what transformers 5 writes too). Exports
drop the padding rows (HF logits then have exactly V columns); imports pad
them back with zeros.

Only numpy is needed to convert; safetensors and tokenizers are imported when
a file is read or written, and torch never is.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import modernbert
from mlm_jax.interop.layout import Format
from mlm_jax.interop.layout import Tensor
from mlm_jax.interop.layout import get_path
from mlm_jax.interop.layout import set_path

Params = dict[str, Any]
INSTALL_HINT = "pip install -e '.[interop]'"
_SAFETENSORS = 'model.safetensors'
SENTENCEPIECE_FILE = 'tokenizer.model'
_SAFETENSORS_INDEX = 'model.safetensors.index.json'


def require(module: str):
  """Imports an optional dependency of the interop extra, or says how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f'{module} is needed for Hugging Face interop: {INSTALL_HINT}') from e


# ------------------------------------------------------------------- config


def to_hf_config(cfg: model_lib.ModelConfig) -> dict[str, Any]:
  """Our model shape -> the `config.json` dict of its variant's Hugging Face model."""
  return _format(cfg).to_config(cfg)


def _to_bert_config(cfg: model_lib.ModelConfig) -> dict[str, Any]:
  """Our model shape -> a `BertConfig` dict for `config.json`."""
  return {
      'architectures': ['BertForMaskedLM'],
      'model_type': 'bert',
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.hidden_size,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'intermediate_size': cfg.intermediate_size,
      'hidden_act': 'gelu',  # transformers' 'gelu' is the exact erf GELU, as ours.
      'hidden_dropout_prob': cfg.dropout_rate,
      'attention_probs_dropout_prob': cfg.attention_dropout_rate,
      'max_position_embeddings': cfg.max_position_embeddings,
      'type_vocab_size': cfg.type_vocab_size,
      'initializer_range': cfg.initializer_range,
      'layer_norm_eps': cfg.layer_norm_eps,
      'pad_token_id': tok_lib.PAD_ID,
      'tie_word_embeddings': True,
      'dtype': 'float32',
  }


def from_hf_config(hf: dict[str, Any], model: ml_collections.ConfigDict,
                   dtype: Any = jnp.float32) -> model_lib.ModelConfig:
  """A config.json dict (BERT or ModernBERT, by its model_type) -> our ModelConfig."""
  model_type = hf.get('model_type', 'bert')
  formats = {f.model_type: f for f in FORMATS.values()}
  if model_type not in formats:
    raise ValueError(f'config.json model_type={model_type!r} is not supported (only '
                     f'{" or ".join(repr(t) for t in formats)}).')
  return formats[model_type].from_config(hf, model, dtype)


def _from_bert_config(hf: dict[str, Any], model: ml_collections.ConfigDict,
                      dtype: Any = jnp.float32) -> model_lib.ModelConfig:
  """A `BertConfig` dict -> our ModelConfig; refuses what our encoder does not compute.

  The shape and the numbers of the saved model come from `hf` (Hugging
  Face's own defaults where it leaves a key out); how we run it (attention
  kernel, scan, remat, DropToken) from `model`, a config.model section.
  """
  unsupported = {
      'hidden_act': (hf.get('hidden_act', 'gelu'), ('gelu',)),
      'position_embedding_type': (hf.get('position_embedding_type', 'absolute'), ('absolute',)),
      'is_decoder': (hf.get('is_decoder', False), (False,)),
      'tie_word_embeddings': (hf.get('tie_word_embeddings', True), (True,)),
  }
  for key, (value, allowed) in unsupported.items():
    if value not in allowed:
      raise ValueError(f'BERT config {key}={value!r} is not supported (only {allowed[0]!r}).')
  return model_lib.ModelConfig(
      vocab_size=hf['vocab_size'],
      padded_vocab_size=tok_lib.padded_vocab_size(hf['vocab_size']),
      attention=model.attention, scan_layers=model.scan_layers, remat=model.remat,
      drop_token_rate=model.drop_token_rate,
      num_layers=hf['num_hidden_layers'],
      hidden_size=hf['hidden_size'],
      num_heads=hf['num_attention_heads'],
      intermediate_size=hf['intermediate_size'],
      max_position_embeddings=hf['max_position_embeddings'],
      type_vocab_size=hf.get('type_vocab_size', 2),
      dropout_rate=hf.get('hidden_dropout_prob', 0.1),
      attention_dropout_rate=hf.get('attention_probs_dropout_prob', 0.1),
      initializer_range=hf.get('initializer_range', 0.02),
      layer_norm_eps=hf.get('layer_norm_eps', 1e-12),
      variant='bert', global_attn_every_n_layers=model.global_attn_every_n_layers,
      local_attention=model.local_attention, global_rope_theta=model.global_rope_theta,
      local_rope_theta=model.local_rope_theta,  # Unused by this variant.
      dtype=dtype)


def load_hf_config(hf_dir: str, model: ml_collections.ConfigDict,
                   dtype: Any = jnp.float32) -> model_lib.ModelConfig:
  with open(os.path.join(hf_dir, 'config.json')) as f:
    return from_hf_config(json.load(f), model, dtype)


# ------------------------------------------------------------------ weights


_VOCAB_PATHS = (('encoder', 'embeddings', 'token', 'embedding'), ('mlm_head', 'output_bias'))


def _bert_layout(cfg: model_lib.ModelConfig) -> list[Tensor]:
  """Every tensor of BertForMaskedLM, in the state dict's order."""
  d, n, f, v = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
  h = d // n

  def plain(hf_name, path, shape):
    return [Tensor(hf_name, path, shape, shape)]

  def layer_norm(hf_name, path):
    return [Tensor(f'{hf_name}.weight', (*path, 'scale'), (d,), (d,)),
            Tensor(f'{hf_name}.bias', (*path, 'bias'), (d,), (d,))]

  def dense(hf_name, path, in_shape, out_shape):
    fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
    return [Tensor(f'{hf_name}.weight', (*path, 'kernel'), (fan_out, fan_in),
                   (*in_shape, *out_shape), transpose=True),
            Tensor(f'{hf_name}.bias', (*path, 'bias'), (fan_out,), out_shape)]

  emb = ('encoder', 'embeddings')
  out = [*plain('bert.embeddings.word_embeddings.weight', (*emb, 'token', 'embedding'), (v, d)),
         *plain('bert.embeddings.position_embeddings.weight', (*emb, 'position', 'embedding'),
                (cfg.max_position_embeddings, d)),
         *plain('bert.embeddings.token_type_embeddings.weight', (*emb, 'segment', 'embedding'),
                (cfg.type_vocab_size, d)),
         *layer_norm('bert.embeddings.LayerNorm', (*emb, 'layer_norm'))]
  for i in range(cfg.num_layers):
    hf, ours = f'bert.encoder.layer.{i}', ('encoder', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      out += dense(f'{hf}.attention.self.{name}', (*ours, 'attention', name), (d,), (n, h))
    out += dense(f'{hf}.attention.output.dense', (*ours, 'attention', 'out'), (n, h), (d,))
    out += layer_norm(f'{hf}.attention.output.LayerNorm', (*ours, 'attention_layer_norm'))
    out += dense(f'{hf}.intermediate.dense', (*ours, 'intermediate'), (d,), (f,))
    out += dense(f'{hf}.output.dense', (*ours, 'output'), (f,), (d,))
    out += layer_norm(f'{hf}.output.LayerNorm', (*ours, 'output_layer_norm'))
  out += dense('cls.predictions.transform.dense', ('mlm_head', 'transform'), (d,), (d,))
  out += layer_norm('cls.predictions.transform.LayerNorm', ('mlm_head', 'layer_norm'))
  out += plain('cls.predictions.bias', ('mlm_head', 'output_bias'), (v,))
  return out


def to_hf_state_dict(params: Params, cfg: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Our params -> BertForMaskedLM (ModernBertForMaskedLM) tensors, float32, padding rows dropped.

  A sentence-pair head (NSP/SOP) has no place in either and is left out.
  """
  if cfg.scan_layers:
    params = model_lib.unstack_layers(params, cfg.num_layers)
  out = {}
  for t in _format(cfg).layout(cfg):
    x = np.asarray(jax.device_get(get_path(params, t.path)), np.float32)
    if t.path in _VOCAB_PATHS:
      x = x[:cfg.vocab_size]
    out[t.hf_name] = t.to_hf(x)
  return out


def from_hf_state_dict(tensors: dict[str, np.ndarray], cfg: model_lib.ModelConfig,
                       fallback_params: Params | None = None, source: str = 'state dict') -> Params:
  """BertForMaskedLM (or BertModel) tensors -> our params, shapes checked against `cfg`.

  ModernBertForMaskedLM (ModernBertModel) tensors for variant 'modern'.
  Base-model weights (BertModel: names without 'bert.'; ModernBertModel:
  without 'model.'; no MLM head) take the MLM head from `fallback_params`.
  """
  fmt = _format(cfg)
  tensors = fmt.canonical_names(tensors)
  has_head = fmt.head_tensor in tensors
  if fallback_params is not None and cfg.scan_layers:
    fallback_params = model_lib.unstack_layers(fallback_params, cfg.num_layers)
  params: Params = {}
  for t in fmt.layout(cfg):
    x = tensors.get(t.hf_name)
    if x is None and t.path[0] == 'mlm_head' and not has_head:
      if fallback_params is None:
        raise ValueError(f'{source} has no MLM head ({t.hf_name}): it holds {fmt.base_model} '
                         'weights. Pass fallback_params to take the head from an initialised '
                         'model.')
      head = jax.device_get(get_path(fallback_params, t.path))
      set_path(params, t.path, np.asarray(head, np.float32))
      continue
    if x is None:
      raise ValueError(f'{source} has no tensor {t.hf_name}: not a {fmt.name} checkpoint of this '
                       'layout.')
    if tuple(x.shape) != t.hf_shape:
      raise ValueError(f'{source}: tensor {t.hf_name} has shape {tuple(x.shape)}, but this model '
                       f'config needs {t.hf_shape}.')
    x = t.from_hf(np.asarray(x))
    if t.path in _VOCAB_PATHS:
      # Padding rows: never predicted, zero as after an export.
      x = np.concatenate([x, np.zeros((cfg.padded_vocab_size - cfg.vocab_size, *x.shape[1:]),
                                      np.float32)])
    set_path(params, t.path, x)
  decoder = tensors.get(fmt.decoder_tensor)
  if decoder is not None and not np.array_equal(decoder, tensors[fmt.embedding_tensor]):
    raise ValueError(f'{source}: {fmt.decoder_tensor} differs from the word embeddings; this '
                     'model ties them and cannot hold both.')
  if cfg.sentence_pair_head:
    if fallback_params is None:
      raise ValueError(f'{source} has no sentence-pair head; pass fallback_params to take it '
                       'from an initialised model.')
    params['sentence_pair'] = jax.device_get(fallback_params['sentence_pair'])
  return model_lib.stack_layers(params, cfg.num_layers) if cfg.scan_layers else params


def _bert_canonical_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """BertForMaskedLM names; BertModel's lack 'bert.', old files say gamma/beta.

  Tensors without a counterpart here (pooler, next-sentence head) are never looked up.
  """
  bare = 'embeddings.word_embeddings.weight' in tensors
  out = {}
  for name, x in tensors.items():
    if bare and not name.startswith('cls.'):
      name = 'bert.' + name
    if name.endswith('.gamma') or name.endswith('.beta'):
      name = name.rsplit('.', 1)[0] + ('.weight' if name.endswith('.gamma') else '.bias')
    out[name] = x
  if 'cls.predictions.bias' not in out and 'cls.predictions.decoder.bias' in out:
    out['cls.predictions.bias'] = out['cls.predictions.decoder.bias']
  return out


BERT = Format(
    name='BERT', variant='bert', model_type='bert', architecture='BertForMaskedLM',
    base_model='BertModel', layout=_bert_layout, canonical_names=_bert_canonical_names,
    head_tensor='cls.predictions.transform.dense.weight',
    embedding_tensor='bert.embeddings.word_embeddings.weight',
    decoder_tensor='cls.predictions.decoder.weight', to_config=_to_bert_config,
    from_config=_from_bert_config, input_names=('input_ids', 'token_type_ids', 'attention_mask'))
# By config.model.variant.
FORMATS = {f.variant: f for f in (BERT, modernbert.FORMAT)}


def _format(cfg: model_lib.ModelConfig) -> Format:
  return FORMATS[cfg.variant]


def read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
  """All tensors of a model directory's safetensors file(s); pickle files are refused."""
  single, index = os.path.join(hf_dir, _SAFETENSORS), os.path.join(hf_dir, _SAFETENSORS_INDEX)
  if not (os.path.exists(single) or os.path.exists(index)):
    pickles = [p for p in ('pytorch_model.bin', 'pytorch_model.bin.index.json')
               if os.path.exists(os.path.join(hf_dir, p))]
    if pickles:
      raise ValueError(
          f'{hf_dir} holds {pickles[0]} but no {_SAFETENSORS}. Pickle files can execute '
          'arbitrary code when they are loaded, so only safetensors are read. Convert it once, '
          'in an environment you trust with that file: python -c "from transformers import '
          f"AutoModelForMaskedLM as M; M.from_pretrained('{hf_dir}').save_pretrained('OUT_DIR')\" "
          '(transformers writes model.safetensors).')
    raise FileNotFoundError(f'{hf_dir} has no {_SAFETENSORS}.')
  numpy_io = require('safetensors.numpy')
  if os.path.exists(single):
    return numpy_io.load_file(single)
  with open(index) as f:
    shards = sorted(set(json.load(f)['weight_map'].values()))
  tensors = {}
  for shard in shards:
    tensors.update(numpy_io.load_file(os.path.join(hf_dir, shard)))
  return tensors


def load_hf_params(hf_dir: str, model_cfg: model_lib.ModelConfig,
                   fallback_params: Params | None = None) -> Params:
  """Reads a Hugging Face BERT or ModernBERT directory (safetensors only) into our params (numpy).

  Its config.json, where there is one, must name the model type of
  `model_cfg.variant`.
  """
  fmt, config_path = _format(model_cfg), os.path.join(hf_dir, 'config.json')
  if os.path.exists(config_path):
    with open(config_path) as f:
      model_type = json.load(f).get('model_type', 'bert')
    if model_type != fmt.model_type:
      raise ValueError(f'{hf_dir} holds a {model_type!r} model, but '
                       f'config.model.variant={model_cfg.variant!r} loads {fmt.model_type!r} '
                       'models only.')
  return from_hf_state_dict(read_safetensors(hf_dir), model_cfg, fallback_params, source=hf_dir)


def init_from_hf(state: Any, hf_dir: str, model_cfg: model_lib.ModelConfig) -> Any:
  """Returns `state` with its params replaced by the BERT (ModernBERT) weights in `hf_dir`.

  Contract (for `config.init.hf_dir`):
  - Call it on a freshly created train state, before any checkpoint is
    restored, and only when the run starts from step 0: a run that resumes
    continues from its own checkpoint, never from `hf_dir` again.
  - `model_cfg` must have the shapes of the weights (vocab_size, layers,
    widths, positions, segments); every mismatching tensor is named in a
    ValueError. The ids must mean the same tokens as the run's tokenizer:
    use a directory exported by `mlm_jax.export` from a run on the same data
    dir. This is not checked.
  - BertModel (ModernBertModel) weights, without an MLM head, keep the head of
    `state.params`.
  - The optimizer state is left as created (zero moments, step 0); new
    params are placed on the shardings of the params they replace.
  - Raises FileNotFoundError/ValueError for a missing or pickle-only
    directory, ImportError naming the `interop` extra without safetensors.
  """
  params = load_hf_params(hf_dir, model_cfg, fallback_params=state.params)
  params = jax.tree_util.tree_map(
      lambda old, new: jax.device_put(new.astype(old.dtype), old.sharding), state.params, params)
  return state.replace(params=params)


def save_model(out_dir: str, params: Params, cfg: model_lib.ModelConfig) -> None:
  """Writes config.json and model.safetensors that `AutoModelForMaskedLM.from_pretrained` loads.

  As a BertForMaskedLM or a ModernBertForMaskedLM, by cfg.variant.
  """
  numpy_io = require('safetensors.numpy')
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(to_hf_config(cfg), f, indent=2)
  # transformers refuses safetensors files without format metadata.
  numpy_io.save_file(to_hf_state_dict(params, cfg), os.path.join(out_dir, _SAFETENSORS),
                     metadata={'format': 'pt'})


# ---------------------------------------------------------------- tokenizer


def hf_tokenizer(tokenizer: tok_lib.Tokenizer):
  """Our sentencepiece unigram model as a `tokenizers.Tokenizer` giving the same ids.

  Sentencepiece normalises the whole text (charsmap, then whitespace: strip,
  collapse runs, a leading '▁', spaces as '▁') and runs one Viterbi over it in
  which [CLS]/[SEP]/[MASK] (user-defined symbols) score -0.1 and control,
  unknown and byte pieces are not matched at all. The same here: everything
  is in the normalizer, there is no pre-tokenizer, and unmatchable pieces
  score so low that no path takes them. Special tokens must therefore not be
  split out before normalisation: the transformers side sets
  `split_special_tokens`, and the Viterbi finds them as sentencepiece does.

  Known differences, all rare: (1) tokenizers applies the charsmap per
  grapheme cluster, sentencepiece by longest match, so a few clusters of a
  base character and combining marks (e.g. halfwidth katakana + voiced mark,
  conjoining Hangul jamo) normalise differently; (2) between segmentations of
  exactly equal score (e.g. '9'+'999' vs '999'+'9' in a run of digits)
  sentencepiece's float32 sums pick one, tokenizers' exact sums the other;
  (3) literal text spelling a control/unknown/byte piece ('[UNK]', '<0x41>')
  that contains a character missing from the vocabulary becomes that piece.
  """
  tk = require('tokenizers')
  spec = tokenizer.spec()
  expected = {'model_type': 'unigram', 'add_dummy_prefix': True, 'remove_extra_whitespaces': True,
              'escape_whitespaces': True, 'treat_whitespace_as_suffix': False}
  for key, value in expected.items():
    if spec[key] != value:
      raise ValueError(f'{tokenizer.model_path}: sentencepiece {key}={spec[key]!r} has no '
                       f'Hugging Face equivalent here (only {value!r}).')
  normal = [score for _, score, kind in spec['pieces'] if kind == 'normal']
  never = min(normal) - 1e6
  user_defined = float(np.float32(-0.1))  # Sentencepiece: length * FLT_MIN - 0.1f.
  vocab = [(piece, score if kind == 'normal' else user_defined if kind == 'user_defined' else never)
           for piece, score, kind in spec['pieces']]
  unk_id = next(i for i, (_, _, kind) in enumerate(spec['pieces']) if kind == 'unknown')
  out = tk.Tokenizer(tk.models.Unigram(vocab, unk_id=unk_id, byte_fallback=spec['byte_fallback']))
  n = tk.normalizers
  # After the charsmap: collapse runs of spaces, strip both ends, then the
  # dummy prefix and '▁' for every space (Prepend leaves an empty text empty).
  steps = [n.Replace(tk.Regex(' {2,}'), ' '), n.Replace(tk.Regex(r'\A | \z'), ''),
           n.Prepend('\u2581'), n.Replace(' ', '\u2581')]
  if spec['precompiled_charsmap']:
    steps.insert(0, n.Precompiled(spec['precompiled_charsmap']))
  out.normalizer = n.Sequence(steps)
  d = tk.decoders
  out.decoder = d.Sequence(
      [d.Replace('\u2581', ' '), d.ByteFallback(), d.Fuse(), d.Strip(' ', 1, 0)])
  cls, sep = tok_lib.SPECIAL_TOKENS[tok_lib.CLS_ID], tok_lib.SPECIAL_TOKENS[tok_lib.SEP_ID]
  out.post_processor = tk.processors.TemplateProcessing(
      single=f'{cls}:0 $A:0 {sep}:0', pair=f'{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1',
      special_tokens=[(cls, tok_lib.CLS_ID), (sep, tok_lib.SEP_ID)])
  out.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                          for t in tok_lib.SPECIAL_TOKENS])
  out.encode_special_tokens = True
  return out


def save_tokenizer(out_dir: str, tokenizer: tok_lib.Tokenizer, model_max_length: int,
                   variant: str = 'bert') -> None:
  """Writes tokenizer.json and tokenizer_config.json for `AutoTokenizer.from_pretrained`.

  `variant`: the model it encodes for (ModernBERT takes no token_type_ids).
  """
  os.makedirs(out_dir, exist_ok=True)
  hf_tokenizer(tokenizer).save(os.path.join(out_dir, 'tokenizer.json'))
  # The sentencepiece model itself: a later run started from this directory
  # (config.init.hf_dir) tokenizes its corpus with exactly this vocabulary.
  with open(os.path.join(out_dir, SENTENCEPIECE_FILE), 'wb') as f:
    f.write(tokenizer.model_proto)
  names = ('pad_token', 'unk_token', 'cls_token', 'sep_token', 'mask_token')
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      **dict(zip(names, tok_lib.SPECIAL_TOKENS)),
      # A literal [MASK] in text is found by the unigram model, as in
      # sentencepiece, not cut out of the text before normalisation.
      'split_special_tokens': True,
      'model_max_length': model_max_length,
      'model_input_names': list(FORMATS[variant].input_names),
      'clean_up_tokenization_spaces': False,
  }
  with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
