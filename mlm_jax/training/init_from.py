"""Where a new run's weights come from: a Hugging Face checkpoint or an earlier run.

config.init.hf_dir (BertForMaskedLM, RobertaForMaskedLM, ModernBertForMaskedLM
in safetensors) or config.init.workdir (the latest checkpoint of an mlm_jax
run). Weights only: the optimizer state stays as created (zero moments,
step 0), so the schedule's warm-up starts again. configuration.resolve has
already made config.model the checkpoint's shape; `model_cfg` differs from
it only in the vocabulary, when words added to the tokenizer
(config.tokenizer.add_tokens) need rows the table lacks.

Each added word's embedding row (and MLM output bias) starts as the mean of
the rows of the pieces that spelled it before, so the model reads a new
token about as it read the word.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from mlm_jax import model as model_lib
from mlm_jax.config_check import ConfigError
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import hf
from mlm_jax.interop.layout import get_path
from mlm_jax.interop.layout import set_path
from mlm_jax.training import workdir as workdir_lib

Params = dict[str, Any]
# Our params with one row per vocabulary id: the token embedding and the MLM output bias.
VOCAB_PATHS = (('encoder', 'embeddings', 'token', 'embedding'), ('mlm_head', 'output_bias'))


def initial_state(state: Any, config: ml_collections.ConfigDict,
                  model_cfg: model_lib.ModelConfig, added: dict[int, list[int]]) -> Any:
  """`state` with its params replaced by config.init's model, vocabulary grown for `added`.

  `added`: {new id: the ids that spelled the word before it was added}.
  New params are placed on the shardings of the params they replace.
  """
  table = config.model.vocab_size or model_cfg.vocab_size
  source_cfg = dataclasses.replace(model_cfg, vocab_size=table,
                                   padded_vocab_size=tok_lib.padded_vocab_size(table))
  host = jax.device_get(state.params)
  if config.init.hf_dir:
    params, where = _from_hf(config.init.hf_dir, source_cfg, host), config.init.hf_dir
  else:
    params, where = _from_run(config.init.workdir, source_cfg, host), config.init.workdir
  state = place(state, grow_vocab(params, source_cfg, model_cfg, added))
  grown = f'; {len(added)} added tokens' if added else ''
  logging.info('Initialised from %s (%s, %d layers, vocabulary %d%s); optimizer fresh', where,
               model_cfg.variant, model_cfg.num_layers, model_cfg.vocab_size, grown)
  return state


def place(state: Any, params: Params) -> Any:
  """`state` with `params` (host arrays of the same tree) on the shardings and dtypes of the
  params they replace; the optimizer state and step are left as they are."""
  return state.replace(params=jax.tree_util.tree_map(
      lambda old, new: jax.device_put(np.asarray(new).astype(old.dtype), old.sharding),
      state.params, params))


def _from_hf(hf_dir: str, cfg: model_lib.ModelConfig, fallback: Params) -> Params:
  try:
    return hf.load_hf_params(os.path.expanduser(hf_dir), cfg,
                             fallback_params=_fit_vocab(fallback, cfg))
  except ValueError as e:
    raise ConfigError(f'config.init.hf_dir={hf_dir!r}: {e}') from e


def _from_run(workdir: str, cfg: model_lib.ModelConfig, fallback: Params) -> Params:
  """The latest checkpoint's params of an mlm_jax run, laid out as `cfg` wants them."""
  run = workdir_lib.load(os.path.expanduser(workdir))
  params = run.params
  if run.model_cfg.scan_layers:
    params = model_lib.unstack_layers(params, run.model_cfg.num_layers)
  params = dict(params)
  params.pop('sentence_pair', None)  # A head of the earlier run's objective only.
  if cfg.sentence_pair_head:
    params['sentence_pair'] = fallback['sentence_pair']
  if cfg.scan_layers:
    params = model_lib.stack_layers(params, cfg.num_layers)
  for path in VOCAB_PATHS:
    rows = get_path(params, path).shape[0]
    if rows != cfg.padded_vocab_size:
      raise ConfigError(f'config.init.workdir={workdir!r}: its {"/".join(path)} has {rows} rows, '
                        f'this run {cfg.padded_vocab_size}.')
  logging.info('Weights of %s at step %d', workdir, run.step)
  return params


def _fit_vocab(params: Params, cfg: model_lib.ModelConfig) -> Params | None:
  """`params` if its vocabulary rows fit `cfg` (a fallback for a missing MLM head), else None."""
  return params if get_path(params, VOCAB_PATHS[1]).shape[0] == cfg.padded_vocab_size else None


def grow_vocab(params: Params, old: model_lib.ModelConfig, new: model_lib.ModelConfig,
               added: dict[int, list[int]]) -> Params:
  """Params of `old`'s vocabulary laid out for `new`'s, each added id's rows the mean of its pieces'.

  Rows of ids below old.vocab_size are kept; other new rows are zero (as an
  import pads them) unless an added id owns them.
  """
  if not added and old.padded_vocab_size == new.padded_vocab_size:
    return params
  out = jax.tree_util.tree_map(lambda x: x, params)  # New containers: set_path writes into them.
  for path in VOCAB_PATHS:
    x = np.asarray(get_path(params, path))
    grown = np.zeros((new.padded_vocab_size, *x.shape[1:]), x.dtype)
    keep = min(old.vocab_size, new.vocab_size)
    grown[:keep] = x[:keep]
    for i, pieces in added.items():
      if not pieces:
        raise ValueError(f'added token id {i} has no pieces to start its embedding from')
      grown[i] = x[np.asarray(pieces)].mean(axis=0)
    set_path(out, path, grown)
  return out
