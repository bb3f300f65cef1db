"""Hugging Face interop: weights, config and tokenizer in `transformers`' layout.

Variant 'bert' converts to and from `BertForMaskedLM` (and, with
type_vocab_size 0, `DistilBertForMaskedLM`: distilbert.py) and variant
'roberta' to and from `RobertaForMaskedLM`, `XLMRobertaForMaskedLM` and
`CamembertForMaskedLM` (the same tensors), below; variant 'modern' to and
from `ModernBertForMaskedLM` (modernbert.py). Each is a layout.Format, picked
by config.json's model_type on import. An export writes the Format of the
model and its tokenizer (`export_format`): RoBERTa's three share a variant,
and the tokenizer decides which one transformers must build (AutoTokenizer
picks its class from config.json's model_type), with the special-token ids
of the run's tokenizer.

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

RobertaForMaskedLM has the same tensors under 'roberta.' and 'lm_head.'
(dense, layer_norm, bias), one token type, and a position table whose first
padding_idx + 1 rows (padding_idx = its pad id) no real token reads: imports
drop them, so our table has max_position_embeddings - padding_idx - 1 rows,
and exports write them back as zeros.

The MLM decoder is tied to the word embeddings in all, so a file holds no
decoder weight (what transformers 5 writes too). Exports drop the padding
rows (HF logits then have exactly V columns); imports pad them back with
zeros. V is the model's vocabulary (config.json's vocab_size), which may
exceed its tokenizer's ids (ModernBERT's does).

Only numpy is needed to convert; safetensors is imported when a file is read
or written, torch only to read a pytorch_model.bin (weights_only: no code
runs). Tokenizers go through the tokenizer seam
(data/tokenizer.py; a sentencepiece model's tokenizer.json is made by
data/hf_tokenizer.py, the home of `tokenizers`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import functools
import os
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import hf_tokenizer
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import distilbert
from mlm_jax.interop import modernbert
from mlm_jax.interop.layout import Format
from mlm_jax.interop.layout import Tensor
from mlm_jax.interop.layout import dense_tensors
from mlm_jax.interop.layout import layer_norm_tensors
from mlm_jax.interop.layout import get_path
from mlm_jax.interop.layout import set_path
from mlm_jax.interop.layout import special_token_ids

Params = dict[str, Any]
INSTALL_HINT = "pip install -e '.[interop]'"
_SAFETENSORS = 'model.safetensors'
_SAFETENSORS_INDEX = 'model.safetensors.index.json'
_PYTORCH = 'pytorch_model.bin'
_PYTORCH_INDEX = 'pytorch_model.bin.index.json'


def require(module: str):
  """Imports an optional dependency of the interop extra, or says how to install it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f'{module} is needed for Hugging Face interop: {INSTALL_HINT}') from e


# ------------------------------------------------------------------- config


def to_hf_config(cfg: model_lib.ModelConfig, specials: tok_lib.Specials,
                 fmt: Format | None = None) -> dict[str, Any]:
  """Our model shape -> the `config.json` dict of its Hugging Face model.

  `specials`: the run's tokenizer's, whose ids become pad/bos/eos/cls/sep/mask_token_id
  (RoBERTa's position offset follows its pad id). `fmt`: the architecture written (None:
  the model's own, `model_format`); it must hold the model's tensors.
  """
  return _checked(cfg, fmt).to_config(cfg, specials)


def _bert_family_config(cfg: model_lib.ModelConfig, specials: tok_lib.Specials,
                        fmt: Format) -> dict[str, Any]:
  """Our model shape -> a `BertConfig` (`RobertaConfig`) dict for `config.json`."""
  return {
      'architectures': [fmt.architecture],
      'model_type': fmt.model_type,
      'vocab_size': cfg.vocab_size,
      'hidden_size': cfg.hidden_size,
      'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads,
      'intermediate_size': cfg.intermediate_size,
      'hidden_act': 'gelu',  # transformers' 'gelu' is the exact erf GELU, as ours.
      'hidden_dropout_prob': cfg.dropout_rate,
      'attention_probs_dropout_prob': cfg.attention_dropout_rate,
      'max_position_embeddings': cfg.max_position_embeddings + fmt.position_offset(specials.pad),
      'type_vocab_size': cfg.type_vocab_size,
      'initializer_range': cfg.initializer_range,
      'layer_norm_eps': cfg.layer_norm_eps,
      **special_token_ids(specials),
      'tie_word_embeddings': True,
      'dtype': 'float32',
  }


