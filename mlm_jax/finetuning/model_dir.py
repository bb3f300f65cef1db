"""A fine-tuning output directory: what it holds, and loading it back to predict or export.

  OUT/model.json       task, labels, sequence length, the encoder's config.model and
                       vocabulary, the model it started from (a pretraining run or
                       a Hugging Face directory), the tokenizer's digest
  OUT/labels.json      the labels (tags) in the order of the logits (not for regress)
  OUT/config.json      the fine-tuning config, resolved (steps, learning rate, ...)
  OUT/tokenizer.model  the tokenizer, when it is sentencepiece; any other (a Hugging
  or OUT/tokenizer/    Face one) as its own files in tokenizer/ (tok_lib.load reads either)
  OUT/checkpoints/<n>  Orbax checkpoints of the train state, the newest kept: for resuming
  OUT/best/<n>         the parameters at the evaluation with the best score so far (n: its
                       step), and in its meta that evaluation: what predict and export use
  OUT/metrics.jsonl, OUT/tb/: see training/metrics.py

A rerun in the same directory resumes only with the same task, labels,
sequence length and tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax.numpy as jnp

from mlm_jax import model as model_lib
from mlm_jax.config import fields
from mlm_jax.config import saved
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.training import checkpoint as ckpt_lib

MODEL_FILE, LABELS_FILE, CONFIG_FILE = 'model.json', 'labels.json', 'config.json'


def checkpoint_dir(out_dir: str) -> str:
  return os.path.join(out_dir, 'checkpoints')


def best_dir(out_dir: str) -> str:
  return os.path.join(out_dir, 'best')


def model_record(task: str, labels: list | None, seq_len: int, model_cfg: model_lib.ModelConfig,
                 model_section: dict[str, Any], classifier_dropout: float,
                 pretrained: dict[str, Any], tokenizer: tok_lib.Tokenizer) -> dict[str, Any]:
  """model.json's contents: everything `load` needs to rebuild the model.

  `pretrained`: where the encoder came from ({'workdir', 'step'} or {'hf_dir'}).
  """
  return {'task': task, 'labels': labels, 'num_outputs': len(labels) if labels else 1,
          'seq_len': seq_len, 'model': model_section, 'vocab_size': model_cfg.vocab_size,
          'padded_vocab_size': model_cfg.padded_vocab_size,
          'classifier_dropout': classifier_dropout, 'pretrained': pretrained,
          'tokenizer': {'kind': tokenizer.kind, 'digest': tokenizer.digest()}}


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
  # Directories written before the tokenizer was recorded resume as they did.
  if 'tokenizer' in saved and saved['tokenizer'] != record['tokenizer']:
    raise ckpt_lib.CheckpointMismatchError(
        f'{out_dir} holds checkpoints fine-tuned with another tokenizer ({saved["tokenizer"]}) '
        f'than the model this run starts from has ({record["tokenizer"]}): ids would mean '
        'other pieces. Start from the same --workdir / --hf_dir, or use a new --out.')


def save_tokenizer(out_dir: str, tokenizer: tok_lib.Tokenizer) -> str:
  """Writes the tokenizer as a run directory holds it (OUT/tokenizer.model, or OUT/tokenizer/
  for a Hugging Face one, whose tokenizer_config.json must not mix with OUT's own files);
  returns the path tok_lib.load reads.

  The other form, left by an earlier attempt in `out_dir`, is removed: load would find a
  sentencepiece tokenizer.model first.
  """
  sp_file, hf_dir = os.path.join(out_dir, 'tokenizer.model'), os.path.join(out_dir, 'tokenizer')
  if tokenizer.kind == 'sentencepiece':
    shutil.rmtree(hf_dir, ignore_errors=True)
    return tokenizer.save(out_dir)
  if os.path.exists(sp_file):
    os.remove(sp_file)
  return tokenizer.save(hf_dir)


def load_tokenizer(out_dir: str) -> tok_lib.Tokenizer:
  """The tokenizer save_tokenizer wrote into `out_dir`."""
  # tokenizer_files names OUT/tokenizer.model or the OUT/tokenizer/ folder; load reads either.
  return tok_lib.load(tok_lib.tokenizer_files(out_dir) or out_dir)


def write(out_dir: str, record: dict[str, Any], config: dict[str, Any],
          tokenizer: tok_lib.Tokenizer) -> None:
  """Writes model.json, labels.json, config.json and the tokenizer into `out_dir`."""
  os.makedirs(out_dir, exist_ok=True)
  save_tokenizer(out_dir, tokenizer)
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
  """The encoder's ModelConfig of a model.json record (platform: `overrides`', else here)."""
  overrides.setdefault('platform', model_lib.local_platform())
  return model_lib.ModelConfig.from_config(
      saved.with_old_values('model', record['model']), record['vocab_size'],
      record['padded_vocab_size'], dtype, **overrides)


@dataclasses.dataclass(frozen=True)
class FineTunedModel:
  out_dir: str
  step: int                  # The step of the parameters (the best evaluation's, by default).
  task: str
  labels: list | None        # The label of each logit; None: regress (one output).
  seq_len: int
  model_cfg: model_lib.ModelConfig   # float32 compute, for exact inference.
  classifier_dropout: float
  params: dict[str, Any]     # Host numpy arrays.
  tokenizer: tok_lib.Tokenizer
  # config.data of the fine-tuning (fields read, tfds data dir): predict reads its data so.
  data_config: dict[str, Any] = dataclasses.field(default_factory=dict)
  # The evaluation that chose these parameters ({'step', 'metric', 'value', 'eval'}), if any.
  best: dict[str, Any] | None = None

  @property
  def row_format(self) -> data_lib.RowFormat:
    """How this model's rows are framed (its tokenizer's specials, its family's pair form)."""
    return row_format(self.tokenizer, self.model_cfg)


