"""A fine-tuning output directory: what it holds, and loading it back to predict or export.

  OUT/model.json       task, labels, sequence length, the encoder's config.model and
                       vocabulary, the pretraining run it started from
  OUT/labels.json      the labels (tags) in the order of the logits (not for regress)
  OUT/config.json      the fine-tuning config, resolved (steps, learning rate, ...)
  OUT/tokenizer.model  the pretraining run's sentencepiece model
  OUT/checkpoints/<n>  Orbax checkpoints; OUT/metrics.jsonl, OUT/tb/: see training/metrics.py

A rerun in the same directory resumes only with the same task and labels.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax.numpy as jnp
import ml_collections

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.training import checkpoint as ckpt_lib

MODEL_FILE, LABELS_FILE, CONFIG_FILE = 'model.json', 'labels.json', 'config.json'


def checkpoint_dir(out_dir: str) -> str:
  return os.path.join(out_dir, 'checkpoints')


def model_record(task: str, labels: list | None, seq_len: int, model_cfg: model_lib.ModelConfig,
                 model_section: dict[str, Any], classifier_dropout: float, pretrained: str,
                 pretrained_step: int) -> dict[str, Any]:
  """model.json's contents: everything `load` needs to rebuild the model."""
  return {'task': task, 'labels': labels, 'num_outputs': len(labels) if labels else 1,
          'seq_len': seq_len, 'model': model_section, 'vocab_size': model_cfg.vocab_size,
          'padded_vocab_size': model_cfg.padded_vocab_size,
          'classifier_dropout': classifier_dropout,
          'pretrained': {'workdir': pretrained, 'step': pretrained_step}}


def check_resumable(out_dir: str, record: dict[str, Any]) -> None:
  """Refuses to continue checkpoints of another task or label set in `out_dir`."""
  path = os.path.join(out_dir, MODEL_FILE)
  checkpoints = checkpoint_dir(out_dir)
  if not (os.path.exists(path) and os.path.isdir(checkpoints) and os.listdir(checkpoints)):
    return
  with open(path) as f:
    saved = json.load(f)
  for key in ('task', 'labels', 'seq_len'):
    if saved[key] != record[key]:
      raise ckpt_lib.CheckpointMismatchError(
          f'{out_dir} holds checkpoints fine-tuned with {key}={saved[key]!r}, but this run has '
          f'{key}={record[key]!r}: use the same task, training file and config, or a new --out.')


def write(out_dir: str, record: dict[str, Any], config: dict[str, Any],
          tokenizer: tok_lib.Tokenizer) -> None:
  """Writes model.json, labels.json, config.json and tokenizer.model into `out_dir`."""
  os.makedirs(out_dir, exist_ok=True)
  shutil.copyfile(tokenizer.model_path, os.path.join(out_dir, 'tokenizer.model'))
  files = {MODEL_FILE: record, CONFIG_FILE: config}
  if record['labels'] is not None:
    files[LABELS_FILE] = record['labels']
  for name, content in files.items():
    tmp = os.path.join(out_dir, name + '.tmp')
    with open(tmp, 'w') as f:
      json.dump(content, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out_dir, name))


def model_config(record: dict[str, Any], dtype: Any = jnp.float32,
                 **overrides) -> model_lib.ModelConfig:
  """The encoder's ModelConfig of a model.json record."""
  return model_lib.ModelConfig.from_config(
      ml_collections.ConfigDict(record['model']), record['vocab_size'],
      record['padded_vocab_size'], dtype, **overrides)


@dataclasses.dataclass(frozen=True)
class FineTunedModel:
  out_dir: str
  step: int
  task: str
  labels: list | None        # The label of each logit; None: regress (one output).
  seq_len: int
  model_cfg: model_lib.ModelConfig   # float32 compute, for exact inference.
  classifier_dropout: float
  params: dict[str, Any]     # Host numpy arrays.
  tokenizer: tok_lib.Tokenizer
  # config.data of the fine-tuning (fields read, tfds data dir): predict reads its data so.
  data_config: dict[str, Any] = dataclasses.field(default_factory=dict)


def load(out_dir: str, step: int | None = None) -> FineTunedModel:
  """model.json, the tokenizer and the parameters of checkpoint `step` (None: the latest)."""
  out_dir = os.path.abspath(out_dir)
  path = os.path.join(out_dir, MODEL_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{out_dir} is not a fine-tuning output directory (no {MODEL_FILE}).')
  with open(path) as f:
    record = json.load(f)
  cfg = model_config(record)
  step, params, meta = ckpt_lib.restore_params(checkpoint_dir(out_dir), step)
  ckpt_lib.check_meta(meta, checkpoint_meta(cfg, record), f'{step} of {out_dir}')
  config_path = os.path.join(out_dir, CONFIG_FILE)
  data_config = {}
  if os.path.exists(config_path):
    with open(config_path) as f:
      data_config = json.load(f).get('data', {})
  return FineTunedModel(out_dir, step, record['task'], record['labels'], record['seq_len'], cfg,
                        record['classifier_dropout'], params,
                        tok_lib.Tokenizer(os.path.join(out_dir, 'tokenizer.model')), data_config)


def checkpoint_meta(cfg: model_lib.ModelConfig, record: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint must agree with to be loaded: the encoder's shapes, the task, the outputs."""
  return {**cfg.shape_record(), 'task': record['task'], 'num_outputs': record['num_outputs']}
