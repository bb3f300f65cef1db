"""The field table: what every config field is, said once.

Each field of every section (configs/base.py defines and comments them all)
has a role:

  SHAPE         the parameters' layout: a checkpoint decides it (config.model), a phase
                keeps it, and a checkpoint restored into the run must agree with it
                (`shape_record`)
  ARCHITECTURE  what the network computes, beyond its parameters: a checkpoint decides it,
                a phase keeps it
  RECIPE        how the model is trained; a phase may change it; a checkpoint's own value
                is suggested for the few model fields marked `checkpoint=SUGGESTS`
  ROWS          names a prepared data dir: the rows depend on it (`rows_key`, which is both
                the data dir's fingerprint and the phases' "same rows")
  DRAW          changes the input stream (order, masks), not the rows
  RUNTIME       changes no result: speed, memory, cadence, where things are written

and the value a saved run that lacks it (one written before the field
existed) is read with: what that run did. A field without one is refused in
such a run (config/saved.py), since what the older run did cannot be known.

Every list of fields elsewhere (the checkpoint's decisions in run_plan.py,
what a phase may change in phases.py, the shape record of checkpoints, the
saved-run defaults) is derived from this table. Adding a field: its default
and comment in configs/base.py, its row here, and the code that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

SHAPE = 'shape'
ARCHITECTURE = 'architecture'
RECIPE = 'recipe'
ROWS = 'rows'
DRAW = 'draw'
RUNTIME = 'runtime'
ROLES = (SHAPE, ARCHITECTURE, RECIPE, ROWS, DRAW, RUNTIME)

# What a checkpoint of config.init does to a config.model field.
DECIDES = 'decides'    # Its value replaces the config's; a contradicting override is refused.
SUGGESTS = 'suggests'  # Its value unless the command line gives one.

# What a phase may do to a field (config.phases).
FREE = 'free'
FIXED = 'fixed'                  # Held for the whole run.
WITH_FRESH_OPTIMIZER = 'fresh'   # Changed only by a phase with fresh_optimizer=True.

_REFUSED = object()  # No value for a saved run without the field: such a run is refused.
_BY_ROLE = object()  # A checkpoint decides SHAPE and ARCHITECTURE fields of config.model.


@dataclasses.dataclass(frozen=True)
class Field:
  """One field's row: its role, and the value an older saved run without it gets.

  modern: the role for model.variant='modern' where it differs (a rotary model's
  max_position_embeddings sizes no table; a checkpoint then only SUGGESTS it).
  checkpoint and phase default from the role: SHAPE and ARCHITECTURE fields of
  config.model are DECIDES, and every SHAPE and ARCHITECTURE field is FIXED.
  """
  role: str
  old: Any = _REFUSED
  modern: str | None = None
  checkpoint: Any = _BY_ROLE
  phase: str | None = None

  def role_for(self, variant: str) -> str:
    return self.modern if (variant == 'modern' and self.modern) else self.role

  @property
  def has_old(self) -> bool:
    return self.old is not _REFUSED


def _f(role: str, old: Any = _REFUSED, **kw) -> Field:
  return Field(role, old, **kw)


# The sections of the config and their fields, in configs/base.py's order. Top-level fields
# (seed, phases) are in section ''.
TABLE: dict[str, dict[str, Field]] = {
    '': {
        'seed': _f(DRAW, phase=FIXED),  # Init, data order, masks, dropout: the whole run's.
        'phases': _f(RECIPE, ()),  # One phase: the config itself.
    },
    'data': {
        'corpus': _f(ROWS),
        'document_split': _f(ROWS),
        'text_key': _f(ROWS),
        'ids_key': _f(ROWS, ''),
        # Members' draw fields (mixture.DRAW_FIELDS) are taken out in rows_key.
        'sources': _f(ROWS, ()),
        'temperature': _f(DRAW, None),
        'tfds_name': _f(ROWS),
        'tfds_data_dir': _f(ROWS),
        'split': _f(ROWS),
        'num_workers': _f(RUNTIME),
        'data_dir': _f(RUNTIME),  # Where the rows are, not what they are.
        'tfds_export': _f(RUNTIME, False),
        'seq_len': _f(ROWS),
        'row_layout': _f(ROWS, 'packed'),
        'chunk_min_tokens': _f(ROWS, 0),
        'chunk_drop_tokens': _f(ROWS, 0),
        'val_fraction': _f(ROWS),
        'split_seed': _f(ROWS),
    },
    # The ids must mean the same pieces throughout a run.
    'tokenizer': {name: _f(ROWS, phase=FIXED) for name in (
        'kind', 'vocab_size', 'model_type', 'character_coverage', 'lowercase', 'max_sentences',
        'model_file', 'add_tokens')},
    'masking': {
        'max_predictions': _f(DRAW),
        'select_rate': _f(DRAW),
        'rate_schedule': _f(DRAW, 'constant'),
        'final_select_rate': _f(DRAW, 0.0),
        'rate_change_tokens': _f(DRAW, 0),
        'mask_prob': _f(DRAW),
        'random_prob': _f(DRAW),
        'random_source': _f(DRAW),
        'mode': _f(DRAW),
        'span_p': _f(DRAW),
        'span_max_length': _f(DRAW),
    },
    'sentence_pair': {
        'task': _f(SHAPE),  # The pair head's parameters.
        'loss_weight': _f(RECIPE),
    },
    'input': {
        'worker_count': _f(RUNTIME),
        'prefetch': _f(RUNTIME),
    },
    'model': {
        'variant': _f(SHAPE),
        'vocab_size': _f(SHAPE),
        'num_layers': _f(SHAPE),
        'hidden_size': _f(SHAPE),
        'num_heads': _f(SHAPE),
        'intermediate_size': _f(SHAPE),
        # A learned position table has a row per position; rotary positions size nothing, and
        # a recipe lengthens them (ModernBERT's context extension).
        'max_position_embeddings': _f(SHAPE, modern=RECIPE),
        'type_vocab_size': _f(SHAPE),
        'dropout_rate': _f(RECIPE, checkpoint=SUGGESTS),
        'attention_dropout_rate': _f(RECIPE, checkpoint=SUGGESTS),
        # No checkpoint format holds it; runs saved before it had none.
        'attention_output_dropout_rate': _f(RECIPE, 0.0),
        'initializer_range': _f(RECIPE, checkpoint=SUGGESTS),
        'layer_norm_eps': _f(ARCHITECTURE),
        'dtype': _f(RECIPE),
        'attention': _f(RUNTIME),
        'document_mask': _f(RECIPE, False),
        'restart_positions': _f(RECIPE, False),
        # Stacked parameters: their layout, which no published checkpoint decides.
        'scan_layers': _f(SHAPE, checkpoint=None),
        'remat': _f(RUNTIME),
        'drop_token_rate': _f(RECIPE),
        'global_attn_every_n_layers': _f(ARCHITECTURE),
        'local_attention': _f(ARCHITECTURE),
        # ModernBERT raises the global layers' base from 10,000 to 160,000 for 8,192 tokens.
        'global_rope_theta': _f(RECIPE, checkpoint=SUGGESTS),
        'local_rope_theta': _f(RECIPE, checkpoint=SUGGESTS),
    },
    'mesh': {
        'fsdp': _f(RUNTIME, phase=FIXED),  # The state's layout carries over a boundary.
    },
    'train': {
        'batch_size': _f(RECIPE),
        'num_steps': _f(RECIPE),
        'grad_accum_steps': _f(RUNTIME),
        'batch_warmup_tokens': _f(RECIPE, 0, phase=FIXED),  # The run's, from its first step.
        'batch_warmup_start': _f(RECIPE, 0, phase=FIXED),
        'concurrent_chains': _f(RUNTIME),
        'learning_rate': _f(RECIPE),
        'warmup_steps': _f(RECIPE),
        'schedule': _f(RECIPE),
        'decay_fraction': _f(RECIPE),
        'decay_shape': _f(RECIPE),
        'final_lr_ratio': _f(RECIPE, 0.0),  # Schedules decayed to 0.
        'optimizer': _f(RECIPE, 'adamw', phase=WITH_FRESH_OPTIMIZER),
        'weight_decay': _f(RECIPE),
        'adam_b1': _f(RECIPE),
        'adam_b2': _f(RECIPE),
        'adam_eps': _f(RECIPE),
        'grad_clip_norm': _f(RECIPE),
        'ema_decay': _f(RECIPE, 0.0, phase=FIXED),  # The average is part of the state.
        'log_every': _f(RUNTIME),
        'eval_every': _f(RUNTIME),
        'checkpoint_every': _f(RUNTIME),
        'keep_checkpoints': _f(RUNTIME),
        'tensorboard': _f(RUNTIME),
    },
    'init': {
        'hf_dir': _f(RECIPE, phase=FIXED),
        'workdir': _f(RECIPE, phase=FIXED),
        'step': _f(RECIPE, 0, phase=FIXED),        # Runs saved before it: their init's latest.
        'branch': _f(RECIPE, False, phase=FIXED),  # Runs saved before it: weights only.
        'composer': _f(RECIPE, '', phase=FIXED),  # Runs saved before it started from no file.
    },
    'eval': {
        'batch_size': _f(RUNTIME),
        'max_batches': _f(RECIPE),
        'mask_seed': _f(RECIPE),
    },
    'profile': {
        'start_step': _f(RUNTIME),
        'num_steps': _f(RUNTIME),
        'trace_python': _f(RUNTIME),
        'peak_tflops': _f(RUNTIME),
    },
}


def _name(section: str, key: str) -> str:
  return f'{section}.{key}' if section else key


def field(section: str, key: str) -> Field:
  return TABLE[section][key]


def names() -> list[str]:
  """Every field as 'section.key' ('seed' for a top-level one)."""
  return [_name(s, k) for s, fields in TABLE.items() for k in fields]


def old_values() -> dict[str, Any]:
  """{'section.key': the value a saved run without the field is read with}."""
  return {_name(s, k): f.old for s, fields in TABLE.items() for k, f in fields.items()
          if f.has_old}


def _phase_rule(section: str, f: Field, variant: str) -> str:
  if f.phase is not None:
    return f.phase
  return FIXED if f.role_for(variant) in (SHAPE, ARCHITECTURE) else FREE


def phase_rules(variant: str) -> dict[str, str]:
  """{'section.key': FIXED or WITH_FRESH_OPTIMIZER} for every field a phase may not freely
  change, for a model of `variant`."""
  out = {}
  for s, fields in TABLE.items():
    for k, f in fields.items():
      rule = _phase_rule(s, f, variant)
      if rule != FREE:
        out[_name(s, k)] = rule
  return out


def checkpoint_fields(variant: str) -> dict[str, str]:
  """{config.model field: DECIDES or SUGGESTS} for a checkpoint of `variant` (config.init)."""
  out = {}
  for k, f in TABLE['model'].items():
    role = f.role_for(variant)
    if role != f.role:  # The variant makes it a recipe's: the checkpoint's value, unless given.
      rule = SUGGESTS
    elif f.checkpoint is _BY_ROLE:
      rule = DECIDES if role in (SHAPE, ARCHITECTURE) else None
    else:
      rule = f.checkpoint
    if rule:
      out[k] = rule
  return out


def shape_record(cfg: Any) -> dict[str, Any]:
  """What a checkpoint's parameters must agree with to be loaded into the model of `cfg` (a
  model.ModelConfig): its SHAPE fields, the padded vocabulary and the sentence-pair head."""
  keys = [k for k, f in TABLE['model'].items() if f.role_for(cfg.variant) == SHAPE]
  return {**{k: getattr(cfg, k) for k in keys}, 'padded_vocab_size': cfg.padded_vocab_size,
          'sentence_pair_head': cfg.sentence_pair_head}


def _strip_draw(source: Mapping[str, Any], draw_fields: tuple[str, ...]) -> dict[str, Any]:
  return {k: v for k, v in dict(source).items() if k not in draw_fields}


# A mixture member's fields that say how it is drawn and reported (data/mixture.py reads them):
# the member's rows do not depend on them.
MEMBER_DRAW_FIELDS = ('weight', 'max_epochs', 'name', 'tokens')


def rows_key(data: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config.data fields the prepared rows depend on (ROWS), with each mixture member's
  draw fields left out: equal keys (and the run's one tokenizer) mean the same rows, and the
  data dir's fingerprint is made from it (data/prepared.py)."""
  out = {}
  for k, f in TABLE['data'].items():
    if f.role != ROWS:
      continue
    value = data.get(k, f.old if f.has_old else None)
    if k == 'sources':
      value = [_strip_draw(s, MEMBER_DRAW_FIELDS) for s in (value or ())]
    elif isinstance(value, ml_collections.ConfigDict):
      value = value.to_dict()
    out[k] = value
  return out


def same_rows(a: ml_collections.ConfigDict, b: ml_collections.ConfigDict) -> bool:
  """Whether two configs (phases of one run) read the same prepared rows."""
  return rows_key(a.data) == rows_key(b.data)


def data_request(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict,
                                                              ml_collections.ConfigDict,
                                                              dict[str, Any]]:
  """(config.data, config.tokenizer, the rows key): what the data stages and the reader take
  (data/prepare.py's prepare, data/prepared.py's load_prepared), never the whole config."""
  return config.data, config.tokenizer, rows_key(config.data)
