"""BERT masking on the host, in numpy: a fresh mask for every row every step.

Per row, exactly k = min(P, max(1, round(rate * n))) of its n maskable tokens
are selected ([CLS], [SEP] and [PAD] never are, by the tokenizer's ids:
`Specials.never_masked`); the rate is select_rate, or with a RateSchedule the
schedule's rate at the row's own step. Which ones depends on the mode:

  token       k tokens uniformly at random (BERT).
  whole_word  whole words in random order, a word being a piece that starts
              one (the tokenizer's word_start_mask(): sentencepiece's '▁',
              byte-level BPE's 'Ġ', any WordPiece piece but a '##' one), or
              any piece right after [CLS], [SEP] or [PAD], plus the pieces
              that continue it; a word that would overshoot the budget is
              skipped (as in BERT's and Hugging Face's whole-word masking),
              so k is exact whenever some unselected word still fits (most
              rows; docs/data.md) and other rows get fewer, never a split
              word.
  span        contiguous spans (SpanBERT) with lengths ~ Geometric(p) clipped
              at a maximum, until exactly k tokens are covered (the last span
              is cut to fit); spans are placed uniformly at random, apart
              from one another by at least one token where the row has room.
              Lengths count tokens, and a span runs over maskable tokens only,
              so a [SEP] inside it stays and is not predicted.

Of the selected tokens, `mask_prob` become [MASK], `random_prob` a random
token drawn from the corpus's unigram distribution (or uniformly from the
normal vocabulary), and the rest stay unchanged. Special tokens (every id
the tokenizer marks special) are never drawn.

Randomness is a counter-based hash of (seed, step, global row index, position)
rather than a stateful generator, so that a row's mask does not depend on
which process holds it or how many processes there are, and a whole batch is
masked with a few vectorised numpy calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_collections
import numpy as np

from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import one_of
from mlm_jax.errors import require

MODES = ('token', 'whole_word', 'span')
# What a masked slot's input showed, in batch['masked_kinds'] [b, P]: index + 1
# (0 marks an unused slot). Accuracy at 'mask' slots is what context alone gives.
SLOT_KINDS = ('mask', 'random', 'kept')
# Where random replacement tokens are drawn from (config.masking.random_source).
RANDOM_SOURCES = ('unigram', 'uniform')
# Independent streams of the hash: one per random decision. Other modules
# that draw from `uniform` (e.g. the sentence-pair builder) use streams >= 100.
_SELECT, _ACTION, _TOKEN, _SPAN_LENGTH, _SPAN_PLACE = 1, 2, 3, 4, 5
# How the selection rate moves during a run (config.masking.rate_schedule).
RATE_SCHEDULES = ('constant', 'linear', 'step')


@dataclasses.dataclass(frozen=True)
class RateSchedule:
  """The selection rate as a function of the training step.

  constant  start_rate at every step.
  linear    start_rate up to start_step, then linearly to end_rate at end_step,
            end_rate from there on.
  step      start_rate before end_step, end_rate from end_step on.

  Steps, not tokens: the trainer converts config.masking.rate_change_tokens
  to a step (it knows every step's batch size). Plain numbers only, so that
  it pickles into grain's worker processes with the Masker.
  """

  start_step: int
  end_step: int
  start_rate: float
  end_rate: float
  kind: str  # RATE_SCHEDULES

  def __post_init__(self):
    one_of('masking', 'rate_schedule', self.kind, RATE_SCHEDULES)
    for name in ('start_rate', 'end_rate'):
      if not 0.0 < getattr(self, name) <= 1.0:
        raise ValueError(f'RateSchedule.{name}={getattr(self, name)} must be in (0, 1]')
    if self.end_step < self.start_step:
      raise ValueError(f'RateSchedule.end_step={self.end_step} is before '
                       f'start_step={self.start_step}')

  def rate_at(self, step: int | np.ndarray) -> float | np.ndarray:
    """The rate at `step` (one step: a float; an array of steps: float64 of its shape)."""
    steps = np.asarray(step, np.float64)
    if self.kind == 'constant':
      rates = np.full(steps.shape, self.start_rate)
    elif self.kind == 'step':
      rates = np.where(steps < self.end_step, self.start_rate, self.end_rate)
    else:
      # An empty ramp (end_step == start_step) switches at once, as 'step' does.
      span = max(self.end_step - self.start_step, 1)
      done = np.clip((steps - self.start_step) / span, 0.0, 1.0)
      rates = self.start_rate + done * (self.end_rate - self.start_rate)
      rates = np.where(steps >= self.end_step, self.end_rate, rates)  # Exactly end_rate after.
    return float(rates) if np.ndim(step) == 0 else rates

  @classmethod
  def from_config(cls, masking_config: ml_collections.ConfigDict, start_step: int,
                  end_step: int) -> RateSchedule | None:
    """config.masking's schedule over [start_step, end_step]; None for 'constant'.

    end_step is the step that rate_change_tokens reaches (or the end of the run
    or phase when it is 0), as the caller counts steps. None keeps the Masker
    on select_rate, bit-identical to a run without a schedule.
    """
    kind = masking_config.get('rate_schedule', 'constant')
    if kind == 'constant':
      return None
    return cls(start_step=int(start_step), end_step=int(end_step),
               start_rate=float(masking_config.select_rate),
               end_rate=float(masking_config.final_select_rate), kind=kind)


def full_row_slots(rate: float, seq_len: int) -> int:
  """The slots a full row of seq_len tokens gets at `rate`: round(rate x (seq_len - 2)), its
  [CLS] and [SEP] never masked (num_selected's count, before the cap at P)."""
  return int(np.floor(rate * (seq_len - 2) + 0.5))


def max_rate(masking_config: ml_collections.ConfigDict) -> float:
  """The highest selection rate config.masking reaches: what the static P is sized for."""
  if masking_config.get('rate_schedule', 'constant') == 'constant':
    return float(masking_config.select_rate)
  return float(max(masking_config.select_rate, masking_config.final_select_rate))


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a bijective avalanche hash of uint64 values."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _bits(seed: int, step: int | np.ndarray, rows: np.ndarray, width: int, stream: int,
          positions: np.ndarray | None = None) -> np.ndarray:
  """53 random bits per (row, position) as uint64: [len(rows), width] or positions' shape."""
  key = np.array([seed, stream], np.uint64)
  steps = np.asarray(step).astype(np.uint64).reshape(-1, 1)  # [1, 1] or [b, 1]
  k = _mix(_mix(_mix(key[:1] * np.uint64(0x9E3779B97F4A7C15) + key[1:2]) + steps))
  if positions is None:
    positions = np.arange(width)[None, :]
  counter = rows.astype(np.uint64)[:, None] * np.uint64(width) + positions.astype(np.uint64)
  return _mix(k + _mix(counter + np.uint64(0x632BE59BD9B4E019))) >> np.uint64(11)


def uniform(seed: int, step: int | np.ndarray, rows: np.ndarray, width: int, stream: int,
            positions: np.ndarray | None = None) -> np.ndarray:
  """Uniforms in [0, 1), a pure function of (seed, stream, step, row, position).

  [len(rows), width] for every position of each row, or, given positions
  [len(rows), P], the same values at just those positions. `step` is one step
  for all rows or [len(rows)] steps, one per row.
  """
  bits = _bits(seed, step, rows, width, stream, positions)
  return bits.astype(np.float64) * (1.0 / (1 << 53))


def replacement_distribution(source: str, vocab_size: int, unigram_counts: np.ndarray | None,
                             special_ids: Sequence[int] | np.ndarray) -> np.ndarray:
  """[vocab] float64 probabilities of random replacement tokens; zero on every `special_ids`
  (a tokenizer's special_ids())."""
  if source == 'unigram':
    if unigram_counts is None:
      raise ValueError("random_source='unigram' needs the corpus's unigram counts")
    weights = np.asarray(unigram_counts, np.float64)[:vocab_size].copy()
  elif source == 'uniform':
    weights = np.ones(vocab_size, np.float64)
  else:
    one_of('masking', 'random_source', source, RANDOM_SOURCES)
  special = np.asarray(special_ids, np.int64)
  weights[special[(special >= 0) & (special < vocab_size)]] = 0.0
  if weights.sum() <= 0:
    raise ValueError('no normal token has a positive count to draw replacements from')
  return weights / weights.sum()


def document_ids(input_ids: np.ndarray, specials: tok_lib.Specials) -> np.ndarray:
  """Packed rows [b, T] -> [b, T] int32: each token's document, 1, 2, ... from the row's start.

  A packed row is [CLS] doc [SEP] doc [SEP] ... (packing.py): a [SEP] closes
  its document and the next token starts another; [CLS] belongs to the
  first. Padding is 0.
  """
  sep = input_ids == specials.sep
  ids = 1 + np.cumsum(sep, axis=1, dtype=np.int32) - sep
  return np.where(input_ids != specials.pad, ids, 0).astype(np.int32)


def _to_slots(selected: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
  """[b, T] bool with at most p per row -> ascending positions [b, p], valid [b, p]."""
  rows, cols = np.nonzero(selected)  # Row-major: ascending columns within a row.
  counts = selected.sum(axis=1)
  slot = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
  positions = np.zeros((selected.shape[0], p), np.int64)
  positions[rows, slot] = cols
  return positions, np.arange(p)[None, :] < counts[:, None]


@dataclasses.dataclass(frozen=True, eq=False)
class Masker:
  """Masks packed rows: `masker(input_ids, seed=, step=, rows=)` -> batch dict."""

  max_predictions: int  # P
  select_rate: float
  mask_prob: float
  random_prob: float
  replacement_probs: np.ndarray  # [vocab] float64, zero on special tokens
  mode: str                      # MODES
  # Span mode: lengths ~ Geometric(span_p) on {1, 2, ...}, clipped at span_max.
  span_p: float
  span_max: int
  # The tokenizer's special ids: [PAD], [CLS], [SEP] are never selected, [MASK]
  # replaces, [PAD] is what attention ignores.
  specials: tok_lib.Specials
  # Whole-word mode: [vocab] bool, True where a piece starts a word
  # (tokenizer.word_start_mask()).
  word_start: np.ndarray | None = None
  # The rate per step during a run; None: select_rate at every step. P must
  # hold the schedule's highest rate (check_config), else rows are capped at P.
  rate_schedule: RateSchedule | None = None

  def __post_init__(self):
    one_of('masking', 'mode', self.mode, MODES)
    if self.mode == 'whole_word' and self.word_start is None:
      raise ValueError("config.masking.mode='whole_word' needs the tokenizer's word starts "
                       '(make_masker(config.masking, tokenizer, counts), or '
                       'word_start=tokenizer.word_start_mask())')
    object.__setattr__(self, '_cdf', np.cumsum(self.replacement_probs))

  def rate_at(self, step: int | np.ndarray) -> float | np.ndarray:
    """The selection rate at `step` (what a step's log reports): select_rate, or the schedule's."""
    if self.rate_schedule is None:
      return self.select_rate if np.ndim(step) == 0 else np.full(np.shape(step), self.select_rate)
    return self.rate_schedule.rate_at(step)

  def num_selected(self, num_maskable: np.ndarray, step: int | np.ndarray = 0) -> np.ndarray:
    """Exact number of selections per row: min(P, max(1, round(rate*n))), 0 if n=0.

    num_maskable: [b]; step: one step or [b], each row's own, for the rate
    schedule's rate (ignored without one).
    """
    k = np.floor(self.rate_at(step) * num_maskable + 0.5).astype(np.int64)
    k = np.clip(k, 1, self.max_predictions)
    return np.where(num_maskable > 0, k, 0)

  def __call__(self, input_ids: np.ndarray, *, seed: int, step: int | np.ndarray,
               rows: np.ndarray) -> dict[str, np.ndarray]:
    """Masks `input_ids: [b, T]`; `rows: [b]` are the rows' global indices.

    `step` is the step of all rows, or [b] steps (several steps masked in one call).
    """
    b, t = input_ids.shape
    pad, cls, sep = self.specials.never_masked
    maskable = (input_ids != pad) & (input_ids != cls) & (input_ids != sep)
    k = self.num_selected(maskable.sum(axis=1), step)
    select = {'token': self._select_tokens, 'whole_word': self._select_words,
              'span': self._select_spans}[self.mode]
    positions, valid = select(input_ids, maskable, k, seed=seed, step=step, rows=rows)

    row_idx = np.arange(b)[:, None]
    targets = np.where(valid, input_ids[row_idx, positions], 0)

    # What each selected position becomes.
    action = uniform(seed, step, rows, t, _ACTION, positions)
    to_mask = valid & (action < self.mask_prob)
    to_random = valid & ~to_mask & (action < self.mask_prob + self.random_prob)
    draw = uniform(seed, step, rows, t, _TOKEN, positions)
    random_ids = np.searchsorted(self._cdf, draw * self._cdf[-1], side='right')
    random_ids = np.minimum(random_ids, len(self._cdf) - 1)

    new_values = np.where(to_mask, self.specials.mask, np.where(to_random, random_ids, targets))
    kinds = np.where(to_mask, 1, np.where(to_random, 2, np.where(valid, 3, 0)))
    masked_input = input_ids.copy()
    sel_rows, sel_slots = np.nonzero(valid)
    masked_input[sel_rows, positions[sel_rows, sel_slots]] = new_values[sel_rows, sel_slots]

    return {
        'input_ids': masked_input.astype(np.int32),                        # [b, T]
        'attention_mask': (input_ids != pad).astype(np.int32),             # [b, T]
        'segment_ids': np.zeros((b, t), np.int32),                         # [b, T]
        'document_ids': document_ids(input_ids, self.specials),            # [b, T]
        'masked_positions': positions.astype(np.int32),                    # [b, P]
        'masked_ids': targets.astype(np.int32),                            # [b, P]
        'masked_weights': valid.astype(np.float32),                        # [b, P]
        'masked_kinds': kinds.astype(np.int32),                            # [b, P] SLOT_KINDS
    }

  def _select_tokens(self, input_ids, maskable, k, *, seed, step, rows):
    """The k maskable positions with the smallest random keys; sorted, valid first."""
    b, t = input_ids.shape
    p = self.max_predictions
    # Integer keys order exactly as the uniforms made from them; an unstable
    # sort only reorders the ties among unmaskable positions, which are dropped.
    keys = np.where(maskable, _bits(seed, step, rows, t, _SELECT), np.uint64(1 << 53))
    order = np.argsort(keys, axis=1)[:, :p]
    valid = np.arange(p)[None, :] < k[:, None]
    positions = np.sort(np.where(valid, order, t), axis=1)  # Valid ones first, ascending.
    valid = positions < t
    return np.where(valid, positions, 0), valid

  def _select_words(self, input_ids, maskable, k, *, seed, step, rows):
    """Whole words in a random order, skipping those that would overshoot k."""
    b, t = input_ids.shape
    # A word starts at a word-start piece or after a token that cannot be masked
    # (a document's first piece has no word-start mark in byte-level BPE).
    after_special = np.ones_like(maskable)
    after_special[:, 1:] = ~maskable[:, :-1]
    starts = maskable & (self.word_start[input_ids] | after_special)
    word = np.cumsum(starts, axis=1) - 1                    # [b, T] word index in its row
    flat_word = np.arange(b)[:, None] * t + word
    lengths = np.bincount(flat_word[maskable], minlength=b * t).reshape(b, t)  # [b, words]
    # A word's random key is its first piece's; padding words sort last.
    keys = np.full((b, t), np.uint64(1 << 53))
    r, c = np.nonzero(starts)
    keys[r, word[r, c]] = _bits(seed, step, rows, t, _SELECT)[r, c]
    order = np.argsort(keys, axis=1)                         # [b, words], random order
    ordered_len = np.take_along_axis(lengths, order, axis=1)
    # Greedy first-fit in that order, as a loop over ranks (not rows): the
    # longest prefix that fits is taken at once, then words one rank at a time.
    taken = np.cumsum(ordered_len, axis=1) <= k[:, None]
    filled = np.where(taken, ordered_len, 0).sum(axis=1)
    max_words = int(starts.sum(axis=1).max(initial=0))
    for j in range(int(taken.sum(axis=1).min(initial=0)), max_words):
      open_rows = filled < k
      if not open_rows.any():
        break
      fits = open_rows & ~taken[:, j] & (ordered_len[:, j] > 0) & (filled + ordered_len[:, j] <= k)
      taken[:, j] |= fits
      filled += np.where(fits, ordered_len[:, j], 0)
    taken &= ordered_len > 0
    chosen = np.zeros((b, t), bool)
    np.put_along_axis(chosen, order, taken, axis=1)
    selected = maskable & np.take_along_axis(chosen, np.maximum(word, 0), axis=1)
    return _to_slots(selected, self.max_predictions)

  def _select_spans(self, input_ids, maskable, k, *, seed, step, rows):
    """Spans of clipped-geometric length covering exactly k maskable tokens."""
    b, t = input_ids.shape
    p = self.max_predictions
    n = maskable.sum(axis=1)
    # Lengths: P draws suffice, since every span covers at least one token.
    u = uniform(seed, step, rows, p, _SPAN_LENGTH)                 # [b, P]
    lengths = np.minimum(1 + np.floor(np.log1p(-u) / np.log1p(-self.span_p)), self.span_max)
    cum = np.cumsum(lengths.astype(np.int64), axis=1)
    # Span j covers tokens [offset_j, end_j) of the k selected ones: the last
    # span is cut to fit the budget and the ones after it are empty.
    end = np.minimum(cum, k[:, None])                              # [b, P]
    offset = np.minimum(cum - lengths.astype(np.int64), k[:, None])  # [b, P]
    m = (end > offset).sum(axis=1)                                 # [b] spans
    # Placement (stars and bars): the spans and the n - k unselected tokens in
    # a uniformly random order, with one unselected token kept between spans
    # where the row has room. The spans take m of `items` slots.
    gaps = np.maximum(m - 1, 0)
    apart = (n - k >= gaps).astype(np.int64)                       # [b] 1: spans never touch
    items = n - k - apart * gaps + m                               # [b]
    keys = np.where(np.arange(t)[None, :] < items[:, None],
                    _bits(seed, step, rows, t, _SPAN_PLACE), np.uint64(1 << 53))
    j = np.arange(p)[None, :]
    slots = np.sort(np.where(j < m[:, None], np.argsort(keys, axis=1)[:, :p], t), axis=1)
    # Span j starts after the j spans and (slot - j) unselected tokens before it.
    first = slots - j + offset + apart[:, None] * j                # [b, P] maskable coords
    # Output slot q holds token q of the spans laid end to end.
    q = np.arange(p)
    span_of = np.minimum((end[:, None, :] <= q[None, :, None]).sum(axis=2), p - 1)  # [b, P]
    coord = (np.take_along_axis(first, span_of, axis=1) + q[None, :]
             - np.take_along_axis(offset, span_of, axis=1))
    valid = q[None, :] < k[:, None]
    # Maskable coordinate -> position in the row.
    r, c = np.nonzero(maskable)
    by_coord = np.zeros((b, t), np.int64)
    by_coord[r, (np.cumsum(maskable, axis=1) - 1)[r, c]] = c
    positions = np.take_along_axis(by_coord, np.where(valid, coord, 0), axis=1)
    return np.where(valid, positions, 0), valid


def make_masker(masking_config: ml_collections.ConfigDict, tokenizer: tok_lib.Tokenizer,
                unigram_counts: np.ndarray | None,
                rate_schedule: RateSchedule | None = None) -> Masker:
  """A Masker from `config.masking` for rows of `tokenizer`'s ids.

  Its special ids, the ids never drawn as replacements (tokenizer.special_ids())
  and, in whole-word mode, its word starts come from the tokenizer.
  rate_schedule: the rate per step (RateSchedule.from_config); None: select_rate.
  """
  whole_word = masking_config.mode == 'whole_word'
  return make_masker_for_ids(
      masking_config, tokenizer.vocab_size, unigram_counts, tokenizer.specials,
      special_ids=tokenizer.special_ids(),
      word_start=tokenizer.word_start_mask() if whole_word else None,
      rate_schedule=rate_schedule)


def make_masker_for_ids(masking_config: ml_collections.ConfigDict, vocab_size: int,
                        unigram_counts: np.ndarray | None, specials: tok_lib.Specials, *,
                        special_ids: Sequence[int] | np.ndarray | None = None,
                        word_start: np.ndarray | None = None,
                        rate_schedule: RateSchedule | None = None) -> Masker:
  """A Masker from `config.masking` without a tokenizer (synthetic ids, benchmarks).

  `special_ids`: ids never drawn as replacements (default: the roles' ids,
  specials.ids); `word_start`: [vocab] bool, needed in whole-word mode;
  `rate_schedule`: the rate per step, None: select_rate at every step.
  """
  return Masker(
      max_predictions=masking_config.max_predictions,
      select_rate=masking_config.select_rate,
      mask_prob=masking_config.mask_prob,
      random_prob=masking_config.random_prob,
      replacement_probs=replacement_distribution(
          masking_config.random_source, vocab_size, unigram_counts,
          specials.ids if special_ids is None else special_ids),
      mode=masking_config.mode,
      span_p=masking_config.span_p,
      span_max=masking_config.span_max_length,
      specials=specials,
      word_start=None if word_start is None else np.asarray(word_start, bool),
      rate_schedule=rate_schedule)


def check_config(m: ml_collections.ConfigDict, seq_len: int) -> None:
  """ConfigError for an invalid config.masking (P must fit the rows of length seq_len)."""
  require(0 < m.max_predictions <= seq_len - 2,
          f'config.masking.max_predictions={m.max_predictions} (P) must be in '
          f'[1, config.data.seq_len - 2 = {seq_len - 2}].')
  require(0.0 < m.select_rate <= 1.0,
          f'config.masking.select_rate={m.select_rate} must be in (0, 1].')
  for name in ('mask_prob', 'random_prob'):
    require(0.0 <= m[name] <= 1.0, f'config.masking.{name}={m[name]} must be in [0, 1].')
  require(m.mask_prob + m.random_prob <= 1.0 + 1e-9,
          f'config.masking.mask_prob + random_prob = {m.mask_prob + m.random_prob} '
          'exceeds 1; the rest is the fraction kept unchanged.')
  one_of('masking', 'random_source', m.random_source, RANDOM_SOURCES)
  one_of('masking', 'mode', m.mode, MODES)
  require(0.0 < m.span_p <= 1.0, f'config.masking.span_p={m.span_p} must be in (0, 1].')
  require(m.span_max_length >= 1,
          f'config.masking.span_max_length={m.span_max_length} must be at least 1.')
  one_of('masking', 'rate_schedule', m.rate_schedule, RATE_SCHEDULES)
  require(m.rate_change_tokens >= 0,
          f'config.masking.rate_change_tokens={m.rate_change_tokens} must be >= 0 '
          '(0: the end of the run or phase).')
  if m.rate_schedule == 'constant':
    return
  require(0.0 < m.final_select_rate <= 1.0,
          f'config.masking.final_select_rate={m.final_select_rate} must be in (0, 1] with '
          f'config.masking.rate_schedule={m.rate_schedule!r}.')
  needed = full_row_slots(max_rate(m), seq_len)
  require(m.max_predictions >= needed,
          f'config.masking.max_predictions={m.max_predictions} (P) holds fewer than the {needed} '
          f'masked slots a full row gets at the schedule\'s highest rate {max_rate(m)}: set '
          f'--config.masking.max_predictions={needed} (the static P is sized for the highest '
          'rate).')