def from_hf_config(hf: dict[str, Any], model: ml_collections.ConfigDict,
                   dtype: Any = jnp.float32) -> model_lib.ModelConfig:
  """A config.json dict (by its model_type) -> our ModelConfig.

  The shape and the numbers of the saved model come from `hf`
  (checkpoint_fields); how we run it (attention kernel, scan, remat,
  DropToken) from `model`, a config.model section.
  """
  fields = checkpoint_fields(hf)
  vocab_size = fields.pop('vocab_size')
  if fields['variant'] == 'modern':
    fields['scan_layers'] = False  # Its layers differ; never scanned (model/config.py).
  return model_lib.ModelConfig.from_config(model, vocab_size, tok_lib.padded_vocab_size(vocab_size),
                                           dtype, platform=model_lib.local_platform(), **fields)


def checkpoint_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """The config.model fields a config.json decides (see checkpoint_model_fields)."""
  return format_of(hf).fields(hf)


def format_of(hf: dict[str, Any]) -> Format:
  """The Format of a config.json dict, by its model_type; ValueError naming the supported ones."""
  model_type = hf.get('model_type', 'bert')
  if model_type not in _BY_MODEL_TYPE:
    raise ValueError(f'config.json model_type={model_type!r} is not supported (only '
                     f'{", ".join(repr(t) for t in _BY_MODEL_TYPE)}).')
  return _BY_MODEL_TYPE[model_type]


def _bert_family_fields(hf: dict[str, Any], fmt: Format) -> dict[str, Any]:
  """A `BertConfig` (`RobertaConfig`) dict -> the ModelConfig fields it decides; refuses what
  our encoder does not compute. transformers' defaults where it leaves a key out."""
  unsupported = {
      'hidden_act': (hf.get('hidden_act', 'gelu'), ('gelu',)),
      'position_embedding_type': (hf.get('position_embedding_type', 'absolute'), ('absolute',)),
      'is_decoder': (hf.get('is_decoder', False), (False,)),
      'tie_word_embeddings': (hf.get('tie_word_embeddings', True), (True,)),
  }
  for key, (value, allowed) in unsupported.items():
    if value not in allowed:
      raise ValueError(f'{fmt.name} config {key}={value!r} is not supported (only {allowed[0]!r}).')
  offset = fmt.position_offset(hf.get('pad_token_id'))
  positions = hf.get('max_position_embeddings', 512) - offset
  if positions < 1:
    raise ValueError(f"{fmt.name} config max_position_embeddings={hf['max_position_embeddings']} "
                     f"leaves no positions after the {offset} rows before padding_idx + 1.")
  return {
      'variant': fmt.variant,
      'vocab_size': hf['vocab_size'],
      'num_layers': hf['num_hidden_layers'],
      'hidden_size': hf['hidden_size'],
      'num_heads': hf['num_attention_heads'],
      'intermediate_size': hf['intermediate_size'],
      'max_position_embeddings': positions,
      'type_vocab_size': hf.get('type_vocab_size', 2),
      'dropout_rate': hf.get('hidden_dropout_prob', 0.1),
      'attention_dropout_rate': hf.get('attention_probs_dropout_prob', 0.1),
      'initializer_range': hf.get('initializer_range', 0.02),
      'layer_norm_eps': hf.get('layer_norm_eps', 1e-12),
  }


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  """config.json of a model directory; ValueError if there is none."""
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.isfile(path):
    raise ValueError(f'{hf_dir} has no config.json: not a Hugging Face model directory.')
  with open(path) as f:
    return json.load(f)


def load_hf_config(hf_dir: str, model: ml_collections.ConfigDict,
                   dtype: Any = jnp.float32) -> model_lib.ModelConfig:
  return from_hf_config(read_hf_config(hf_dir), model, dtype)


