"""An embed run's directory: what it holds, and loading it back to encode, evaluate or export.

  OUT/embedding.json   pooling, row length, prompts, the loss's settings, the
                       encoder's config.model and vocabulary, the model it started
                       from, the training data, the tokenizer's digest
  OUT/config.json      the embedding config, resolved (steps, learning rate, ...)
  OUT/tokenizer.model  the tokenizer, when it is sentencepiece; any other (a Hugging
  or OUT/tokenizer/    Face one) as its own files (fine-tuning's model_dir writes both)
  OUT/checkpoints/<n>  Orbax checkpoints of the train state, the newest kept
  OUT/metrics.jsonl, OUT/tb/: training/metrics.py

What must stay true: a rerun in the same directory resumes only with the
same pooling, row length, prompts, number of negatives, temperature's kind
and tokenizer (anything else would continue other vectors), and an encoder
of the same shapes (the checkpoints' meta); `load` gives the parameters of a
checkpoint with the record that says how to use them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import model_dir
from mlm_jax.training import checkpoint as ckpt_lib

RECORD_FILE, CONFIG_FILE = 'embedding.json', 'config.json'
# What a rerun must agree with to continue the checkpoints of a directory.
_RESUME_KEYS = ('pooling', 'seq_len', 'query_prompt', 'document_prompt', 'num_negatives',
                'learn_temperature')


def checkpoint_dir(out_dir: str) -> str:
  return os.path.join(out_dir, 'checkpoints')


def is_embed_run(path: str | None) -> bool:
  """Whether `path` is an embed run's directory (rather than a pretraining run's)."""
  return bool(path) and os.path.isfile(os.path.join(path, RECORD_FILE))


def record(*, pooling: str, seq_len: int, query_prompt: str, document_prompt: str,
           num_negatives: int, loss: dict[str, Any], model_cfg: model_lib.ModelConfig,
           model_section: dict[str, Any], pretrained: dict[str, Any], train_data: str,
           tokenizer: tok_lib.Tokenizer) -> dict[str, Any]:
  """embedding.json's contents: everything `load` needs to rebuild and use the model."""
  return {'kind': 'embedding', 'pooling': pooling, 'seq_len': seq_len,
          'query_prompt': query_prompt, 'document_prompt': document_prompt,
          'num_negatives': num_negatives, 'temperature': loss['temperature'],
          'learn_temperature': loss['learn_temperature'], 'symmetric': loss['symmetric'],
          'model': model_section, 'vocab_size': model_cfg.vocab_size,
          'padded_vocab_size': model_cfg.padded_vocab_size, 'pretrained': pretrained,
          'train_data': train_data,
          'tokenizer': {'kind': tokenizer.kind, 'digest': tokenizer.digest()}}


def check_resumable(out_dir: str, new: dict[str, Any]) -> None:
  """Refuses to continue checkpoints of `out_dir` trained with other settings than `new`."""
  path, checkpoints = os.path.join(out_dir, RECORD_FILE), checkpoint_dir(out_dir)
  if not (os.path.exists(path) and os.path.isdir(checkpoints) and os.listdir(checkpoints)):
    return
  with open(path) as f:
    saved = json.load(f)
  for key in _RESUME_KEYS + ('tokenizer',):
    if saved.get(key) != new[key]:
      raise ckpt_lib.CheckpointMismatchError(
          f'{out_dir} holds checkpoints trained with {key}={saved.get(key)!r}, but this run has '
          f'{key}={new[key]!r}: use the same model, data and config, or a new --out.')


def checkpoint_meta(cfg: model_lib.ModelConfig, rec: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint must agree with to be loaded: the encoder's shapes (fine-tuning's record
  of them, with task 'embedding' and no head outputs, so that neither kind of directory loads
  the other's checkpoints) and the settings a resumed run must share (embedding.json's)."""
  return {**model_dir.checkpoint_meta(cfg, {'task': 'embedding', 'num_outputs': 0}),
          **{k: rec[k] for k in _RESUME_KEYS}}


def write(out_dir: str, rec: dict[str, Any], config: dict[str, Any],
          tokenizer: tok_lib.Tokenizer) -> None:
  """Writes embedding.json, config.json and the tokenizer into `out_dir` (each whole)."""
  os.makedirs(out_dir, exist_ok=True)
  model_dir.save_tokenizer(out_dir, tokenizer)
  for name, content in ((RECORD_FILE, rec), (CONFIG_FILE, config)):
    tmp = os.path.join(out_dir, name + '.tmp')
    with open(tmp, 'w') as f:
      json.dump(content, f, indent=2, default=str)
    os.replace(tmp, os.path.join(out_dir, name))


def read_record(out_dir: str) -> dict[str, Any]:
  path = os.path.join(out_dir, RECORD_FILE)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{out_dir} is not an embed run (no {RECORD_FILE}).')
  with open(path) as f:
    return json.load(f)


def read_config(out_dir: str) -> dict[str, Any]:
  with open(os.path.join(out_dir, CONFIG_FILE)) as f:
    return json.load(f)


def model_config(rec: dict[str, Any], dtype: Any = None, **overrides) -> model_lib.ModelConfig:
  """The encoder's ModelConfig of an embedding.json record (float32 unless `dtype`)."""
  return model_dir.model_config(rec, **({'dtype': dtype} if dtype is not None else {}),
                                sentence_pair_head=False, **overrides)


@dataclasses.dataclass(frozen=True)
class EmbedRun:
  """An embed run loaded back: the record, the encoder (float32) and its parameters."""

  out_dir: str
  step: int
  record: dict[str, Any]
  model_cfg: model_lib.ModelConfig
  params: dict[str, Any]     # Host arrays: 'encoder' (and 'log_scale' when learned).
  tokenizer: tok_lib.Tokenizer


def load(out_dir: str, step: int | None = None) -> EmbedRun:
  """The record, tokenizer and the parameters of checkpoint `step` (None: the latest)."""
  out_dir = os.path.abspath(out_dir)
  rec = read_record(out_dir)
  cfg = model_config(rec)
  step, params, meta = ckpt_lib.restore_params(checkpoint_dir(out_dir), step)
  ckpt_lib.check_meta(meta, checkpoint_meta(cfg, rec), f'{step} of {out_dir}')
  return EmbedRun(out_dir, step, rec, cfg, params, model_dir.load_tokenizer(out_dir))
