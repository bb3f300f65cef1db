"""The whole config, checked before anything expensive; a saved run's config read back.

`validate` runs every part's own check of its section (each part defines
its allowed values and limits next to the code that uses them) and the
checks that span sections (rows against the position table, batches against
devices, the state's split against the width, paths of an init model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import ml_collections
from absl import logging

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
from mlm_jax.training import heldout
from mlm_jax.training import profiling
from mlm_jax.training import step

__all__ = ['ConfigError', 'resolve', 'saved_config', 'validate']


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
  heldout.check_config(config.eval)
  profiling.check_config(config.profile)
  require(config.sentence_pair.task == 'none' or model.type_vocab_size >= 2,
          f"config.sentence_pair.task={config.sentence_pair.task!r} gives the second segment "
          f'token type 1, but the model has config.model.type_vocab_size={model.type_vocab_size} '
          "(RoBERTa's checkpoints have one): use sentence_pair.task='none'.")
  for field in ('document_mask', 'restart_positions'):
    require(config.sentence_pair.task == 'none' or not model[field],
            f'config.model.{field}=True with config.sentence_pair.task='
            f"{config.sentence_pair.task!r}: a sentence pair's two segments are cut from one "
            f"row and must see each other as one text; set {field}=False or task='none'.")
  require(not corpus.uses_token_ids(d) or bool(config.tokenizer.model_file or config.init.hf_dir
                                                or config.init.workdir),
          'config.data.ids_key reads token ids made with a tokenizer that must be given: set '
          'config.tokenizer.model_file to it (or config.init.hf_dir to the checkpoint it came '
          'with).')
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
  """A model to start from must exist; one source at a time."""
  init = config.init
  require(not (init.hf_dir and init.workdir),
          f'config.init.hf_dir={init.hf_dir!r} and config.init.workdir={init.workdir!r} are both '
          'set: start from one of them.')
  require(not config.tokenizer.add_tokens or bool(init.hf_dir or init.workdir
                                                    or config.tokenizer.model_file),
          'config.tokenizer.add_tokens needs a tokenizer to add to: set config.init.hf_dir '
          '(or config.init.workdir, or config.tokenizer.model_file).')
  if init.hf_dir:
    require(os.path.isdir(os.path.expanduser(init.hf_dir)),
            f'config.init.hf_dir={init.hf_dir!r}: no such directory.')
  if init.workdir:
    require(os.path.isfile(os.path.join(os.path.expanduser(init.workdir), 'config.json')),
            f'config.init.workdir={init.workdir!r} is not an mlm_jax run directory (no '
            'config.json): give the --workdir of an earlier training run.')


# config.model fields a checkpoint decides: a command-line value that differs is refused.
ARCHITECTURE_FIELDS = (
    'variant', 'vocab_size', 'num_layers', 'hidden_size', 'num_heads', 'intermediate_size',
    'max_position_embeddings', 'type_vocab_size', 'layer_norm_eps', 'global_attn_every_n_layers',
    'local_attention')
# config.model fields a checkpoint suggests: its value unless given on the command line. The
# rotary bases are a recipe's to change (context extension: ModernBERT raises the global
# layers' from 10,000 to 160,000 for rows of 8,192 tokens), as is a rotary model's
# max_position_embeddings, which sizes no table.
RECIPE_FIELDS = ('dropout_rate', 'attention_dropout_rate', 'initializer_range',
                 'global_rope_theta', 'local_rope_theta')
ROTARY_RECIPE_FIELDS = ('max_position_embeddings',)


def resolve(config: ml_collections.ConfigDict, num_devices: int | None,
            overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """The config a run uses: checked (ConfigError), with implied settings filled in.

  A run started from config.init.hf_dir or config.init.workdir takes the
  architecture, shape, vocabulary, positions and tokenizer from that model:
  its config.model fields are replaced (and logged), and a field named in
  `overrides` (the command line's --config.* keys, e.g. 'model.num_layers')
  that contradicts the checkpoint is a ConfigError. The config keeps the
  recipe: optimizer, schedule, masking, batch, data, seq_len.
  """
  validate(config, num_devices=num_devices)
  init = config.init
  if not (init.hf_dir or init.workdir):
    return config
  source, fields, tokenizer_path = _init_source(init)
  overrides = set(overrides)
  config = config.copy_and_resolve_references()
  model = config.model
  recipe = RECIPE_FIELDS + (ROTARY_RECIPE_FIELDS if fields.get('variant') == 'modern' else ())
  for key in ARCHITECTURE_FIELDS + RECIPE_FIELDS:
    if key not in fields or model[key] == fields[key]:
      continue
    if f'model.{key}' in overrides:
      require(key in recipe,
              f'config.model.{key}={model[key]!r} contradicts the checkpoint in {source} '
              f'({key}={fields[key]!r}): the checkpoint decides the architecture; drop the '
              'override.')
      continue
    logging.info('config.model.%s: %r from the checkpoint in %s (the config said %r)', key,
                 fields[key], source, model[key])
    with model.ignore_type():
      model[key] = fields[key]
  tok = config.tokenizer
  if tok.model_file:
    require('tokenizer.model_file' in overrides or os.path.abspath(tok.model_file)
            == os.path.abspath(tokenizer_path),
            f'config.tokenizer.model_file={tok.model_file!r} is set, but the checkpoint in '
            f'{source} brings its own tokenizer; leave it empty.')
  tok.model_file = tok.model_file or tokenizer_path
  rotary = model.variant == 'modern'
  require(config.data.seq_len <= model.max_position_embeddings,
          f'config.data.seq_len={config.data.seq_len} exceeds the {model.max_position_embeddings} '
          f'positions of the checkpoint in {source}; '
          + (f'its positions are rotary: to extend its context, also set '
             f'--config.model.max_position_embeddings={config.data.seq_len} (and, as ModernBERT '
             'does, a larger --config.model.global_rope_theta).' if rotary else
             'its position table has that many rows: use at most that.'))
  _check_vocab(config, source)
  validate(config, num_devices=num_devices)
  return config


def _init_source(init: ml_collections.ConfigDict) -> tuple[str, dict[str, Any], str]:
  """(where, config.model fields of its model, its tokenizer's path) of config.init's model."""
  if init.hf_dir:
    from mlm_jax.interop import hf  # pylint: disable=import-outside-toplevel  # interop extra
    hf_dir = os.path.expanduser(init.hf_dir)
    try:
      fields = hf.checkpoint_model_fields(hf_dir)
    except (ValueError, FileNotFoundError) as e:
      raise ConfigError(f'config.init.hf_dir={init.hf_dir!r}: {e}') from e
    tokenizer_path = tokenizer.tokenizer_files(hf_dir)
    require(tokenizer_path is not None,
            f'config.init.hf_dir={init.hf_dir!r} has no tokenizer files (tokenizer.json, '
            'vocab.txt, or an mlm_jax tokenizer.model), so its ids cannot be matched to text: '
            'copy the tokenizer files published with the model into it.')
    return hf_dir, fields, tokenizer_path
  workdir = os.path.expanduser(init.workdir)
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = saved_config(json.load(f), os.path.join(workdir, 'config.json'))
  fields = {k: saved.model[k] for k in ARCHITECTURE_FIELDS + RECIPE_FIELDS}
  fields['vocab_size'] = saved.resolved.vocab_size
  tokenizer_path = tokenizer.tokenizer_files(workdir)
  require(tokenizer_path is not None,
          f'config.init.workdir={init.workdir!r} holds no tokenizer (tokenizer.model or '
          'tokenizer/): it was not written by a training run.')
  return workdir, fields, tokenizer_path


def _check_vocab(config: ml_collections.ConfigDict, source: str) -> None:
  """The tokenizer must fit the checkpoint's embedding table (words to add grow it)."""
  try:
    tok = tokenizer.load(config.tokenizer.model_file)
  except ValueError as e:
    raise ConfigError(f'config.init ({source}): {e}') from e
  table = config.model.vocab_size
  require(tok.vocab_size <= table or bool(config.tokenizer.add_tokens),
          f'The tokenizer of {source} has {tok.vocab_size:,} ids but the checkpoint\'s embedding '
          f'table only {table:,} rows: they do not belong together. Use the tokenizer files '
          'the checkpoint was published with.')


def model_vocab_size(config: ml_collections.ConfigDict, tokenizer_vocab: int) -> int:
  """Rows the model predicts over: config.model.vocab_size (a checkpoint's table), else the
  tokenizer's; tokens added beyond a checkpoint's table grow it to a multiple of 64."""
  table = config.model.vocab_size or tokenizer_vocab
  if tokenizer_vocab > table:
    return -(-tokenizer_vocab // 64) * 64
  return table


# Fields added to configs/base.py after runs were already saved, each with the
# value that reproduces what a run from before it did (documents attended to
# one another, positions counted from the row's start, text read from one
# corpus). A saved run lacking one is read with that value; any other missing
# field is refused, since what the older run did cannot be known.
ADDED_FIELDS = {
    'data.ids_key': '',
    'data.sources': (),
    'data.tfds_export': False,
    'model.document_mask': False,
    'model.restart_positions': False,
}


def saved_config(saved: dict[str, Any], where: str) -> ml_collections.ConfigDict:
  """A run's saved config (its config.json) as a ConfigDict; ConfigError when it lacks fields of
  today's config (configs/base.py): a run written by an older version, which is not guessed at,
  except for ADDED_FIELDS, which are filled with the behaviour the older run had.

  Keys outside the config (e.g. 'resolved') are kept.
  """
  missing = _missing_fields(base.get_config().to_dict(), saved)
  filled = [m for m in missing if m in ADDED_FIELDS]
  missing = [m for m in missing if m not in ADDED_FIELDS]
  if missing:
    listed = ', '.join(f'config.{m}' for m in missing[:3])
    more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
    raise ConfigError(
        f'{where} was written by an older version of mlm_jax: it lacks {listed}{more}. Train '
        'again in a new --workdir (preparing the data again) rather than reuse it.')
  config = ml_collections.ConfigDict(saved)
  for name in filled:
    section, key = name.split('.')
    config[section][key] = ADDED_FIELDS[name]
  if filled:
    logging.info('%s predates %s: read as %s, what the run did.', where,
                 ', '.join(f'config.{m}' for m in filled),
                 ', '.join(f'{ADDED_FIELDS[m]!r}' for m in filled))
  return config


def _missing_fields(fields: dict[str, Any], saved: dict[str, Any], prefix: str = '') -> list[str]:
  missing = []
  for key, value in fields.items():
    if key not in saved:
      missing.append(prefix + key)
    elif isinstance(value, dict) and isinstance(saved[key], dict):
      missing += _missing_fields(value, saved[key], f'{prefix}{key}.')
  return missing