def checkpoint_model_fields(hf_dir: str) -> dict[str, Any]:
  """The config.model fields the checkpoint in `hf_dir` decides.

  variant, vocab_size (its embedding rows, which may exceed its tokenizer's
  ids), num_layers, hidden_size, num_heads, intermediate_size,
  max_position_embeddings (our table's rows: RoBERTa's offset rows left
  out), type_vocab_size (not for 'modern'), dropout_rate,
  attention_dropout_rate, initializer_range, layer_norm_eps and, for
  'modern', global_attn_every_n_layers, local_attention, global_rope_theta,
  local_rope_theta. Raises ValueError (one line) for a missing config.json,
  an unsupported model_type or setting, no weight file, or a truncated one.
  """
  hf = read_hf_config(hf_dir)
  fields = checkpoint_fields(hf)
  try:
    check_weight_files(hf_dir)
  except FileNotFoundError as e:
    raise ValueError(str(e)) from e
  return fields


# ------------------------------------------------------------------ weights


_VOCAB_PATHS = (('encoder', 'embeddings', 'token', 'embedding'), ('mlm_head', 'output_bias'))


@dataclasses.dataclass(frozen=True)
class _BertNames:
  """Where BertForMaskedLM and RobertaForMaskedLM differ: the prefixes of their tensors."""
  encoder: str       # 'bert' / 'roberta'
  transform: str     # The head's dense layer.
  head_norm: str     # The head's LayerNorm.
  bias: str          # The output bias.
  decoder: str       # The tied decoder weight (absent from transformers 5 files).


_BERT_NAMES = _BertNames('bert', 'cls.predictions.transform.dense',
                         'cls.predictions.transform.LayerNorm', 'cls.predictions.bias',
                         'cls.predictions.decoder')
_ROBERTA_NAMES = _BertNames('roberta', 'lm_head.dense', 'lm_head.layer_norm', 'lm_head.bias',
                            'lm_head.decoder')


def _bert_family_layout(cfg: model_lib.ModelConfig, position_offset: int,
                        names: _BertNames) -> list[Tensor]:
  """Every tensor of BertForMaskedLM (RobertaForMaskedLM), in the state dict's order."""
  d, n, f, v = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size
  h = d // n

  def plain(hf_name, path, shape):
    return [Tensor(hf_name, path, shape, shape)]

  layer_norm = functools.partial(layer_norm_tensors, width=d)
  dense = dense_tensors

  emb, p = ('encoder', 'embeddings'), f'{names.encoder}.embeddings'
  positions = cfg.max_position_embeddings
  out = [*plain(f'{p}.word_embeddings.weight', (*emb, 'token', 'embedding'), (v, d)),
         Tensor(f'{p}.position_embeddings.weight', (*emb, 'position', 'embedding'),
                (positions + position_offset, d), (positions, d), offset_rows=position_offset),
         *plain(f'{p}.token_type_embeddings.weight', (*emb, 'segment', 'embedding'),
                (cfg.type_vocab_size, d)),
         *layer_norm(f'{p}.LayerNorm', (*emb, 'layer_norm'))]
  for i in range(cfg.num_layers):
    hf, ours = f'{names.encoder}.encoder.layer.{i}', ('encoder', f'layer_{i}')
    for name in ('query', 'key', 'value'):
      out += dense(f'{hf}.attention.self.{name}', (*ours, 'attention', name), (d,), (n, h))
    out += dense(f'{hf}.attention.output.dense', (*ours, 'attention', 'out'), (n, h), (d,))
    out += layer_norm(f'{hf}.attention.output.LayerNorm', (*ours, 'attention_layer_norm'))
    out += dense(f'{hf}.intermediate.dense', (*ours, 'intermediate'), (d,), (f,))
    out += dense(f'{hf}.output.dense', (*ours, 'output'), (f,), (d,))
    out += layer_norm(f'{hf}.output.LayerNorm', (*ours, 'output_layer_norm'))
  out += dense(names.transform, ('mlm_head', 'transform'), (d,), (d,))
  out += layer_norm(names.head_norm, ('mlm_head', 'layer_norm'))
  out += plain(names.bias, ('mlm_head', 'output_bias'), (v,))
  return out


