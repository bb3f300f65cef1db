"""Weighted mixtures of corpora (config.data.sources): the members, and which rows a run draws.

`config.data.sources` is a list of corpora, each a dict:

  {'corpus': 'domain/*.jsonl', 'weight': 0.8}
  {'corpus': 'general/*.parquet', 'weight': 0.2, 'max_epochs': 4, 'name': 'general'}

with any of corpus, tfds_name, tfds_data_dir, split, text_key, ids_key and
document_split (missing ones come from config.data), a weight > 0, an
optional cap on the epochs of it a run may draw (0: none) and an optional
name for the reports (default: source0, source1, ...). All members are
prepared into one data dir, with one tokenizer, each into its own train and
validation rows.

Which row a run draws at global stream position r (step s holds positions
sB .. sB+B-1) is a function of (seed, r) alone, so a resumed run is
bit-identical and any number of processes draws the same global batch. The
members take the positions as a nested low-discrepancy sequence: member 0
gets position m iff floor(f0 (m+1) + p0) > floor(f0 m + p0), with f0 its
share of the weights and p0 a seeded phase in [0, 1); the positions it does
not take go on, renumbered, to member 1 with f1 its share of what is left,
and so on. Every window of positions then holds each member's share to within
a row per member, and how many rows each member has given up to any position
is a closed form, so a member's k-th row is found without replaying the run.
A member's k-th row is row k of its own stream: its train rows repeated,
shuffled anew each epoch (pipeline.stream_to_source). A member that reaches
its epoch cap drops out, and the others share its positions by their weights.

The weights are the members' 'weight's as given (config.data.temperature None),
or with a sampling temperature tau > 0 the shares p_k ∝ w_k n_k^(1/tau), n_k
the member's train tokens as prepare counted them (stats.json) and w_k its
'weight' (default 1), a prior multiplier: tau=1 draws in proportion to size,
tau -> inf evenly, tau < 1 favours the large members. A member whose files are
a sample of a larger corpus gives that corpus's size as 'tokens': n_k is then
that count, not its files' (`temperature_tokens`), so that the temperature
acts on the sizes it was meant for. Files that are already a mixture drawn at
some temperature (a published phase's data) want no second temperature: give
their shares as weights instead.

A mixture may continue another one from a stream position on (a later
training phase with other shares): Mixture(..., start_position=P,
rows_before=earlier.rows_drawn(P)), or earlier.continued(P, weights). From
P on, member k's j-th draw is row rows_before[k] + j of its own stream, so no
row is drawn twice within an epoch of a member across the change and each
member's epoch shuffle goes on where it was.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any, Sequence

import ml_collections
import numpy as np

from mlm_jax.errors import ConfigError
from mlm_jax.errors import require

# Fields of a member that say what corpus it is (missing ones: config.data's).
CORPUS_FIELDS = ('corpus', 'tfds_name', 'tfds_data_dir', 'split', 'text_key', 'ids_key',
                 'document_split')
# Fields of a member that say how it is drawn and reported.
DRAW_FIELDS = ('weight', 'max_epochs', 'name', 'tokens')
_NAME = re.compile(r'^[A-Za-z0-9_.-]+$')
# Shares are fractions of 2**_BITS: exact integer arithmetic for positions below 2**40.
_BITS = 22
_ONE = 1 << _BITS
# Positions a run can reach (pipeline.train_batches stops near 2**40 rows).
_END = 1 << 41


@dataclasses.dataclass(frozen=True)
class Member:
  """One corpus of a mixture: its name, weight, epoch cap (0: none), config.data section and
  the size the temperature sees (0: its train tokens as prepared)."""
  name: str
  weight: float
  max_epochs: float
  data: ml_collections.ConfigDict
  tokens: int = 0


def members(data: ml_collections.ConfigDict) -> list[Member]:
  """config.data.sources as Members (each with its own config.data); [] without a mixture."""
  out = []
  for k, entry in enumerate(data.get('sources') or ()):
    entry = dict(entry)
    section = ml_collections.ConfigDict(data.to_dict())
    del section['sources']
    for key in CORPUS_FIELDS:
      if key in entry:
        section[key] = entry[key]
    if 'corpus' in entry and 'tfds_name' not in entry:
      section.tfds_name = ''
    if 'tfds_name' in entry and 'corpus' not in entry:
      section.corpus = ''
    out.append(Member(str(entry.get('name') or f'source{k}'), float(entry.get('weight', 1.0)),
                      float(entry.get('max_epochs', 0)), section, int(entry.get('tokens', 0))))
  return out


def check_config(data: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.data.sources or config.data.temperature (not the
  sources' paths: see corpus.check)."""
  sources = data.get('sources') or ()
  temperature = data.get('temperature')
  require(temperature is None or (
      isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
      and math.isfinite(temperature) and temperature > 0),
          f'config.data.temperature={temperature!r} must be a number > 0 (tau: shares in '
          'proportion to tokens^(1/tau)), or None for the weights of config.data.sources as '
          'given.')
  require(temperature is None or (isinstance(sources, (list, tuple)) and len(sources) > 1),
          f'config.data.temperature={temperature!r} needs a mixture of two or more corpora in '
          'config.data.sources; leave it unset (None) for one corpus.')
  if not sources:
    return
  require(not data.corpus and not data.tfds_name,
          'config.data.sources and config.data.corpus (or tfds_name) are both set; name the '
          'corpora in config.data.sources only, or give one config.data.corpus.')
  require(isinstance(sources, (list, tuple)),
          f'config.data.sources={sources!r} must be a list of dicts, e.g. '
          "({'corpus': 'a/*.jsonl', 'weight': 0.8}, {'corpus': 'b.parquet', 'weight': 0.2}).")
  names = []
  for k, entry in enumerate(sources):
    field = f'config.data.sources[{k}]'
    require(isinstance(entry, (dict, ml_collections.ConfigDict)),
            f"{field}={entry!r} must be a dict such as {{'corpus': 'a/*.jsonl', 'weight': 0.5}}.")
    entry = dict(entry)
    unknown = sorted(set(entry) - set(CORPUS_FIELDS) - set(DRAW_FIELDS))
    require(not unknown, f'{field} has unknown fields {unknown}; its fields are '
            f'{sorted(CORPUS_FIELDS + DRAW_FIELDS)}.')
    require('weight' in entry or temperature,
            f"{field} has no 'weight'; give each source a weight > 0 (or set "
            'config.data.temperature > 0 to draw by size).')
    weight = entry.get('weight', 1.0)
    require(isinstance(weight, (int, float)) and not isinstance(weight, bool)
            and math.isfinite(weight) and weight > 0,
            f'{field}.weight={weight!r} must be a number > 0 (weights are relative: 0.8 and 0.2, '
            'or 4 and 1, draw the same mixture).')
    cap = entry.get('max_epochs', 0)
    require(isinstance(cap, (int, float)) and not isinstance(cap, bool)
            and math.isfinite(cap) and cap >= 0,
            f'{field}.max_epochs={cap!r} must be a number >= 0 (0: no cap).')
    tokens = entry.get('tokens', None)
    require(tokens is None or (isinstance(tokens, int) and not isinstance(tokens, bool)
                               and tokens > 0),
            f'{field}.tokens={tokens!r} must be a whole number of tokens > 0 (the size of the '
            'corpus its files sample, which the temperature sees instead of theirs).')
    require(tokens is None or temperature,
            f'{field}.tokens is the size config.data.temperature sees, which is unset: set a '
            "temperature > 0, or give the source's share as its 'weight' instead.")
    require(not (entry.get('corpus') and entry.get('tfds_name')),
            f'{field} sets both corpus and tfds_name; set one of them.')
    name = str(entry.get('name') or f'source{k}')
    require(bool(_NAME.match(name)),
            f'{field}.name={name!r} may hold only letters, digits, _, . and - (it names the '
            "source's figures in the log).")
    require(name not in names, f'{field}.name={name!r} names two sources; give each its own.')
    names.append(name)


