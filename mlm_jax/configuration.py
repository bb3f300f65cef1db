"""The whole config, checked before anything expensive, and resolved once by the command.

`validate` runs every part's own check of its section (each part defines
its allowed values and limits next to the code that uses them; those of
config.train, eval and profile in training_config.py) and the checks that
span sections (rows against the position table, batches against devices,
the state's split against the width, paths of an init model).

`resolve` is the command's (train.py, prepare.py, ...): it returns the
config a run uses, which the command hands to the loop. Config flows one
way: this module imports nothing of training/.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import ml_collections
from absl import logging

from mlm_jax import phases
from mlm_jax import saved_config
from mlm_jax import training_config
from mlm_jax.errors import ConfigError
from mlm_jax.errors import require
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import paths
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import sentence_pairs
from mlm_jax.data import tokenizer
from mlm_jax.interop import hub
from mlm_jax.model import config as model_config

__all__ = ['ConfigError', 'resolve', 'validate']


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
  training_config.check_train(config.train)
  training_config.check_eval(config.eval)
  training_config.check_profile(config.profile)
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
  plan = phases.check(config)  # The phases and the batch warm-up.
  if config.get('phases'):
    for phase in plan:  # Each phase is a whole config of its own.
      validate(phase.config, num_devices, check_paths)


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
    require(os.path.isdir(os.path.expanduser(init.hf_dir)) or hub.is_hub_id(init.hf_dir),
            f'config.init.hf_dir={init.hf_dir!r}: no such directory, nor a hub id '
            '(org/name or org/name@revision).')
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

  The final config is validated once. The init model's tokenizer is loaded
  here to check it against the checkpoint's table; tokenizer.load keeps it,
  so that prepare gets the same one without reading it again.
  """
  init, overrides = config.init, set(overrides)
  require(not (config.get('phases') and 'train.num_steps' in overrides),
          'config.train.num_steps is given, but the run is in phases (config.phases), whose '
          'lengths set the steps: give each phase its steps or tokens instead.')
  if not (init.hf_dir or init.workdir):
    validate(config, num_devices=num_devices)
    return config
  _check_init(config)  # Where the model comes from, before it is read.
  source, fields, tokenizer_path, pinned = _init_source(init)
  overrides = set(overrides)
  config = config.copy_and_resolve_references()
  if pinned:
    # The commit the hub id resolved to, recorded in the run's config.json: a resumed or
    # re-read run reads exactly these files again, whatever the branch points to later.
    logging.info('config.init.hf_dir=%r is %s, read from %s', init.hf_dir, pinned, source)
    config.init.hf_dir = pinned
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
    require('tokenizer.model_file' in overrides or paths.absolute(tok.model_file)
            == paths.absolute(tokenizer_path),
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
  validate(config, num_devices=num_devices)
  _check_vocab(config, source)
  return config


def _init_source(init: ml_collections.ConfigDict) -> tuple[str, dict[str, Any], str, str | None]:
  """(where, config.model fields of its model, its tokenizer's path, the pinned hub id
  'org/name@commit' or None for a local directory) of config.init's model."""
  if init.hf_dir:
    from mlm_jax.interop import hf  # pylint: disable=import-outside-toplevel  # interop extra
    try:
      resolved = hub.resolve(init.hf_dir, 'config.init.hf_dir')
    except ValueError as e:
      raise ConfigError(str(e)) from e
    hf_dir = resolved.local_dir
    try:
      fields = hf.checkpoint_model_fields(hf_dir)
    except (ValueError, FileNotFoundError) as e:
      raise ConfigError(f'config.init.hf_dir={init.hf_dir!r}: {e}') from e
    tokenizer_path = tokenizer.tokenizer_files(hf_dir)
    require(tokenizer_path is not None,
            f'config.init.hf_dir={init.hf_dir!r} has no tokenizer files (tokenizer.json, '
            'vocab.txt, or an mlm_jax tokenizer.model), so its ids cannot be matched to text: '
            'copy the tokenizer files published with the model into it.')
    return hf_dir, fields, tokenizer_path, resolved.pinned
  workdir = os.path.expanduser(init.workdir)
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = saved_config.read(json.load(f), os.path.join(workdir, 'config.json'))
  fields = {k: saved.model[k] for k in ARCHITECTURE_FIELDS + RECIPE_FIELDS}
  fields['vocab_size'] = saved.resolved.vocab_size
  tokenizer_path = tokenizer.tokenizer_files(workdir)
  require(tokenizer_path is not None,
          f'config.init.workdir={init.workdir!r} holds no tokenizer (tokenizer.model or '
          'tokenizer/): it was not written by a training run.')
  return workdir, fields, tokenizer_path, None


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