def to_hf_state_dict(params: Params, cfg: model_lib.ModelConfig,
                     pad_id: int | None = None) -> dict[str, np.ndarray]:
  """Our params -> the variant's ...ForMaskedLM tensors, float32, padding rows dropped.

  `pad_id`: the tokenizer's pad id, which places RoBERTa's positions (None:
  RoBERTa's own, 1). A sentence-pair head (NSP/SOP) has no place in any of
  them and is left out.
  """
  if cfg.scan_layers:
    params = model_lib.unstack_layers(params, cfg.num_layers)
  fmt = _format(cfg)
  out = {}
  for t in fmt.layout(cfg, fmt.position_offset(pad_id)):
    x = np.asarray(jax.device_get(get_path(params, t.path)), np.float32)
    if t.path in _VOCAB_PATHS:
      x = x[:cfg.vocab_size]
    out[t.hf_name] = t.to_hf(x)
  return out


def from_hf_state_dict(tensors: dict[str, np.ndarray], cfg: model_lib.ModelConfig,
                       fallback_params: Params | None = None, source: str = 'state dict',
                       pad_id: int | None = None) -> Params:
  """The variant's ...ForMaskedLM (or base model) tensors -> our params, shapes checked.

  Base-model weights (BertModel: names without 'bert.'; RobertaModel: without
  'roberta.'; ModernBertModel: without 'model.'; no MLM head) take the MLM
  head from `fallback_params`. `pad_id`: the checkpoint's pad_token_id,
  which places RoBERTa's positions (None: RoBERTa's own, 1).
  """
  fmt = _format(cfg)
  tensors = fmt.canonical_names(tensors)
  has_head = fmt.head_tensor in tensors
  if fallback_params is not None and cfg.scan_layers and 'encoder' in fallback_params:
    # (The heads alone, as init_from passes them, have no layers to unstack.)
    fallback_params = model_lib.unstack_layers(fallback_params, cfg.num_layers)
  params: Params = {}
  for t in fmt.layout(cfg, fmt.position_offset(pad_id)):
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


def _bert_family_canonical_names(tensors: dict[str, np.ndarray],
                                 names: _BertNames) -> dict[str, np.ndarray]:
  """BertForMaskedLM (RobertaForMaskedLM) names; the base model's lack the encoder prefix,
  old files say gamma/beta and may hold the output bias as the decoder's.

  Tensors without a counterpart here (pooler, next-sentence head, position_ids buffers) are
  never looked up.
  """
  bare = 'embeddings.word_embeddings.weight' in tensors
  out = {}
  for name, x in tensors.items():
    if bare and name.startswith(('embeddings.', 'encoder.', 'pooler.')):
      name = f'{names.encoder}.{name}'
    if name.endswith('.gamma') or name.endswith('.beta'):
      name = name.rsplit('.', 1)[0] + ('.weight' if name.endswith('.gamma') else '.bias')
    out[name] = x
  if names.bias not in out and f'{names.decoder}.bias' in out:
    out[names.bias] = out[f'{names.decoder}.bias']
  return out


def _bert_format(name: str, cls: str, variant: str, model_type: str, names: _BertNames,
                 input_names: tuple[str, ...], **kwargs) -> Format:
  """The Format of a BERT-encoder checkpoint (cls: 'Bert' -> BertForMaskedLM, BertModel)."""
  return Format(
      name=name, variant=variant, model_type=model_type, architecture=f'{cls}ForMaskedLM',
      base_model=f'{cls}Model',
      layout=lambda cfg, offset=0: _bert_family_layout(cfg, offset, names),
      canonical_names=lambda tensors: _bert_family_canonical_names(tensors, names),
      head_tensor=f'{names.transform}.weight',
      embedding_tensor=f'{names.encoder}.embeddings.word_embeddings.weight',
      decoder_tensor=f'{names.decoder}.weight',
      # Looked up when called: the Format itself, once _BY_MODEL_TYPE holds it.
      to_config=lambda cfg, specials: _bert_family_config(cfg, specials,
                                                          _BY_MODEL_TYPE[model_type]),
      fields=lambda hf: _bert_family_fields(hf, _BY_MODEL_TYPE[model_type]),
      input_names=input_names, **kwargs)


BERT = _bert_format('BERT', 'Bert', 'bert', 'bert', _BERT_NAMES,
                    ('input_ids', 'token_type_ids', 'attention_mask'))
DISTILBERT = distilbert.FORMAT


