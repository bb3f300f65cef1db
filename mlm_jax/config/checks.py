"""The whole config checked before anything expensive: every section, and what spans them.

`validate` runs every part's own check of its section (each part defines its
allowed values and limits next to the code that uses them; those of
config.train, eval and profile in train_checks.py) and the checks that span
sections (rows against the position table, batches against devices, the
state's split against the width, paths of an init model), then every phase's
config (config.phases) as a whole config of its own.
"""

from __future__ import annotations

import os

import ml_collections

from mlm_jax.config import phases
from mlm_jax.config import train_checks
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import paths
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import sentence_pairs
from mlm_jax.data import tokenizer
from mlm_jax.errors import require
from mlm_jax.interop import hub
from mlm_jax.model import config as model_config


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
  train_checks.check_train(config.train)
  train_checks.check_eval(config.eval)
  train_checks.check_profile(config.profile)
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
    check_init(config)
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


def check_init(config: ml_collections.ConfigDict) -> None:
  """A model to start from must exist; one source at a time (a Composer checkpoint takes its
  tokenizer from init.hf_dir's files or tokenizer.model_file)."""
  init = config.init
  if init.composer:
    _check_composer(config)
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
  require(init.workdir or not (init.step or init.branch),
          f'config.init.step={init.step} and config.init.branch={init.branch} name a checkpoint '
          'of config.init.workdir, which is not set: give the --workdir of the run to start from.')
  if init.workdir:
    require(os.path.isfile(os.path.join(os.path.expanduser(init.workdir), 'config.json')),
            f'config.init.workdir={init.workdir!r} is not an mlm_jax run directory (no '
            'config.json): give the --workdir of an earlier training run.')
    steps = saved_steps(init.workdir)
    require(bool(steps), f'config.init.workdir={init.workdir!r} holds no checkpoint.')
    require(init.step == 0 or init.step in steps,
            f'config.init.step={init.step}: {init.workdir} holds checkpoints of steps '
            f'{", ".join(map(str, steps))}; give one of them (0: the latest).')
  if init.branch:
    require(not config.tokenizer.add_tokens,
            'config.tokenizer.add_tokens would grow the embedding table of the run that '
            'config.init.branch continues, whose moments are kept row for row: add the words in '
            'a run started from its weights alone (config.init.branch=False).')


def saved_steps(workdir: str) -> list[int]:
  """The steps of a run's checkpoints (WORKDIR/checkpoints/<step>/), ascending."""
  folder = os.path.join(os.path.expanduser(workdir), 'checkpoints')
  names = os.listdir(folder) if os.path.isdir(folder) else []
  return sorted(int(name) for name in names if name.isdigit())


def _check_composer(config: ml_collections.ConfigDict) -> None:
  """config.init.composer: a file (local, a bucket URL, a hub file), its tokenizer named, and
  nothing the file cannot give (a run's weights, added words, a sentence-pair head)."""
  init, name = config.init, config.init.composer
  require(not init.workdir,
          f'config.init.composer={name!r} and config.init.workdir={init.workdir!r} are both set: '
          'start from one of them.')
  require(bool(init.hf_dir or config.tokenizer.model_file),
          f'config.init.composer={name!r} holds no tokenizer: name the model it trains, '
          'e.g. --config.init.hf_dir=answerdotai/ModernBERT-base (only its tokenizer files are '
          'read), or its tokenizer.json as --config.tokenizer.model_file.')
  require(not config.tokenizer.add_tokens,
          'config.tokenizer.add_tokens would grow the embedding table of the Composer checkpoint '
          'in config.init.composer, whose moments are kept row for row: add the words in a '
          'later run started with --config.init.workdir.')
  require(config.sentence_pair.task == 'none',
          f'config.sentence_pair.task={config.sentence_pair.task!r} needs a sentence-pair head, '
          'which a FlexBERT checkpoint (config.init.composer) has not: use task=\'none\'.')
  require(paths.is_url(name) or hub.is_hub_file(name) or os.path.isfile(os.path.expanduser(name)),
          f'config.init.composer={name!r}: no such file, nor a bucket URL (gs://...) or a hub '
          'file (org/name[@revision]/path/in/repo).')