def temperature_tokens(sources: Sequence[Member], measured: Sequence[int]) -> list[int]:
  """[K] the n_k of p_k ∝ w_k n_k^(1/tau): a member's given 'tokens', else its `measured` train
  tokens (as prepare counted them)."""
  return [m.tokens or int(n) for m, n in zip(sources, measured, strict=True)]


def draw_weights(weights: Sequence[float], tokens: Sequence[int],
                 temperature: float) -> np.ndarray:
  """[K] relative weights a Mixture draws by: `weights` unchanged at temperature 0 (so a run
  without a temperature draws exactly what it drew before it existed), else w_k n_k^(1/tau)
  scaled so that the largest is 1 (`tokens` n_k [K] > 0: each member's train tokens)."""
  w = np.asarray(weights, np.float64)
  if not temperature:
    return w
  n = np.asarray(tokens, np.float64)
  if n.shape != w.shape or not np.all(n > 0):
    raise ValueError(f'tokens {list(tokens)} must be one count > 0 per member of {list(weights)}')
  # In logs: n^(1/tau) of 1e12 tokens at tau=0.1 is past a float64.
  log = np.log(w) + np.log(n) / temperature
  return np.exp(log - log.max())


def shares(weights: Sequence[float], tokens: Sequence[int], temperature: float) -> np.ndarray:
  """[K] the fraction of rows each member is drawn for, summing to 1: p_k ∝ w_k n_k^(1/tau)
  (tau > 0), or ∝ w_k (tau = 0); the members' epoch caps aside."""
  w = draw_weights(weights, tokens, temperature)
  return w / w.sum()