def _roberta_offset(pad_id: int | None) -> int:
  """RoBERTa's position ids start after padding_idx (its pad id): rows 0..pad_id are never
  read by real tokens."""
  return (1 if pad_id is None else pad_id) + 1


# XLM-R and CamemBERT: RoBERTa's tensors and config keys under their own model_type, with a
# sentencepiece tokenizer (XLMRobertaTokenizer, CamembertTokenizer) that AutoTokenizer
# builds only for their model_type. Variant 'roberta' reads all three (also_reads).
ROBERTA = _bert_format('RoBERTa', 'Roberta', 'roberta', 'roberta', _ROBERTA_NAMES,
                       ('input_ids', 'attention_mask'), also_reads=('xlm-roberta', 'camembert'),
                       position_offset=_roberta_offset)
XLM_ROBERTA = _bert_format('XLM-RoBERTa', 'XLMRoberta', 'roberta', 'xlm-roberta', _ROBERTA_NAMES,
                           ('input_ids', 'attention_mask'), position_offset=_roberta_offset)
CAMEMBERT = _bert_format('CamemBERT', 'Camembert', 'roberta', 'camembert', _ROBERTA_NAMES,
                         ('input_ids', 'attention_mask'), position_offset=_roberta_offset)
# By config.model.variant: the architecture of a model whose tokenizer names no other.
FORMATS = {f.variant: f for f in (BERT, ROBERTA, modernbert.FORMAT)}
# By config.json's model_type, in the order messages list them.
_BY_MODEL_TYPE = {f.model_type: f for f in (BERT, DISTILBERT, ROBERTA, XLM_ROBERTA, CAMEMBERT,
                                            modernbert.FORMAT)}


def model_format(cfg: model_lib.ModelConfig) -> Format:
  """The Format whose tensors the model has: its variant's, DistilBERT's without token types."""
  if cfg.variant == 'bert' and cfg.type_vocab_size == 0:
    return DISTILBERT
  return FORMATS[cfg.variant]


def _format(cfg: model_lib.ModelConfig) -> Format:
  return model_format(cfg)


def _checked(cfg: model_lib.ModelConfig, fmt: Format | None) -> Format:
  """`fmt`, or the model's Format; ValueError if `fmt` names other tensors than the model's."""
  own = model_format(cfg)
  if fmt is not None and (fmt.variant, fmt is DISTILBERT) != (own.variant, own is DISTILBERT):
    raise ValueError(f'A {own.name} model (variant {cfg.variant!r}, type_vocab_size '
                     f'{cfg.type_vocab_size}) has no {fmt.architecture} form.')
  return own if fmt is None else fmt


def _weight_files(hf_dir: str) -> list[str]:
  """The weight file(s) of a model directory: model.safetensors (or its sharded index), else
  pytorch_model.bin (or its sharded index); FileNotFoundError if it has none."""
  for single, index in ((_SAFETENSORS, _SAFETENSORS_INDEX), (_PYTORCH, _PYTORCH_INDEX)):
    if os.path.exists(os.path.join(hf_dir, single)):
      return [os.path.join(hf_dir, single)]
    if os.path.exists(os.path.join(hf_dir, index)):
      with open(os.path.join(hf_dir, index)) as f:
        shards = sorted(set(json.load(f)['weight_map'].values()))
      return [os.path.join(hf_dir, shard) for shard in shards]
  raise FileNotFoundError(f'{hf_dir} has no {_SAFETENSORS} or {_PYTORCH} (nor their sharded '
                          'index): not a model directory with weights.')


def _corrupt(path: str, error: BaseException) -> ValueError:
  """The one line for a weight file that cannot be read: a broken or partial download."""
  reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return ValueError(f'{path} is truncated or corrupt ({reason}): download it again.')


