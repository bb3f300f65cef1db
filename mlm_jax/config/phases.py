"""A run in phases (config.phases), and the plan of every step: phase, batch, rows, masking rate.

A recipe such as ModernBERT's is one long run whose row length, masking
rate, rotary base, data and learning-rate shape change between phases:

  config.phases = (
      dict(name='pretrain', tokens=..., overrides=dict(train=dict(schedule='constant'))),
      dict(name='context', steps=..., overrides=dict(data=dict(seq_len=8192))),
      dict(name='decay', steps=..., fresh_optimizer=False,
           overrides=dict(train=dict(schedule='decay', decay_shape='1-sqrt'))),
  )

Each phase is the config of the phase before it (the first: the config
itself) with its `overrides` applied, section by section; it lasts `steps`
optimizer steps or `tokens` tokens (rows x seq_len). The phases run in
order in one workdir, the step count going on: phase i covers the global
steps [start, end). The optimizer's moments carry over a boundary, unless
the phase asks for `fresh_optimizer`; its learning rate is the phase's
schedule over the phase's own steps (optimizer.run_schedule joins them).
A phase may not change the model's shape (the parameters carry over).

`Plan` is the arithmetic of a run, phases or not: the global batch of every
step (the batch warm-up, config.train.batch_warmup_*: the batch grows a
start size at a time to train.batch_size, each size for as many steps, over
a number of tokens from the run's start), the stream rows before a step, the nominal
tokens (rows x T) before it, and the masking rate of every step. A config
without phases is a plan of one phase whose config is the config itself.

This module is config arithmetic only (no JAX): the config check, the
trainer, the input pipeline and the pre-flight all read the same plan.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

from mlm_jax.config import fields
from mlm_jax.data import masking
from mlm_jax.errors import ConfigError
from mlm_jax.errors import require

# What a phase entry may hold.
PHASE_KEYS = ('name', 'steps', 'tokens', 'fresh_optimizer', 'overrides')


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase: the global steps [start_step, end_step) and the config they train with.

  `config.train.num_steps` is end_step (the loop's last step); the phase's
  learning-rate schedule spans its own end_step - start_step steps.
  """

  index: int
  name: str
  start_step: int
  end_step: int
  fresh_optimizer: bool
  config: ml_collections.ConfigDict

  @property
  def num_steps(self) -> int:
    return self.end_step - self.start_step

  def schedule_train(self) -> ml_collections.ConfigDict:
    """This phase's config.train with num_steps = its own length: what its schedule spans."""
    train = copy.deepcopy(self.config.train)
    train.num_steps = self.num_steps
    return train


@dataclasses.dataclass(frozen=True)
class _Level:
  """Steps [start, start + count) of a run, each with `batch` rows."""
  start: int
  count: int
  batch: int
  rows_before: int  # Rows of the stream before step `start`.
  tokens_before: int  # Nominal tokens (rows x T) before step `start`.
  seq_len: int


