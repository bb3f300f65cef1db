"""Export of a fine-tuned model as a Hugging Face sequence or token classifier.

The class is the masked LM's an export of the encoder writes
(interop/mlm_export.export_format: the model's own, or XLM-R's or
CamemBERT's for a RoBERTa encoder with their tokenizer), with its
ForSequenceClassification (task classify, pair, regress) or
ForTokenClassification (task tag) head: BertFor..., DistilBertFor...,
RobertaFor..., XLMRobertaFor..., CamembertFor... or ModernBertFor....

The encoder's tensors are named and laid out as the pretraining export
writes them (interop/hf.py, interop/distilbert.py and interop/modernbert.py,
whose layouts this reuses); the head adds, in Hugging Face's names:

  ours                                Hugging Face
  head/pooler/{kernel, bias}          bert.pooler.dense.{weight, bias}   (BERT, sequence)
                                      pre_classifier.{weight, bias}      (DistilBERT, sequence)
                                      classifier.dense.{weight, bias}    (RoBERTa, sequence)
  head/transform/kernel               head.dense.weight                  (ModernBERT)
  head/layer_norm/scale               head.norm.weight                   (ModernBERT)
  head/classifier/{kernel, bias}      classifier.{weight, bias}
                                      classifier.out_proj.{weight, bias} (RoBERTa, sequence)

config.json carries id2label / label2id (the labels as strings, in the
order of the logits), problem_type, the head's dropout (DistilBERT's
seq_classif_dropout) and for ModernBERT classifier_pooling 'cls'. A tag
model's logits cover every piece; ours are read at each word's first piece.
The tokenizer is the model's own (a Hugging Face one's files as it was read;
see hf.save_tokenizer). Needs the interop extra (safetensors, tokenizers),
not torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.finetuning import heads
from mlm_jax.finetuning import model_dir
from mlm_jax.interop import hf
from mlm_jax.interop import mlm_export
from mlm_jax.interop.layout import Format
from mlm_jax.interop.layout import Tensor
from mlm_jax.interop.layout import get_path


def export_format(model: model_dir.FineTunedModel) -> Format:
  """The masked LM's Format whose classifier an export writes (see the module doc)."""
  return mlm_export.export_format(model.model_cfg, model.tokenizer)


def architecture(model: model_dir.FineTunedModel) -> str:
  """The transformers class the export of `model` loads as."""
  head = 'ForTokenClassification' if model.task == 'tag' else 'ForSequenceClassification'
  return export_format(model).architecture.removesuffix('ForMaskedLM') + head


def head_layout(cfg: model_lib.ModelConfig, per_token: bool, num_outputs: int) -> list[Tensor]:
  """The head's tensors in the Hugging Face class of (cfg's encoder, per_token)."""
  d, k = cfg.hidden_size, num_outputs
  out, classifier = [], 'classifier'
  if cfg.variant == 'modern':
    out += [Tensor('head.dense.weight', ('head', 'transform', 'kernel'), (d, d), (d, d), True),
            Tensor('head.norm.weight', ('head', 'layer_norm', 'scale'), (d,), (d,))]
  elif not per_token:
    pooler = ('pre_classifier' if heads.is_distilbert(cfg) else
              'classifier.dense' if cfg.variant == 'roberta' else 'bert.pooler.dense')
    out += [Tensor(f'{pooler}.weight', ('head', 'pooler', 'kernel'), (d, d), (d, d), True),
            Tensor(f'{pooler}.bias', ('head', 'pooler', 'bias'), (d,), (d,))]
    if cfg.variant == 'roberta':
      classifier = 'classifier.out_proj'
  return out + [Tensor(f'{classifier}.weight', ('head', 'classifier', 'kernel'), (k, d), (d, k),
                       True),
                Tensor(f'{classifier}.bias', ('head', 'classifier', 'bias'), (k,), (k,))]


def to_hf_state_dict(params: dict[str, Any], cfg: model_lib.ModelConfig, per_token: bool,
                     num_outputs: int, pad_id: int) -> dict[str, np.ndarray]:
  """Our fine-tuned params -> the Hugging Face class's tensors (float32, no vocabulary padding).

  `pad_id`: the tokenizer's, which places RoBERTa's positions after its offset rows.
  """
  if cfg.scan_layers:
    params = model_lib.unstack_layers(params, cfg.num_layers)
  fmt = hf.model_format(cfg)   # XLM-R's and CamemBERT's tensors are RoBERTa's.
  encoder = [t for t in fmt.layout(cfg, fmt.position_offset(pad_id)) if t.path[0] == 'encoder']
  out = {}
  for t in encoder + head_layout(cfg, per_token, num_outputs):
    x = np.asarray(get_path(params, t.path), np.float32)
    out[t.hf_name] = t.to_hf(x[:t.shape[0]])   # Only the token table has rows past t.shape.
  return out


def to_hf_config(model: model_dir.FineTunedModel) -> dict[str, Any]:
  """The config.json of the export: the encoder's, with the head's class, labels and dropout."""
  cfg = model.model_cfg
  names = [str(label) for label in model.labels] if model.labels else ['value']
  config = hf.to_hf_config(cfg, model.tokenizer.specials, export_format(model)) | {
      'architectures': [architecture(model)],
      'id2label': dict(enumerate(names)), 'label2id': {n: i for i, n in enumerate(names)},
      'problem_type': 'regression' if model.task == 'regress' else 'single_label_classification',
      'classifier_dropout': model.classifier_dropout}
  if heads.is_distilbert(cfg):  # DistilBertForSequenceClassification's name for it.
    config['seq_classif_dropout'] = model.classifier_dropout
  if cfg.variant == 'modern':
    config['classifier_pooling'] = 'cls'
  return config


def export(model_path: str, out_dir: str, step: int | None = None) -> model_dir.FineTunedModel:
  """Writes the Hugging Face directory `out_dir` of a fine-tuning output; returns the model.

  `step` None: the best evaluation's parameters (model_dir.load).
  """
  numpy_io = hf.require('safetensors.numpy')
  model = model_dir.load(model_path, step)
  tensors = to_hf_state_dict(model.params, model.model_cfg, model.task == 'tag',
                             len(model.labels or [0]), model.tokenizer.specials.pad)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(to_hf_config(model), f, indent=2)
  # transformers refuses safetensors files without format metadata.
  numpy_io.save_file(tensors, os.path.join(out_dir, 'model.safetensors'),
                     metadata={'format': 'pt'})
  hf.save_tokenizer(out_dir, model.tokenizer, model.model_cfg.max_position_embeddings,
                    model.model_cfg.variant)
  return model