def conversion_command(hf_dir: str, out_dir: str = 'OUT_DIR') -> str:
  """A shell command that writes the tensors of `hf_dir`'s pytorch_model*.bin as
  model.safetensors in `out_dir` and copies every other file there byte for byte (config and
  tokenizer files), so `out_dir` is a complete model directory. It unpickles the files fully
  (weights_only=False): for a file the user trusts."""
  return ('python -c "import glob, os, shutil, torch; from safetensors.torch import save_file; '
          f"src, out = '{hf_dir}', '{out_dir}'; os.makedirs(out, exist_ok=True); "
          "t = {k: v.clone().contiguous() for f in sorted(glob.glob(os.path.join(src, "
          "'pytorch_model*.bin'))) for k, v in torch.load(f, map_location='cpu', "
          "weights_only=False).items() if isinstance(v, torch.Tensor)}; "
          "save_file(t, os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'}); "
          "[shutil.copy(f, out) for f in glob.glob(os.path.join(src, '*')) if os.path.isfile(f) "
          "and not f.endswith(('.bin', '.bin.index.json', '.safetensors', "
          "'.safetensors.index.json'))]\"")


def check_weight_files(hf_dir: str) -> list[str]:
  """The weight files of `hf_dir`, each checked without reading its tensors: a safetensors
  header that covers the file; a pytorch_model.bin unpickled (weights only, its tensors
  memory-mapped). ValueError (one line, naming the file) for a truncated or corrupt one or one
  that needs more than tensors; FileNotFoundError for none."""
  files = _weight_files(hf_dir)
  for path in files:
    if not os.path.exists(path):
      raise ValueError(f'{path} is missing (named by the sharded index of {hf_dir}): download '
                       'it again.')
    if path.endswith('.safetensors'):
      safetensors = require('safetensors')
      try:
        with safetensors.safe_open(path, 'np'):
          pass
      except Exception as e:  # pylint: disable=broad-except  # SafetensorError is not exported.
        raise _corrupt(path, e) from e
    else:
      _load_pytorch(path, hf_dir)
  return files


def _load_pytorch(path: str, hf_dir: str) -> dict[str, Any]:
  """A pytorch_model.bin's state dict, read with torch.load(weights_only=True): transformers'
  loader, which unpickles tensors and containers only and so runs no code from the file.
  Tensors of torch.save's zip format (PyTorch >= 1.6) are memory-mapped, not read."""
  torch = require('torch')
  with open(path, 'rb') as f:
    zipped = f.read(4) == b'PK\x03\x04'
  try:
    state = torch.load(path, map_location='cpu', weights_only=True, mmap=zipped)
  except pickle.UnpicklingError as e:
    if 'Weights only load failed' not in str(e):
      raise _corrupt(path, e) from e
    raise ValueError(
        f'{path} holds more than tensors (objects whose loading would run code from the '
        'file), so it is not read. Convert it once, in an environment you trust with that '
        f'file: {conversion_command(hf_dir)}') from e
  except Exception as e:  # pylint: disable=broad-except  # torch raises OSError, RuntimeError...
    raise _corrupt(path, e) from e
  if not isinstance(state, dict):
    raise ValueError(f'{path} holds a {type(state).__name__}, not a state dict of tensors.')
  return state


def _read_pytorch(path: str, hf_dir: str) -> dict[str, np.ndarray]:
  """A pytorch_model.bin's tensors as numpy arrays (16-bit floats widened to float32)."""
  torch = require('torch')
  return {name: np.array((x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16)
                          else x).numpy())
          for name, x in _load_pytorch(path, hf_dir).items() if isinstance(x, torch.Tensor)}


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
  """All tensors of a model directory's weight file(s): safetensors, or pytorch_model.bin read
  without running code (_read_pytorch). ValueError (one line) naming a truncated or corrupt
  file or one that needs more than tensors; FileNotFoundError for no weights."""
  tensors = {}
  for path in check_weight_files(hf_dir):  # Cheap: headers, memory-mapped tensors.
    if path.endswith('.safetensors'):
      numpy_io = require('safetensors.numpy')
      try:
        tensors.update(numpy_io.load_file(path))
      except Exception as e:  # pylint: disable=broad-except  # SafetensorError is not exported.
        raise _corrupt(path, e) from e
    else:
      tensors.update(_read_pytorch(path, hf_dir))
  return tensors


