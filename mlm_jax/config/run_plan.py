"""The command's config resolved once into a frozen run plan, which the loop receives.

`resolve` checks the whole config (config/checks.py), fills in what a
checkpoint of config.init decides, and returns a `RunPlan`: the resolved
config, the arithmetic of every step (phases.Plan) and every phase's own
config, the later phases' tokenizer decided here. Nothing downstream patches
a config: the loop takes each phase's config as the plan gives it. Config
flows one way: this package imports nothing of training/.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

import ml_collections
from absl import logging

from mlm_jax.config import checks
from mlm_jax.config import fields as field_table
from mlm_jax.config import phases
from mlm_jax.config import saved
from mlm_jax.data import paths
from mlm_jax.data import prepared
from mlm_jax.data import tokenizer
from mlm_jax.errors import ConfigError
from mlm_jax.errors import require
from mlm_jax.interop import hub


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """A run as it will go: its resolved config, and every step's phase, batch and rows.

  `plan.phases[i].config` is phase i's whole config: the run's config with the
  overrides of phases 0..i applied and, where the phase reads other rows than
  the first (another corpus or row length), the run's tokenizer
  (WORKDIR/tokenizer.model or WORKDIR/tokenizer/, written by the first phase)
  named in config.tokenizer.model_file, so that the ids keep their meaning.
  """
  config: ml_collections.ConfigDict
  plan: phases.Plan

  @property
  def phases(self) -> tuple[phases.Phase, ...]:
    return tuple(self.plan.phases)


def plan_run(config: ml_collections.ConfigDict, workdir: str | None = None) -> RunPlan:
  """The RunPlan of a config that is resolved already (`resolve` calls it; so do tests and
  tools that build a config in code). `workdir`: where the run writes, which names the
  later phases' tokenizer; None for a tool that trains no phases (bench, pre-flight)."""
  plan = phases.Plan(config)
  if plan.phased and workdir is not None:
    _decide_phase_tokenizers(plan, config, os.path.abspath(workdir))
  return RunPlan(config, plan)


def _decide_phase_tokenizers(plan: phases.Plan, config: ml_collections.ConfigDict,
                             workdir: str) -> None:
  """A phase whose rows differ from the first phase's reads the run's tokenizer, which the first
  phase trained (or was given), so that its ids mean the same pieces."""
  tok = config.tokenizer
  if tok.model_file or config.init.hf_dir or config.init.workdir:
    return  # A given tokenizer: every phase names it already.
  name = prepared.SP_TOKENIZER if tok.kind == 'sentencepiece' else prepared.HF_TOKENIZER
  first = plan.phases[0].config
  for phase in plan.phases[1:]:
    if not field_table.same_rows(phase.config, first):
      phase.config.tokenizer.model_file = os.path.join(workdir, name)


def resolve(config: ml_collections.ConfigDict, num_devices: int | None,
            overrides: Iterable[str] = (), workdir: str | None = None) -> RunPlan:
  """The run a command starts: its config checked (ConfigError), with implied settings filled
  in, and planned (plan_run).

  A run started from config.init.hf_dir, config.init.workdir or
  config.init.composer takes the architecture, shape, vocabulary, positions
  and tokenizer from that model (a Composer checkpoint's tokenizer from
  init.hf_dir's files or tokenizer.model_file): its config.model fields are
  replaced (and logged), and a field named in `overrides` (the command
  line's --config.* keys, e.g. 'model.num_layers') that contradicts the
  checkpoint is a ConfigError. The config keeps the recipe: optimizer,
  schedule, masking, batch, data, seq_len. Which fields a checkpoint
  decides, and which it only suggests, is the field table's
  (fields.checkpoint_fields). A Composer checkpoint's run goes on from the
  file's step, so its steps (train.num_steps, or the phases) must reach past it.

  The final config is validated once. The init model's tokenizer is loaded
  here to check it against the checkpoint's table; tokenizer.load keeps it,
  so that prepare gets the same one without reading it again.
  """
  overrides = set(overrides)
  require(not (config.get('phases') and 'train.num_steps' in overrides),
          'config.train.num_steps is given, but the run is in phases (config.phases), whose '
          'lengths set the steps: give each phase its steps or tokens instead.')
  init = config.init
  if init.hf_dir or init.workdir or init.composer:
    config, source = _from_checkpoint(config, overrides, num_devices)
  else:
    checks.validate(config, num_devices=num_devices)
  run = plan_run(config, workdir)
  if init.composer or init.branch:
    _check_start(run, source)
  return run


def _from_checkpoint(config: ml_collections.ConfigDict, overrides: set[str],
                     num_devices: int | None) -> tuple[ml_collections.ConfigDict, _Source]:
  """The config with what config.init's checkpoint decides filled in, validated; and where
  its model came from."""
  checks.check_init(config)  # Where the model comes from, before it is read.
  init_source = _init_source(config)
  source, found, tokenizer_path = (init_source.where, init_source.fields,
                                   init_source.tokenizer_path)
  config = config.copy_and_resolve_references()
  for key, pinned in init_source.pinned.items():
    # The commit a hub id resolved to (a branched run's step), recorded in the run's
    # config.json: a resumed or re-read run reads exactly these files again, whatever the
    # hub's branch points to (or the run has saved) later.
    logging.info('config.init.%s=%r is %s, read from %s', key, config.init[key], pinned,
                 source)
    config.init[key] = pinned
  model = config.model
  rules = field_table.checkpoint_fields(found.get('variant', model.variant))
  for key, rule in rules.items():
    if key not in found or model[key] == found[key]:
      continue
    if f'model.{key}' in overrides:
      require(rule == field_table.SUGGESTS,
              f'config.model.{key}={model[key]!r} contradicts the checkpoint in {source} '
              f'({key}={found[key]!r}): the checkpoint decides the architecture; drop the '
              'override.')
      continue
    logging.info('config.model.%s: %r from the checkpoint in %s (the config said %r)', key,
                 found[key], source, model[key])
    with model.ignore_type():
      model[key] = found[key]
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
  checks.validate(config, num_devices=num_devices)
  _check_vocab(config, source)
  return config, init_source