def row_format(tokenizer: tok_lib.Tokenizer, cfg: model_lib.ModelConfig) -> data_lib.RowFormat:
  return data_lib.RowFormat.for_model(tokenizer.specials, cfg.variant, cfg.type_vocab_size)


def saved_steps(directory: str) -> list[int]:
  """The steps an Orbax checkpoint directory holds (finished saves only)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def load(out_dir: str, step: int | None = None) -> FineTunedModel:
  """model.json, the tokenizer and parameters: the best evaluation's (None), or step `step`.

  `step` is looked up in OUT/best, then OUT/checkpoints. A directory
  without OUT/best (written before the best was kept) gives its latest checkpoint.
  """
  out_dir = os.path.abspath(out_dir)
  path = os.path.join(out_dir, MODEL_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{out_dir} is not a fine-tuning output directory (no {MODEL_FILE}).')
  with open(path) as f:
    record = json.load(f)
  cfg = model_config(record)
  best = saved_steps(best_dir(out_dir))
  use_best = bool(best) and (step is None or step in best)
  directory = best_dir(out_dir) if use_best else checkpoint_dir(out_dir)
  step, params, meta = ckpt_lib.restore_params(directory, step)
  ckpt_lib.check_meta(meta, checkpoint_meta(cfg, record), f'{step} of {out_dir}')
  config_path = os.path.join(out_dir, CONFIG_FILE)
  data_config = {}
  if os.path.exists(config_path):
    with open(config_path) as f:
      data_config = json.load(f).get('data', {})
  return FineTunedModel(out_dir, step, record['task'], record['labels'], record['seq_len'], cfg,
                        record['classifier_dropout'], params, load_tokenizer(out_dir), data_config,
                        meta.get('best'))


def checkpoint_meta(cfg: model_lib.ModelConfig, record: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint must agree with to be loaded: the encoder's shapes, the task, the outputs."""
  return {**fields.shape_record(cfg), 'task': record['task'], 'num_outputs': record['num_outputs']}