def load_hf_params(hf_dir: str, model_cfg: model_lib.ModelConfig,
                   fallback_params: Params | None = None) -> Params:
  """Reads a Hugging Face model directory (read_weights) into our params (numpy).

  Its config.json, where there is one, must name a model type of
  `model_cfg.variant`'s format; its pad_token_id places RoBERTa's positions.
  """
  fmt, pad_id = _format(model_cfg), None
  if os.path.exists(os.path.join(hf_dir, 'config.json')):
    hf = read_hf_config(hf_dir)
    model_type = hf.get('model_type', 'bert')
    if model_type not in fmt.model_types:
      raise ValueError(f'{hf_dir} holds a {model_type!r} model, but '
                       f'config.model.variant={model_cfg.variant!r} loads '
                       f'{" or ".join(repr(t) for t in fmt.model_types)} models only.')
    pad_id = hf.get('pad_token_id')
  return from_hf_state_dict(read_weights(hf_dir), model_cfg, fallback_params, source=hf_dir,
                            pad_id=pad_id)


def save_model(out_dir: str, params: Params, cfg: model_lib.ModelConfig,
               specials: tok_lib.Specials, fmt: Format | None = None) -> None:
  """Writes config.json and model.safetensors that `AutoModelForMaskedLM.from_pretrained` loads.

  As `fmt` (None: the model's own, `model_format`: BertForMaskedLM, DistilBertForMaskedLM,
  RobertaForMaskedLM or ModernBertForMaskedLM; mlm_export.export_format picks XLM-R's or
  CamemBERT's by the tokenizer), with config vocab_size = cfg.vocab_size rows and
  `specials`' ids (the run's tokenizer's).
  """
  numpy_io = require('safetensors.numpy')
  config = to_hf_config(cfg, specials, fmt)  # Refuses a model `fmt` cannot hold, first.
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  # transformers refuses safetensors files without format metadata.
  numpy_io.save_file(to_hf_state_dict(params, cfg, specials.pad),
                     os.path.join(out_dir, _SAFETENSORS), metadata={'format': 'pt'})


# ---------------------------------------------------------------- tokenizer


def save_tokenizer(out_dir: str, tokenizer: tok_lib.Tokenizer, model_max_length: int,
                   variant: str = 'bert', fmt: Format | None = None) -> None:
  """Writes the tokenizer files `AutoTokenizer.from_pretrained(out_dir)` loads, giving our ids.

  A sentencepiece tokenizer: tokenizer.json (hf_tokenizer), tokenizer_config.json and the
  sentencepiece model itself. A Hugging Face one (HFTokenizer): every file it read (vocab,
  merges, sentencepiece.bpe.model, ...), byte for byte (with the tokens add_tokens added).
  Its tokenizer_config.json gains a key only where transformers could not use the export
  without it: model_input_names, where no tokenizer class is named but the generic one
  (whose default names include token_type_ids, which RoBERTa's, DistilBERT's and
  ModernBERT's forward refuse) and the model takes no token types. `fmt` (else
  FORMATS[variant]): the architecture it encodes for.
  """
  os.makedirs(out_dir, exist_ok=True)
  input_names = list((fmt or FORMATS[variant]).input_names)
  if not isinstance(tokenizer, sp_tokenizer.SentencePieceTokenizer):  # Its own files.
    tokenizer.save(out_dir)
    path = os.path.join(out_dir, 'tokenizer_config.json')
    config = {}
    if os.path.exists(path):
      with open(path) as f:
        config = json.load(f)
    # Without a tokenizer_config.json, AutoTokenizer builds config.json's model_type's own
    # class, which knows its input names.
    generic = config.get('tokenizer_class') == 'PreTrainedTokenizerFast'
    if generic and 'token_type_ids' not in input_names and 'model_input_names' not in config:
      with open(path, 'w') as f:
        json.dump({**config, 'model_input_names': input_names}, f, indent=2)
    return
  hf_tokenizer.from_sentencepiece(tokenizer).save(os.path.join(out_dir, 'tokenizer.json'))
  # The sentencepiece model itself: a later run started from this directory
  # (config.init.hf_dir) tokenizes its corpus with exactly this vocabulary.
  tokenizer.save(out_dir)
  names = [f'{role}_token' for role in tok_lib.ROLES]
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      **dict(zip(names, tokenizer.specials.tokens)),
      # A literal [MASK] in text is found by the unigram model, as in
      # sentencepiece, not cut out of the text before normalisation.
      'split_special_tokens': True,
      'model_max_length': model_max_length,
      'model_input_names': input_names,
      'clean_up_tokenization_spaces': False,
  }
  with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