def _phase(seed: int, phase: int, level: int) -> int:
  """A seeded offset in [0, _ONE) of one level of one phase."""
  return zlib.crc32(f'{seed}:{phase}:{level}'.encode()) % _ONE


@dataclasses.dataclass(frozen=True)
class _Phase:
  """Positions over which one set of members is drawn, until an epoch cap ends one (not a
  training phase: a continuing Mixture is that)."""
  start: int                 # First global position of the phase.
  active: tuple[int, ...]    # Members drawn in it, in order.
  shares: tuple[int, ...]    # Per level: the member's share of what reaches it, of _ONE.
  offsets: tuple[int, ...]   # Per level: its seeded phase, of _ONE.
  before: tuple[int, ...]    # Per member: rows drawn before the phase.


class Mixture:
  """Global stream positions -> rows of the members' train splits, drawn by weight.

  `rows[k]`: member k's train rows; they sit at flat indices offsets[k] ..
  offsets[k] + rows[k] - 1 of the reader that holds all members' rows one
  after another. `max_epochs[k]` > 0 caps the rows member k gives at
  max_epochs[k] * rows[k]. Pickles small: grain's worker processes get it.

  A continuing mixture (a later training phase's shares) draws positions from
  `start_position` on only; `rows_before[k]` rows of member k were drawn
  before it (earlier.rows_drawn(start_position)), so its j-th draw here is row
  rows_before[k] + j of its stream, and its cap counts them. With
  start_position=0 and no rows_before it is the mixture of a whole run.
  """

  def __init__(self, weights: Sequence[float], rows: Sequence[int], seed: int,
               max_epochs: Sequence[float] | None = None, *, start_position: int = 0,
               rows_before: Sequence[int] | None = None):
    self.rows = np.asarray(rows, np.int64)
    self.offsets = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)
    self.seed = seed
    self.weights = np.asarray(weights, np.float64) / sum(weights)
    self.max_epochs = [0.0] * len(rows) if max_epochs is None else [float(c) for c in max_epochs]
    self.caps = [int(c * n) if c > 0 else None for c, n in zip(self.max_epochs, rows)]
    self.start_position = int(start_position)
    before = [0] * len(rows) if rows_before is None else [int(b) for b in rows_before]
    if self.start_position < 0 or len(before) != len(rows) or min(before, default=0) < 0:
      raise ValueError(f'start_position={start_position} must be >= 0 and rows_before='
                       f'{before} one count >= 0 per member of {len(rows)}')
    self.rows_before = np.asarray(before, np.int64)
    self.phases: list[_Phase] = []
    self.end: int | None = None  # Where every member has reached its cap, if all have one.
    start = self.start_position
    active = [k for k in range(len(rows)) if self.caps[k] is None or before[k] < self.caps[k]]
    while active:
      phase = self._make_phase(len(self.phases), start, active, before)
      self.phases.append(phase)
      capped = [k for k in active if self.caps[k] is not None]
      if not capped:
        break
      # The first position at which an active member reaches its cap ends the phase.
      length = min(self._reach(phase, k, self.caps[k] - before[k]) for k in capped)
      if length >= _END:
        break  # No capped member gets drawn (a weight that rounds to nothing).
      counts = self._phase_counts(phase, length)
      before = [b + counts.get(k, 0) for k, b in enumerate(before)]
      active = [k for k in active if self.caps[k] is None or before[k] < self.caps[k]]
      start += length
    if not active:
      self.end = start

  def _make_phase(self, index: int, start: int, active: list[int], before: list[int]) -> _Phase:
    w = self.weights[active]
    left = np.cumsum(w[::-1])[::-1]  # What reaches each level.
    shares = tuple(int(round(_ONE * a / b)) for a, b in zip(w[:-1], left[:-1])) + (_ONE,)
    offsets = tuple(_phase(self.seed, index, j) for j in range(len(active)))
    return _Phase(start, tuple(active), shares, offsets, tuple(before))

  @staticmethod
  def _levels(phase: _Phase, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions q [n] within a phase -> (level that takes each, its index at that level)."""
    q = np.asarray(q, np.int64)
    level = np.full(q.shape, len(phase.active) - 1, np.int64)
    index = q.copy()
    m = q.copy()
    undecided = np.ones(q.shape, bool)
    for j, (share, offset) in enumerate(zip(phase.shares[:-1], phase.offsets)):
      taken_before = (share * m + offset) >> _BITS
      takes = undecided & (((share * (m + 1) + offset) >> _BITS) > taken_before)
      level[takes], index[takes] = j, taken_before[takes]
      m = np.where(undecided & ~takes, m - taken_before, m)
      undecided &= ~takes
    index[undecided] = m[undecided]
    return level, index

  @staticmethod
  def _phase_counts(phase: _Phase, length: int) -> dict[int, int]:
    """{member: rows it gives} in the first `length` positions of a phase."""
    counts, m = {}, length
    for k, share, offset in zip(phase.active, phase.shares, phase.offsets):
      taken = (share * m + offset) >> _BITS if share < _ONE else m
      counts[k] = taken
      m -= taken
    return counts

  def _reach(self, phase: _Phase, member: int, rows: int) -> int:
    """The fewest positions of a phase in which `member` gives `rows` rows (_END: never)."""
    lo, hi = 0, _END
    while lo < hi:
      mid = (lo + hi) // 2
      if self._phase_counts(phase, mid)[member] >= rows:
        hi = mid
      else:
        lo = mid + 1
    return lo

  def draw(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Global stream positions [n] (>= start_position) -> (member [n], the member's row count
    before it [n], rows_before included)."""
    positions = np.asarray(positions, np.int64)
    if positions.size and positions.min() < self.start_position:
      raise ValueError(f'position {int(positions.min())} is before {self.start_position}, '
                       'where this mixture starts')
    if self.end is not None and positions.size and positions.max() >= self.end:
      raise ValueError(f'position {int(positions.max())} is past the {self.end} rows the epoch '
                       'caps of config.data.sources allow')
    starts = np.array([p.start for p in self.phases], np.int64)
    which = np.searchsorted(starts, positions, 'right') - 1
    member = np.empty_like(positions)
    drawn = np.empty_like(positions)
    for i in np.unique(which):
      phase, here = self.phases[i], which == i
      level, index = self._levels(phase, positions[here] - phase.start)
      active = np.asarray(phase.active, np.int64)
      member[here] = active[level]
      drawn[here] = index + np.asarray(phase.before, np.int64)[active[level]]
    return member, drawn

  def __call__(self, positions: np.ndarray, shuffle: Any) -> np.ndarray:
    """Global stream positions [n] -> flat row indices [n] into all members' train rows.

    `shuffle(stream positions, num_rows, seed)`: a member's stream order
    (pipeline.stream_to_source), seeded per member.
    """
    member, drawn = self.draw(positions)
    out = np.empty_like(drawn)
    for k in np.unique(member):
      here = member == k
      out[here] = self.offsets[k] + shuffle(drawn[here], int(self.rows[k]), self.member_seed(k))
    return out

  def member_seed(self, k: int) -> int:
    return (self.seed + (k + 1) * 1_000_003) % 2**32

  def rows_drawn(self, position: int) -> np.ndarray:
    """[K] rows each member gave in global positions [0, position): rows_before and those
    of [start_position, position). A closed form: no draw is replayed."""
    if position < self.start_position:
      raise ValueError(f'position {position} is before {self.start_position}, where this '
                       'mixture starts: ask the mixture that drew it')
    out = self.rows_before.copy()
    for phase, nxt in zip(self.phases, [p.start for p in self.phases[1:]] + [None]):
      if position <= phase.start:
        break
      length = position - phase.start if nxt is None else min(position, nxt) - phase.start
      for k, c in self._phase_counts(phase, length).items():
        out[k] += c
    return out

  def continued(self, position: int, weights: Sequence[float],
                max_epochs: Sequence[float] | None = None) -> Mixture:
    """The mixture that draws by `weights` from global stream position `position` on, each
    member's stream going on where this one left it (same rows, seed and, unless given,
    epoch caps)."""
    return Mixture(weights, self.rows, self.seed,
                   self.max_epochs if max_epochs is None else max_epochs,
                   start_position=position, rows_before=self.rows_drawn(position))

  @property
  def max_rows(self) -> int | None:
    """The stream position at which every member has reached its cap; None: no limit."""
    return self.end


def check_steps(mix: Mixture, num_steps: int, global_batch: int, names: list[str],
                end_position: int | None = None) -> None:
  """ConfigError when the epoch caps end the mixture before config.train.num_steps.

  end_position: the stream position after the last step (default num_steps * global_batch;
  another where the batch grows during the run).
  """
  end = num_steps * global_batch if end_position is None else end_position
  if mix.max_rows is None or end <= mix.max_rows:
    return
  caps = ', '.join(f'{n}: {c / r:g} epochs of {r:,} rows' for n, c, r in
                   zip(names, mix.caps, mix.rows) if c)
  raise ConfigError(
      f'The epoch caps of config.data.sources ({caps}) allow {mix.max_rows:,} rows, '
      f'{mix.max_rows // global_batch:,} steps of {global_batch}, but config.train.num_steps='
      f'{num_steps:,}: raise a max_epochs, give a source no cap (0), or train fewer steps.')