class Plan:
  """Every step of a run: its phase, global batch, stream rows and nominal tokens before it,
  and masking rate. Steps count from 0 (step s trains on global batch s)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.phased = bool(config.get('phases'))
    self.phases: list[Phase] = []
    self._levels: list[_Level] = []
    rows = tokens = step = 0
    entries = config.phases if self.phased else ({'name': 'main', 'steps': config.train.num_steps},)
    previous = config
    for index, entry in enumerate(entries):
      entry = _check_entry(entry, index)
      phase_config = _apply(previous, entry) if self.phased else config
      if self.phased:
        if index:  # The batch warm-up is the run's, inside its first phase.
          with phase_config.train.ignore_type():
            phase_config.train.batch_warmup_tokens = phase_config.train.batch_warmup_start = 0
        _check_data_dir(config, phase_config, entry['name'])
      t = phase_config.data.seq_len
      ramp = _warmup_levels(config.train, t, phase_config.train.batch_size) if index == 0 else []
      phase_tokens = tokens
      levels, step_end = [], step
      for count, batch in ramp:
        levels.append(_Level(step_end, count, batch, rows, tokens, t))
        rows, tokens, step_end = rows + count * batch, tokens + count * batch * t, step_end + count
      full = phase_config.train.batch_size
      ramp_tokens = tokens - phase_tokens
      if entry['tokens']:
        require(ramp_tokens <= entry['tokens'],
                f"config.phases[{index}] ({entry['name']!r}) lasts {entry['tokens']:,} tokens but "
                f'the batch warm-up (config.train.batch_warmup_tokens='
                f'{config.train.batch_warmup_tokens:,}) takes {ramp_tokens:,}: shorten the '
                'warm-up or lengthen the phase.')
        rest = math.ceil((entry['tokens'] - ramp_tokens) / (full * t))
      else:
        ramp_steps = step_end - step
        require(ramp_steps <= entry['steps'],
                f"config.phases[{index}] ({entry['name']!r}) lasts {entry['steps']:,} steps but "
                f'the batch warm-up (config.train.batch_warmup_tokens='
                f'{config.train.batch_warmup_tokens:,}) takes {ramp_steps:,}: shorten the '
                'warm-up or lengthen the phase.')
        rest = entry['steps'] - ramp_steps
      if rest:
        levels.append(_Level(step_end, rest, full, rows, tokens, t))
        rows, tokens, step_end = rows + rest * full, tokens + rest * full * t, step_end + rest
      require(step_end > step, f"config.phases[{index}] ({entry['name']!r}) has no steps.")
      if self.phased:
        with phase_config.train.ignore_type():
          phase_config.train.num_steps = step_end
      phase = Phase(index, entry['name'], step, step_end, bool(entry['fresh_optimizer']),
                    phase_config)
      self.phases.append(phase)
      self._levels.extend(levels)
      step, previous = step_end, phase_config
    self.num_steps = step
    # Per level: its first step, rows per step, rows and tokens before it, tokens per step.
    self._starts, self._batch, self._rows0, self._tokens0, self._per_step = (
        np.array(column, np.int64) for column in zip(*(
            (lv.start, lv.batch, lv.rows_before, lv.tokens_before, lv.batch * lv.seq_len)
            for lv in self._levels)))
    for phase in self.phases:
      _check_phase_schedules(phase, self)

  # ------------------------------------------------------------- per step
  def phase_at(self, step: int) -> Phase:
    """The phase of step `step`; the last phase from the run's end on."""
    for phase in self.phases:
      if step < phase.end_step:
        return phase
    return self.phases[-1]

  def _level(self, steps: np.ndarray) -> np.ndarray:
    return np.searchsorted(self._starts, np.asarray(steps, np.int64), side='right') - 1

  def batch_size(self, steps: int | np.ndarray) -> np.ndarray:
    """The global batch (real rows) of each step."""
    return self._batch[self._level(np.minimum(steps, self.num_steps - 1))]

  def rows_before(self, steps: int | np.ndarray) -> np.ndarray:
    """Rows of the stream that the steps before each step drew."""
    steps = np.asarray(steps, np.int64)
    levels = self._level(np.minimum(steps, self.num_steps))
    return self._rows0[levels] + (steps - self._starts[levels]) * self._batch[levels]

  def tokens_before(self, steps: int | np.ndarray) -> np.ndarray:
    """Nominal tokens (rows x T) of the steps before each step."""
    steps = np.asarray(steps, np.int64)
    levels = self._level(np.minimum(steps, self.num_steps))
    return self._tokens0[levels] + (steps - self._starts[levels]) * self._per_step[levels]

  def steps_for_tokens(self, start_step: int, tokens: int) -> int:
    """Steps from `start_step` until at least `tokens` more nominal tokens have been seen."""
    goal = int(self.tokens_before(start_step)) + tokens
    lo, hi = start_step, self.num_steps
    while lo < hi:  # The first step s with tokens_before(s) >= goal.
      mid = (lo + hi) // 2
      if self.tokens_before(mid) >= goal:
        hi = mid
      else:
        lo = mid + 1
    return lo - start_step

  def positions(self, steps: np.ndarray, capacity: int, micro_batches: int) -> np.ndarray:
    """[n, capacity] stream positions of the rows of each step's global batch; -1: padding.

    A step of b = j x (capacity / micro_batches) real rows fills micro-batches
    0 .. j-1 of the compiled step (rows r with r mod micro_batches < j, as
    step.split_rows deals them out); the others are padding rows. A full
    batch is the stream's next `capacity` rows in order.
    """
    steps = np.asarray(steps, np.int64)
    micro = capacity // micro_batches
    used = (self.batch_size(steps) // micro)[:, None]                  # [n, 1] j
    r = np.arange(capacity)[None, :]
    position = self.rows_before(steps)[:, None] + (r // micro_batches) * used + r % micro_batches
    return np.where(r % micro_batches < used, position, -1)

  def masking_rate(self, steps: int | np.ndarray) -> np.ndarray:
    """The masking (selection) rate of each step: its phase's config.masking schedule."""
    steps = np.atleast_1d(np.asarray(steps, np.int64))
    out = np.empty(len(steps), np.float64)
    for i, step in enumerate(steps):
      phase = self.phase_at(int(step))
      schedule = self.rate_schedule(phase)
      out[i] = phase.config.masking.select_rate if schedule is None else schedule.rate_at(step)
    return out

  def rate_schedule(self, phase: Phase) -> masking.RateSchedule | None:
    """A phase's masking-rate schedule over global steps; None: select_rate throughout.

    config.masking.rate_schedule: 'linear' moves from select_rate to
    final_select_rate over rate_change_tokens from the phase's start (0: the
    whole phase), then holds; 'step' switches there.
    """
    m = phase.config.masking
    change = m.get('rate_change_tokens', 0)
    end = (phase.start_step + self.steps_for_tokens(phase.start_step, change) if change
           else phase.end_step)
    return masking.RateSchedule.from_config(m, phase.start_step, end)

  def describe(self) -> list[dict[str, Any]]:
    """A row per phase: the plan as recorded in WORKDIR/phases.json and logged."""
    out = []
    for p in self.phases:
      c = p.config
      out.append({'phase': p.name, 'start_step': p.start_step, 'end_step': p.end_step,
                  'tokens': int(self.tokens_before(p.end_step) - self.tokens_before(p.start_step)),
                  'seq_len': c.data.seq_len, 'batch_size': c.train.batch_size,
                  'select_rate': c.masking.select_rate, 'schedule': c.train.schedule,
                  'learning_rate': c.train.learning_rate, 'optimizer': c.train.optimizer,
                  'fresh_optimizer': p.fresh_optimizer})
    return out


# ---------------------------------------------------------------- checks


def check(config: ml_collections.ConfigDict) -> list[Phase]:
  """ConfigError for invalid phases or batch warm-up; the phases (one without config.phases)."""
  _check_warmup_fields(config.train)
  return Plan(config).phases


def _check_entry(entry: Mapping[str, Any], index: int) -> dict[str, Any]:
  require(isinstance(entry, Mapping),
          f'config.phases[{index}] must be a dict (name, steps or tokens, overrides), not '
          f'{type(entry).__name__}.')
  unknown = sorted(set(entry) - set(PHASE_KEYS))
  require(not unknown, f'config.phases[{index}] has unknown keys {unknown}; a phase holds '
          f'{", ".join(PHASE_KEYS)}.')
  out = {'name': entry.get('name') or f'phase{index}', 'steps': int(entry.get('steps', 0) or 0),
         'tokens': int(entry.get('tokens', 0) or 0),
         'fresh_optimizer': bool(entry.get('fresh_optimizer', False)),
         'overrides': dict(entry.get('overrides', {}) or {})}
  require((out['steps'] > 0) != (out['tokens'] > 0),
          f"config.phases[{index}] ({out['name']!r}): give its length as exactly one of steps "
          f"or tokens (> 0); it has steps={out['steps']}, tokens={out['tokens']}.")
  return out


def _apply(previous: ml_collections.ConfigDict, entry: dict[str, Any]) -> ml_collections.ConfigDict:
  """`previous` with a phase's overrides ({section: {field: value}}) applied, phases removed.

  A field the table holds for the whole run (fields.FIXED: the model's shape and
  architecture, the tokenizer, the seed, the state's layout, the batch warm-up) may not
  change; the optimizer changes only with fresh_optimizer.
  """
  name, overrides = entry['name'], entry['overrides']
  config = copy.deepcopy(previous)
  with config.ignore_type():
    config.phases = ()
  rules = fields.phase_rules(previous.model.variant)
  for section, values in overrides.items():
    if section in rules and not isinstance(values, Mapping):  # A top-level field: the seed.
      _check_rule(rules, '', section, previous[section], values, entry)
      continue
    require(section in config and isinstance(config[section], ml_collections.ConfigDict)
            and isinstance(values, Mapping),
            f'phase {name!r} overrides config.{section}, which is not a config section: write '
            'overrides as {section: {field: value}}, e.g. data=dict(seq_len=1024).')
    for key, value in values.items():
      if key in config[section]:
        _check_rule(rules, section, key, config[section][key], value, entry)
    _set(config[section], values, f'config.{section}', name)
  return config


# Why a field is held for the whole run, by its section (or field) and role.
_RUN_WIDE = ('the tokenizer and seed hold for the whole run (the ids must mean the same pieces '
             'throughout); set them outside config.phases.')
_HELD_BECAUSE = {
    'tokenizer': _RUN_WIDE,
    'seed': _RUN_WIDE,
    'train.batch_warmup_tokens': "the batch warm-up is the run's, from its first step (set it "
                                 'outside config.phases).',
    fields.ARCHITECTURE: "the model's architecture holds for the whole run (a checkpoint of it "
                         'is read as this architecture); start another run from this one with '
                         'config.init.workdir instead.',
    fields.SHAPE: 'the parameters carry over from phase to phase, so a phase cannot change the '
                  "model's shape (nor the state's layout or the batch warm-up); start another "
                  'run from this one with config.init.workdir instead.',
}


def _check_rule(rules: dict[str, str], section: str, key: str, before: Any, after: Any,
                entry: dict[str, Any]) -> None:
  """ConfigError for an override of a field the run holds (fields.phase_rules)."""
  name = f'{section}.{key}' if section else key
  rule = rules.get(name)
  if rule is None or before == after:
    return
  if rule == fields.WITH_FRESH_OPTIMIZER:
    require(entry['fresh_optimizer'],
            f"phase {entry['name']!r} sets config.{name}={after!r}, but the run has "
            f'{before!r}: a phase that changes the optimizer needs fresh_optimizer=True.')
    return
  role = fields.field(section, key).role
  why = (_HELD_BECAUSE.get(section) or _HELD_BECAUSE.get(name)
         or _HELD_BECAUSE.get('train.batch_warmup_tokens' if 'batch_warmup' in key else '')
         or _HELD_BECAUSE.get(role) or _HELD_BECAUSE[fields.SHAPE])
  raise ConfigError(f"phase {entry['name']!r} sets config.{name}={after!r}, but the run has "
                    f'{before!r}: {why}')


def _set(section: ml_collections.ConfigDict, values: Mapping[str, Any], where: str,
         name: str) -> None:
  for key, value in values.items():
    require(key in section, f'phase {name!r} overrides {where}.{key}, which does not exist.')
    if isinstance(section[key], ml_collections.ConfigDict) and isinstance(value, Mapping):
      _set(section[key], value, f'{where}.{key}', name)
      continue
    try:
      section[key] = value
    except TypeError as e:
      raise ConfigError(f'phase {name!r}: {where}.{key}={value!r}: {e}') from e


def _check_data_dir(first: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                    name: str) -> None:
  """A phase that prepares other rows (another length or corpus) needs a data dir of its own."""
  if not first.data.data_dir or fields.same_rows(first, config):
    return
  require(config.data.data_dir != first.data.data_dir,
          f'phase {name!r} changes config.data but keeps config.data.data_dir='
          f'{first.data.data_dir!r}, which holds the first phase\'s rows: give the phase its '
          "own data_dir in its overrides (or leave data_dir empty: a cache dir per setting).")


def _check_warmup_fields(train: ml_collections.ConfigDict) -> None:
  tokens, start = train.batch_warmup_tokens, train.batch_warmup_start
  require(tokens >= 0, f'config.train.batch_warmup_tokens={tokens} must be >= 0 (0: no '
          'batch warm-up).')
  if not tokens:
    return
  k, full = train.grad_accum_steps, train.batch_size
  micro = full // k
  require(k > 1, 'config.train.batch_warmup_tokens grows the batch a micro-batch at a time: set '
          'config.train.grad_accum_steps to the number of micro-batches of the full batch (e.g. '
          f'{full // max(start, 1)} to start at {start}).')
  require(0 < start < full and start % micro == 0,
          f'config.train.batch_warmup_start={start} must be a multiple of the micro-batch '
          f'(batch_size / grad_accum_steps = {micro}) below batch_size={full}.')
  require(full % start == 0,
          f'config.train.batch_warmup_start={start}: the batch grows a start size at a time '
          f'({start}, {2 * start}, ...), so batch_size={full} must be a multiple of it (e.g. '
          f'batch_warmup_start={_divisor_near(full, micro, start)}).')


def _divisor_near(full: int, micro: int, start: int) -> int:
  """The multiple of `micro` dividing `full` (below it) nearest `start`: an example in an error."""
  choices = [m for m in range(micro, full, micro) if full % m == 0] or [micro]
  return min(choices, key=lambda m: abs(m - start))


def _warmup_levels(train: ml_collections.ConfigDict, seq_len: int,
                   full: int) -> list[tuple[int, int]]:
  """(steps, batch) of each batch size of the warm-up, from the run's start.

  As FlexBERT's sequence packer warms its batch up (ModernBERT's src/sequence_packer.py,
  BatchSizeWarmupScheduler): the batch is start, 2 x start, ... up to below the full batch,
  each size for the same number of steps. Size k x start ends once the tokens reach
  ceil(w x (1 + ... + k) / (1 + ... + n-1)), n = batch_size / start, so the sizes together
  take batch_warmup_tokens w and the full batch starts with the first step after them.
  """
  w, start = train.batch_warmup_tokens, train.batch_warmup_start
  if not w:
    return []
  sizes = range(1, full // start)
  per_unit = w / sum(sizes)
  levels, tokens, units = [], 0, 0
  for k in sizes:
    units += k
    until = math.ceil(per_unit * units)
    count = max(0, math.ceil((until - tokens) / (k * start * seq_len)))
    if count:
      levels.append((count, k * start))
      tokens += count * k * start * seq_len
  return levels


def _check_phase_schedules(phase: Phase, plan: Plan) -> None:
  """The phase's learning-rate warm-up and masking-rate change fit inside it."""
  if not plan.phased:
    return
  train, masking = phase.config.train, phase.config.masking
  require(train.warmup_steps <= phase.num_steps,
          f'phase {phase.name!r}: config.train.warmup_steps={train.warmup_steps} is longer than '
          f'the phase ({phase.num_steps} steps); the schedule must fit its phase (a phase '
          'inherits the one before it: set warmup_steps=0 in a phase that does not warm up).')
  change = masking.get('rate_change_tokens', 0)
  if masking.get('rate_schedule', 'constant') != 'constant' and change:
    phase_tokens = int(plan.tokens_before(phase.end_step) - plan.tokens_before(phase.start_step))
    require(change <= phase_tokens,
            f'phase {phase.name!r}: config.masking.rate_change_tokens={change:,} is longer than '
            f'the phase ({phase_tokens:,} tokens).')


def learning_rate_offset(plan: Plan, phase: Phase) -> int:
  """The global step at which the optimizer of `phase` started (its last fresh start)."""
  start = 0
  for p in plan.phases[:phase.index + 1]:
    if p.fresh_optimizer:
      start = p.start_step
  return start