@dataclasses.dataclass(frozen=True)
class _Source:
  """config.init's model: where it is, the config.model fields it decides or suggests, its
  tokenizer's path, {config.init field: its pinned value} (a hub name's 'org/name@commit[/path]',
  a branch's step), and the step its run goes on from (a Composer checkpoint's or a branched
  run's; else 0)."""
  where: str
  fields: dict[str, Any]
  tokenizer_path: str
  pinned: dict[str, Any]
  step: int = 0


def _init_source(config: ml_collections.ConfigDict) -> _Source:
  """config.init's model, read as far as the config needs it (its weights are the loop's)."""
  init = config.init
  if init.composer:
    return _composer_source(config)
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
    return _Source(hf_dir, fields, tokenizer_path,
                   {'hf_dir': resolved.pinned} if resolved.pinned else {})
  workdir = os.path.expanduser(init.workdir)
  with open(os.path.join(workdir, 'config.json')) as f:
    run = saved.read(json.load(f), os.path.join(workdir, 'config.json'))
  found = {k: run.model[k] for k in field_table.checkpoint_fields(run.model.variant)}
  found['vocab_size'] = run.resolved.vocab_size
  tokenizer_path = tokenizer.tokenizer_files(workdir)
  require(tokenizer_path is not None,
          f'config.init.workdir={init.workdir!r} holds no tokenizer (tokenizer.model or '
          'tokenizer/): it was not written by a training run.')
  if not init.branch:
    return _Source(workdir, found, tokenizer_path, {})
  _check_branch(config, run, workdir)
  # The step pinned, as a hub name is: a rerun branches where the first did, whatever that
  # run has saved since.
  step = init.step or checks.saved_steps(workdir)[-1]
  return _Source(workdir, found, tokenizer_path, {'step': step}, step=step)


def _check_branch(config: ml_collections.ConfigDict, run: ml_collections.ConfigDict,
                  workdir: str) -> None:
  """A branch carries the run's train state as it is: what lays that state out (the
  optimizer, the moving average, the sentence-pair head, stacked layers) must be the run's."""
  layout = {'train.optimizer': lambda c: c.train.optimizer,
            'train.ema_decay > 0': lambda c: c.train.ema_decay > 0,
            'sentence_pair.task': lambda c: c.sentence_pair.task,
            'model.scan_layers': lambda c: c.model.scan_layers}
  differ = [f'config.{k}: {of(config)!r}, the run\'s {of(run)!r}' for k, of in layout.items()
            if of(config) != of(run)]
  require(not differ, f'config.init.branch continues the train state of {workdir}, laid out '
          f'otherwise ({"; ".join(differ)}): use that run\'s settings, or start from its '
          'weights alone (config.init.branch=False).')


def _composer_source(config: ml_collections.ConfigDict) -> _Source:
  """A Composer checkpoint (read once per process: composer.read keeps it for the loop), its
  fields from its FlexBertConfig; the tokenizer from init.hf_dir's files (nothing else of that
  model is read or fetched) or tokenizer.model_file."""
  from mlm_jax.interop import composer  # pylint: disable=import-outside-toplevel  # interop extra
  init, pinned = config.init, {}
  try:
    located = composer.local_file(init.composer, 'config.init.composer')
    checkpoint = composer.read(init.composer, 'config.init.composer')
    if init.hf_dir:
      resolved = hub.resolve(init.hf_dir, 'config.init.hf_dir', hub.TOKENIZER_PATTERNS)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if located.pinned:
    pinned['composer'] = located.pinned
  tokenizer_path = config.tokenizer.model_file
  if init.hf_dir:
    tokenizer_path = tokenizer.tokenizer_files(resolved.local_dir)
    require(tokenizer_path is not None,
            f'config.init.hf_dir={init.hf_dir!r} has no tokenizer files (tokenizer.json or '
            'vocab.txt) for the Composer checkpoint in config.init.composer: name the model '
            'the checkpoint trains, or give its tokenizer.json as config.tokenizer.model_file.')
    if resolved.pinned:
      pinned['hf_dir'] = resolved.pinned
  return _Source(located.local_path, dict(checkpoint.model_fields), tokenizer_path, pinned,
                 checkpoint.step)


def _check_start(run: RunPlan, source: _Source) -> None:
  """A run that goes on from a Composer checkpoint's or a branched run's step must have steps
  after it."""
  end, step = run.plan.num_steps, source.step
  composer = bool(run.config.init.composer)
  counted = "the file's" if composer else "that run's"
  what = (f'config.phases end at step {end:,} (their steps count from {counted} first step)'
          if run.plan.phased else f'config.train.num_steps={end:,} (it counts {counted} steps '
          'too)')
  start = ('the Composer checkpoint in {} stands' if composer else
           'config.init.branch continues the run in {}').format(source.where)
  require(step < end,
          f'{start} at step {step:,}, and the run goes on from there, but {what}: train to step '
          f'{step:,} + the steps to take.')


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
