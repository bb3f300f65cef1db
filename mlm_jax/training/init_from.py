"""Where a new run's weights come from: a Hugging Face checkpoint or an earlier run.

config.init.hf_dir (BertForMaskedLM, RobertaForMaskedLM, ModernBertForMaskedLM
in safetensors or pytorch_model.bin; a directory or a hub id, interop/hub.py)
or config.init.workdir (checkpoint config.init.step, else the latest, of an
mlm_jax run; config.init.branch carries its whole state instead:
training/loop.py). Weights only: the optimizer state stays as created (zero moments, step 0), so the
schedule's warm-up starts again. configuration.resolve has
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
from jax.experimental import multihost_utils

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.interop import hf
from mlm_jax.interop import hub
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
  Every process reads the checkpoint's tensors into host memory and places
  them shard by shard on the shardings of the params they replace (`place`):
  no process fetches the state, whose shards may live on other hosts (FSDP
  across processes); only the heads an import may lack are gathered.
  """
  table = config.model.vocab_size or model_cfg.vocab_size
  source_cfg = dataclasses.replace(model_cfg, vocab_size=table,
                                   padded_vocab_size=tok_lib.padded_vocab_size(table))
  heads = _host_heads(state.params)
  if config.init.hf_dir:
    resolved = _resolve_hub(config.init.hf_dir)
    params, where = _from_hf(resolved, config.init.hf_dir, source_cfg, heads), resolved
  else:
    params, where = (_from_run(config.init.workdir, source_cfg, heads, config.init.step),
                     config.init.workdir)
  state = place(state, grow_vocab(params, source_cfg, model_cfg, added))
  grown = f'; {len(added)} added tokens' if added else ''
  logging.info('Initialised from %s (%s, %d layers, vocabulary %d%s); optimizer fresh', where,
               model_cfg.variant, model_cfg.num_layers, model_cfg.vocab_size, grown)
  return state


def place(state: Any, params: Params) -> Any:
  """`state` with `params` (host arrays of the same tree) on the shardings and dtypes of the
  params they replace; the optimizer state and step are left as they are.

  Each device's shard is cut from the host array (every process holds the
  whole host array, as it read it), so no device sees another's data and no
  process needs the old values.
  """
  def put(old: jax.Array, new: Any) -> jax.Array:
    host = np.asarray(new).astype(old.dtype)
    if host.shape != old.shape:
      raise ValueError(f'an imported tensor has shape {host.shape}, its parameter {old.shape}')
    return jax.make_array_from_callback(old.shape, old.sharding, lambda index: host[index])

  return state.replace(params=jax.tree_util.tree_map(put, state.params, params))


def _host_heads(params: Params) -> Params:
  """The state's heads (the MLM head, a sentence-pair head) as host arrays: what an import
  takes from the new model where the checkpoint has none. Gathered from every process's shards
  (all processes call this), small beside the encoder, which is never fetched."""
  heads = {k: params[k] for k in ('mlm_head', 'sentence_pair') if k in params}
  return jax.tree_util.tree_map(np.asarray, multihost_utils.process_allgather(heads, tiled=True))


def _resolve_hub(hf_dir: str) -> str:
  """config.init.hf_dir as a local directory (a hub id through the cache: interop/hub.py)."""
  try:
    resolved = hub.resolve(hf_dir, 'config.init.hf_dir')
  except ValueError as e:
    raise ConfigError(str(e)) from e
  return resolved.local_dir


def _from_hf(hf_dir: str, flag_value: str, cfg: model_lib.ModelConfig, heads: Params) -> Params:
  try:
    return hf.load_hf_params(hf_dir, cfg, fallback_params=_fit_vocab(heads, cfg))
  except ValueError as e:
    raise ConfigError(f'config.init.hf_dir={flag_value!r}: {e}') from e


def _from_run(workdir: str, cfg: model_lib.ModelConfig, heads: Params, step: int = 0) -> Params:
  """The params of checkpoint `step` (0: the latest) of an mlm_jax run, laid out as `cfg`
  wants them."""
  run = workdir_lib.load(os.path.expanduser(workdir), step or None)
  params = run.params
  if run.model_cfg.scan_layers:
    params = model_lib.unstack_layers(params, run.model_cfg.num_layers)
  params = dict(params)
  params.pop('sentence_pair', None)  # A head of the earlier run's objective only.
  if cfg.sentence_pair_head:
    params['sentence_pair'] = heads['sentence_pair']
  if cfg.scan_layers:
    params = model_lib.stack_layers(params, cfg.num_layers)
  for path in VOCAB_PATHS:
    rows = get_path(params, path).shape[0]
    if rows != cfg.padded_vocab_size:
      raise ConfigError(f'config.init.workdir={workdir!r}: its {"/".join(path)} has {rows} rows, '
                        f'this run {cfg.padded_vocab_size}.')
  logging.info('Weights of %s at step %d', workdir, run.step)
  return jax.tree_util.tree_map(np.asarray, params)


def _fit_vocab(params: Params, cfg: model_lib.ModelConfig) -> Params | None:
  """`params` (the heads) if its vocabulary rows fit `cfg` (a fallback for a missing MLM head),
  else None."""
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
