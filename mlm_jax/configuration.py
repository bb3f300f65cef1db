"""The whole config, checked before anything expensive, and completed for older runs.

`validate` runs every part's own check of its section (each part defines
its allowed values and limits next to the code that uses them) and the
checks that span sections (rows against the position table, batches against
devices, the state's split against the width, paths of an init model).
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from configs import base
from mlm_jax.config_check import ConfigError
from mlm_jax.config_check import require
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import sentence_pairs
from mlm_jax.data import tokenizer
from mlm_jax.model import config as model_config
from mlm_jax.training import evaluate
from mlm_jax.training import profiling
from mlm_jax.training import step

__all__ = ['ConfigError', 'resolve', 'validate', 'with_defaults']


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None,
             check_paths: bool = True) -> None:
  """Raises ConfigError for the first invalid field.

  `check_paths=False` leaves out the checks of files on this machine (corpus,
  tokenizer model, Hugging Face init): for a pre-flight of a run that will
  read them elsewhere.
  """
  d, model = config.data, config.model
  prepare.check_config(d)
  require(d.seq_len <= model.max_position_embeddings,
          f'config.data.seq_len={d.seq_len} exceeds config.model.max_position_embeddings='
          f'{model.max_position_embeddings}; raise the latter or shorten the rows.')
  corpus.check_config(d, check_paths)
  tokenizer.check_config(config.tokenizer, check_paths)
  masking.check_config(config.masking, d.seq_len)
  sentence_pairs.check_config(config.sentence_pair, d.seq_len)
  pipeline.check_config(config.input)
  model_config.check_config(model)
  step.check_config(config.train)
  evaluate.check_config(config.eval)
  profiling.check_config(config.profile)
  _check_mesh(config, num_devices)
  if check_paths:
    _check_init(config)


def _check_mesh(config: ml_collections.ConfigDict, num_devices: int | None) -> None:
  """The state's split against the width, and every batch against the devices."""
  fsdp, tr, hidden = config.mesh.fsdp, config.train, config.model.hidden_size
  require(fsdp >= 1, f'config.mesh.fsdp={fsdp} must be at least 1 (1: no sharding of the state).')
  require(hidden % fsdp == 0,
          f'config.mesh.fsdp={fsdp} does not divide config.model.hidden_size={hidden}; '
          'the state is split along the hidden axis, so use a divisor of it.')
  if num_devices is None:
    return
  require(num_devices % fsdp == 0,
          f'config.mesh.fsdp={fsdp} does not divide the {num_devices} devices; use a divisor '
          f'of {num_devices}.')
  for field, value in (('train.batch_size', tr.batch_size),
                       ('eval.batch_size', config.eval.batch_size)):
    require(value % num_devices == 0,
            f'config.{field}={value} is not divisible by the {num_devices} devices; '
            f'use a multiple of {num_devices}.')
  unit = num_devices * tr.grad_accum_steps
  require(tr.batch_size % unit == 0,
          f'config.train.batch_size={tr.batch_size} is not divisible by {num_devices} devices '
          f'x config.train.grad_accum_steps={tr.grad_accum_steps}; use a multiple of {unit}.')
  chains = tr.concurrent_chains
  require(chains == 0 or tr.batch_size % (unit * chains) == 0,
          f'config.train.batch_size={tr.batch_size} is not divisible by {num_devices} devices '
          f'x grad_accum_steps={tr.grad_accum_steps} x concurrent_chains={chains}; use a '
          f'multiple of {unit * chains}, or concurrent_chains=0 (auto).')


def _check_init(config: ml_collections.ConfigDict) -> None:
  """A Hugging Face model to start from must exist and bring its vocabulary."""
  init = config.init
  if not init.hf_dir:
    return
  hf_dir = os.path.expanduser(init.hf_dir)
  require(os.path.isdir(hf_dir), f'config.init.hf_dir={init.hf_dir!r}: no such directory.')
  require(bool(config.tokenizer.model_file)
          or os.path.isfile(os.path.join(hf_dir, 'tokenizer.model')),
          f'config.init.hf_dir={init.hf_dir!r} has no tokenizer.model (sentencepiece), '
          'so its token ids cannot be matched to a corpus: export it with '
          '`python -m mlm_jax.export`, or set config.tokenizer.model_file to the sentencepiece '
          'model its vocabulary was made with.')


def resolve(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
  """The config a run uses: checked (ConfigError), with implied settings filled in.

  A run started from config.init.hf_dir tokenizes with that model's vocabulary.
  """
  validate(config, num_devices=num_devices)
  if not config.init.hf_dir or config.tokenizer.model_file:
    return config
  config = config.copy_and_resolve_references()
  config.tokenizer.model_file = os.path.join(os.path.expanduser(config.init.hf_dir),
                                             'tokenizer.model')
  return config


def with_defaults(saved: dict[str, Any]) -> ml_collections.ConfigDict:
  """A run's saved config (its config.json) with the fields it predates from configs/base.py.

  Fields added to the project after a run was written take their default;
  what the run saved wins. Keys outside the config (e.g. 'resolved') are kept.
  """
  merged = _merge(base.get_config().to_dict(), saved)
  return ml_collections.ConfigDict(merged)


def _merge(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
  out = dict(defaults)
  for key, value in saved.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out
