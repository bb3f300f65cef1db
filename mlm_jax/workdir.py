"""What a training run leaves in its workdir, loaded for inference and export.

  WORKDIR/config.json       the resolved config (model shape, masking, data dir, vocab)
  WORKDIR/tokenizer.model   the sentencepiece model
  WORKDIR/checkpoints/<n>/  Orbax checkpoints
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from mlm_jax import checkpoint as ckpt_lib
from mlm_jax import model as model_lib
from mlm_jax import tokenizer as tok_lib


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  workdir: str
  step: int
  config: dict[str, Any]               # WORKDIR/config.json
  model_cfg: model_lib.ModelConfig     # float32 compute, for exact inference
  params: dict[str, Any]               # host numpy arrays
  tokenizer: tok_lib.Tokenizer


def load(workdir: str, step: int | None = None) -> TrainedRun:
  """Config, tokenizer and the parameters of checkpoint `step` (None: the latest)."""
  workdir = os.path.abspath(workdir)
  config_path = os.path.join(workdir, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(f'{workdir} is not a training workdir (no config.json).')
  with open(config_path) as f:
    config = json.load(f)
  resolved = config['resolved']
  model_cfg = model_lib.ModelConfig.from_config(
      config['model'], resolved['vocab_size'], resolved['padded_vocab_size'], jnp.float32,
      sentence_pair_head=config.get('sentence_pair', {}).get('task', 'none') != 'none')
  step, params, meta = ckpt_lib.restore_params(os.path.join(workdir, 'checkpoints'), step)
  ckpt_lib.check_meta(meta, model_cfg.shape_record(), f'{step} of {workdir}')
  tokenizer = tok_lib.Tokenizer(os.path.join(workdir, 'tokenizer.model'))
  return TrainedRun(workdir, step, config, model_cfg, params, tokenizer)
