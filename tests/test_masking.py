"""Masking: the BERT recipe's statistics, exact counts, special tokens, determinism."""

import pickle

import ml_collections
import numpy as np
import pytest

from configs import base
from mlm_jax.errors import ConfigError
from mlm_jax.data import masking
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from tests.conftest import Deferred

stats = Deferred('scipy.stats')

# The layout of the tokenizers trained here ([PAD]=0 ... [MASK]=4); the rows
# below use it, and test_other_special_layouts another.
S = sp_tokenizer.SPECIALS

V, T, P = 2000, 128, 20


def _rows(n: int, seed: int = 0, vocab_lo: int = 5, vocab_hi: int = V) -> np.ndarray:
  """Packed-looking rows: [CLS] ... [SEP] ... [SEP], some with [PAD] tails."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(vocab_lo, vocab_hi, (n, T)).astype(np.int32)
  ids[:, 0] = S.cls
  ids[:, -1] = S.sep
  ids[np.arange(n), rng.integers(1, T - 1, n)] = S.sep  # A document boundary.
  pad_from = rng.integers(T // 2, T + 1, n)
  ids[np.arange(T)[None, :] >= pad_from[:, None]] = S.pad
  has_pad = pad_from < T
  ids[has_pad, pad_from[has_pad] - 1] = S.sep
  return ids


# Masker options besides the rates: token mode (span settings unused there).
TOKEN_MODE = dict(mode='token', span_p=0.2, span_max=10, specials=S)


def _masker(counts=None, source='unigram', mask_prob=0.8, random_prob=0.1, rate=0.15, p=P):
  if counts is None:
    counts = np.arange(V, dtype=np.int64)
  return masking.Masker(p, rate, mask_prob, random_prob,
                        masking.replacement_distribution(source, V, counts, S.ids), **TOKEN_MODE)


def _selected(batch):
  """(row, position) index arrays of the valid masked slots."""
  r, s = np.nonzero(batch['masked_weights'])
  return r, batch['masked_positions'][r, s], s


def test_rates_match_bert_recipe_on_500k_tokens():
  # Originals come from ids >= 1000 and replacements only from ids < 1000, so
  # every random replacement is visible as such.
  ids = _rows(4000, vocab_lo=1000)
  counts = np.zeros(V, np.int64)
  counts[5:1000] = 1
  batch = _masker(counts)(ids, seed=0, step=0, rows=np.arange(len(ids)))
  maskable = ~np.isin(ids, (S.pad, S.cls, S.sep))
  assert maskable.sum() >= 100_000
  r, pos, _ = _selected(batch)
  assert abs(len(r) / maskable.sum() - 0.15) < 0.01
  new = batch['input_ids'][r, pos]
  orig = ids[r, pos]
  frac_mask = np.mean(new == S.mask)
  frac_random = np.mean((new != S.mask) & (new != orig))
  frac_keep = np.mean(new == orig)
  assert abs(frac_mask - 0.8) < 0.01, frac_mask
  assert abs(frac_random - 0.1) < 0.01, frac_random
  assert abs(frac_keep - 0.1) < 0.01, frac_keep
  # Nothing outside the selected positions changes.
  changed = batch['input_ids'] != ids
  selected = np.zeros_like(changed)
  selected[r, pos] = True
  assert not np.any(changed & ~selected)


@pytest.mark.parametrize('rate,mask_prob,random_prob', [(0.3, 0.8, 0.1), (0.15, 0.5, 0.25)])
def test_configured_rates_are_followed(rate, mask_prob, random_prob):
  ids = _rows(3000, vocab_lo=1000)
  counts = np.zeros(V, np.int64)
  counts[5:1000] = 1
  m = _masker(counts, rate=rate, mask_prob=mask_prob, random_prob=random_prob, p=60)
  batch = m(ids, seed=3, step=7, rows=np.arange(len(ids)))
  r, pos, _ = _selected(batch)
  maskable = ~np.isin(ids, (S.pad, S.cls, S.sep))
  assert abs(len(r) / maskable.sum() - rate) < 0.01
  new, orig = batch['input_ids'][r, pos], ids[r, pos]
  assert abs(np.mean(new == S.mask) - mask_prob) < 0.01
  assert abs(np.mean((new != S.mask) & (new != orig)) - random_prob) < 0.01


def test_exact_count_per_row_and_static_shapes():
  ids = _rows(500, seed=1)
  ids[3, 1:] = S.pad  # A row with nothing to mask.
  ids[4, 3:] = S.pad  # A row with two maskable tokens.
  batch = _masker()(ids, seed=0, step=0, rows=np.arange(500))
  n = (~np.isin(ids, (S.pad, S.cls, S.sep))).sum(axis=1)
  expected = np.where(n > 0, np.clip(np.floor(0.15 * n + 0.5), 1, P), 0)
  np.testing.assert_array_equal(batch['masked_weights'].sum(axis=1), expected)
  assert batch['masked_weights'][3].sum() == 0 and batch['masked_weights'][4].sum() == 1
  for key, shape in [('input_ids', (500, T)), ('attention_mask', (500, T)),
                     ('segment_ids', (500, T)), ('masked_positions', (500, P)),
                     ('masked_ids', (500, P)), ('masked_weights', (500, P))]:
    assert batch[key].shape == shape
  # Valid slots name distinct positions, and masked_ids are the original tokens.
  r, pos, s = _selected(batch)
  np.testing.assert_array_equal(batch['masked_ids'][r, s], ids[r, pos])
  for row in range(500):
    valid = batch['masked_positions'][row][batch['masked_weights'][row] > 0]
    assert len(set(valid.tolist())) == len(valid)
  # Padding slots carry zeros.
  pad = batch['masked_weights'] == 0
  assert np.all(batch['masked_positions'][pad] == 0) and np.all(batch['masked_ids'][pad] == 0)


def test_special_tokens_never_selected_nor_inserted():
  ids = _rows(2000, seed=2)
  counts = np.ones(V, np.int64)
  counts[list(S.ids)] = 10**9  # Would dominate if specials were drawable.
  for source in ('unigram', 'uniform'):
    m = _masker(counts, source=source, mask_prob=0.0, random_prob=1.0)
    batch = m(ids, seed=5, step=1, rows=np.arange(len(ids)))
    r, pos, _ = _selected(batch)
    assert not np.isin(ids[r, pos], (S.pad, S.cls, S.sep)).any()
    inserted = batch['input_ids'][r, pos]
    assert not np.isin(inserted, S.ids).any()
    # Special tokens stay where they were.
    special = np.isin(ids, (S.pad, S.cls, S.sep))
    np.testing.assert_array_equal(batch['input_ids'][special], ids[special])
  np.testing.assert_array_equal(batch['attention_mask'], (ids != S.pad).astype(np.int32))


def test_random_replacements_follow_unigram_counts():
  vocab = 40
  counts = np.zeros(vocab, np.int64)
  counts[5:] = np.random.default_rng(0).integers(1, 200, vocab - 5) ** 2  # Skewed.
  m = masking.Masker(P, 0.15, 0.0, 1.0,
                     masking.replacement_distribution('unigram', vocab, counts, S.ids),
                     **TOKEN_MODE)
  ids = _rows(3000, seed=3, vocab_hi=vocab)
  draws = []
  for step in range(4):
    batch = m(ids, seed=11, step=step, rows=np.arange(len(ids)) + step * len(ids))
    r, pos, _ = _selected(batch)
    draws.append(batch['input_ids'][r, pos])
  observed = np.bincount(np.concatenate(draws), minlength=vocab)[5:]
  expected = counts[5:] / counts[5:].sum() * observed.sum()
  assert observed.sum() > 50_000
  _, p_value = stats.chisquare(observed, expected)
  assert p_value > 1e-3, p_value
  # And the uniform option is uniform over the normal vocabulary.
  m = masking.Masker(P, 0.15, 0.0, 1.0,
                     masking.replacement_distribution('uniform', vocab, counts, S.ids),
                     **TOKEN_MODE)
  batch = m(ids, seed=11, step=0, rows=np.arange(len(ids)))
  r, pos, _ = _selected(batch)
  observed = np.bincount(batch['input_ids'][r, pos], minlength=vocab)
  assert observed[:5].sum() == 0
  _, p_value = stats.chisquare(observed[5:])
  assert p_value > 1e-3, p_value


def test_same_seed_same_mask_and_independent_of_how_rows_are_split():
  ids = _rows(64, seed=4)
  m = _masker()
  whole = m(ids, seed=9, step=3, rows=np.arange(64))
  again = m(ids, seed=9, step=3, rows=np.arange(64))
  halves = [m(ids[:32], seed=9, step=3, rows=np.arange(32)),
            m(ids[32:], seed=9, step=3, rows=np.arange(32, 64))]
  for key in whole:
    np.testing.assert_array_equal(whole[key], again[key])
    np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves]))
  other_step = m(ids, seed=9, step=4, rows=np.arange(64))
  other_seed = m(ids, seed=10, step=3, rows=np.arange(64))
  assert not np.array_equal(whole['masked_positions'], other_step['masked_positions'])
  assert not np.array_equal(whole['masked_positions'], other_seed['masked_positions'])


# ---------------------------------------------------------------- modes

SPECIAL = (S.pad, S.cls, S.sep)
# A synthetic sentencepiece vocabulary: every third normal piece starts a word.
PIECES = list(tok_lib.SPECIAL_TOKENS) + [('\u2581w' if i % 3 == 0 else 'x') + str(i)
                                         for i in range(5, V)]
WORD_START = np.array([p.startswith('\u2581') for p in PIECES])


def _mode_masker(mode, counts=None, rate=0.15, p=P, mask_prob=0.8, random_prob=0.1):
  config = ml_collections.ConfigDict(dict(
      max_predictions=p, select_rate=rate, mask_prob=mask_prob, random_prob=random_prob,
      random_source='unigram', mode=mode, span_p=0.2, span_max_length=10))
  return masking.make_masker_for_ids(config, V, np.arange(V) if counts is None else counts, S,
                                     word_start=WORD_START)


def _words(row, pieces=PIECES):
  """Python reference: lists of positions, one per word of a row."""
  words = []
  for pos, i in enumerate(row):
    if i in SPECIAL:
      continue
    if pieces[i].startswith('\u2581') or not words or words[-1][-1] != pos - 1:
      words.append([pos])
    else:
      words[-1].append(pos)
  return words


def _selected_mask(batch):
  sel = np.zeros(batch['input_ids'].shape, bool)
  r, pos, _ = _selected(batch)
  sel[r, pos] = True
  return sel


def _expected_k(ids, rate=0.15, p=P):
  n = (~np.isin(ids, SPECIAL)).sum(axis=1)
  return np.where(n > 0, np.clip(np.floor(rate * n + 0.5), 1, p), 0)


def test_default_mode_is_token_and_bit_identical_to_plain_masker():
  ids = _rows(300, seed=6)
  # configs/base.py's masking section with only the fields the plain masker has set.
  config = base.get_config().masking
  config.update(dict(max_predictions=P, select_rate=0.15, mask_prob=0.8, random_prob=0.1,
                     random_source='unigram'))
  default = masking.make_masker_for_ids(config, V, np.arange(V), S)
  assert default.mode == 'token'
  a = default(ids, seed=1, step=2, rows=np.arange(300))
  b = _masker()(ids, seed=1, step=2, rows=np.arange(300))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def test_several_steps_in_one_call_equal_one_call_per_step():
  ids = _rows(60, seed=7)
  for mode in masking.MODES:
    m = _mode_masker(mode)
    steps = np.repeat([4, 5, 6], 20)
    together = m(ids, seed=2, step=steps, rows=np.arange(60))
    apart = [m(ids[i * 20:(i + 1) * 20], seed=2, step=4 + i, rows=np.arange(i * 20, (i + 1) * 20))
             for i in range(3)]
    for key in together:
      np.testing.assert_array_equal(together[key], np.concatenate([a[key] for a in apart]))


def test_whole_word_masks_whole_words_within_an_exact_budget():
  ids = _rows(2000, seed=8, vocab_lo=1000)
  ids[0, 1:] = S.pad
  ids[0, 1:4] = [1002, 1003, 1004]  # One word of 3 pieces and a budget of 1: nothing fits.
  counts = np.zeros(V, np.int64)
  counts[5:1000] = 1
  batch = _mode_masker('whole_word', counts)(ids, seed=0, step=0, rows=np.arange(len(ids)))
  sel = _selected_mask(batch)
  for row in range(300):
    for word in _words(ids[row]):
      assert sel[row, word].all() or not sel[row, word].any(), (row, word)
  k = _expected_k(ids)
  got = batch['masked_weights'].sum(axis=1)
  assert got[0] == 0 and k[0] == 1  # Never a split word, even to meet the budget.
  # Exact unless no unselected word fits what is left of the budget.
  assert np.all(got <= k) and np.mean(got == k) > 0.99
  assert abs(got.sum() / (~np.isin(ids, SPECIAL)).sum() - 0.15) < 0.01
  assert not np.isin(ids[sel], SPECIAL).any()
  r, pos, _ = _selected(batch)
  new, orig = batch['input_ids'][r, pos], ids[r, pos]
  assert abs(np.mean(new == S.mask) - 0.8) < 0.01
  assert abs(np.mean((new != S.mask) & (new != orig)) - 0.1) < 0.01
  assert abs(np.mean(new == orig) - 0.1) < 0.01


def test_whole_word_on_real_text(prepared):
  config, data = prepared
  source = data.source('train')
  ids = np.stack([source[i]['input_ids'] for i in range(min(len(source), 2000))])
  pieces = data.tokenizer.pieces()
  masking_config = ml_collections.ConfigDict(config.masking.to_dict())
  masking_config.mode = 'whole_word'
  m = masking.make_masker(masking_config, data.tokenizer, data.unigram_counts)
  batch = m(ids, seed=3, step=1, rows=np.arange(len(ids)))
  sel = _selected_mask(batch)
  for row in range(len(ids)):
    for word in _words(ids[row], pieces):
      assert sel[row, word].all() or not sel[row, word].any()
  k = _expected_k(ids, p=m.max_predictions)
  got = batch['masked_weights'].sum(axis=1)
  # Short only where no unselected word fits the rest of the budget: with
  # this tiny vocabulary (long words) and T=32 ~1 row in 7 (94% of the budget
  # masked); with configs/tiny.py's vocabulary and T=128, 99.3% of rows exact.
  assert np.all(got <= k)
  assert got.sum() / k.sum() > 0.9, got.sum() / k.sum()


def _runs(selected_row):
  """Lengths of the runs of True in a 1-d bool array."""
  d = np.diff(np.concatenate([[0], selected_row.astype(np.int8), [0]]))
  return np.flatnonzero(d == -1) - np.flatnonzero(d == 1)


def test_span_lengths_are_clipped_geometric_and_budget_exact():
  ids = _rows(4000, seed=9, vocab_lo=1000)
  counts = np.zeros(V, np.int64)
  counts[5:1000] = 1
  batch = _mode_masker('span', counts)(ids, seed=0, step=0, rows=np.arange(len(ids)))
  k = _expected_k(ids)
  np.testing.assert_array_equal(batch['masked_weights'].sum(axis=1), k)
  sel = _selected_mask(batch)
  assert not np.isin(ids[sel], SPECIAL).any()
  # Runs over the maskable tokens (the [SEP]s taken out) are the spans: they
  # never touch. With k >= 11 the first span is never cut to fit the budget,
  # so its length is exactly min(Geometric(0.2), 10).
  first, all_runs = [], []
  for row in range(len(ids)):
    runs = _runs(sel[row][~np.isin(ids[row], SPECIAL)])
    assert runs.sum() == k[row] and runs.max() <= 10
    if k[row] >= 11:
      first.append(runs[0])
    all_runs += list(runs)
  pmf = 0.2 * 0.8 ** np.arange(10)
  pmf[-1] = 0.8 ** 9
  observed = np.bincount(first, minlength=11)[1:]
  assert observed.sum() > 3000
  _, p_value = stats.chisquare(observed, pmf * observed.sum())
  assert p_value > 1e-3, (observed, p_value)
  assert abs(np.mean(first) - (pmf * np.arange(1, 11)).sum()) < 0.15
  r, pos, _ = _selected(batch)
  new, orig = batch['input_ids'][r, pos], ids[r, pos]
  assert abs(np.mean(new == S.mask) - 0.8) < 0.01
  assert abs(np.mean((new != S.mask) & (new != orig)) - 0.1) < 0.01
  assert abs(np.mean(new == orig) - 0.1) < 0.01


@pytest.mark.parametrize('mode', ['whole_word', 'span'])
def test_modes_follow_a_30_percent_rate_and_keep_static_shapes(mode):
  ids = _rows(1000, seed=10)
  ids[3, 1:] = S.pad  # Nothing to mask.
  batch = _mode_masker(mode, rate=0.3, p=48)(ids, seed=1, step=3, rows=np.arange(1000))
  for key, shape in [('input_ids', (1000, T)), ('masked_positions', (1000, 48)),
                     ('masked_ids', (1000, 48)), ('masked_weights', (1000, 48))]:
    assert batch[key].shape == shape
  k = _expected_k(ids, rate=0.3, p=48)
  got = batch['masked_weights'].sum(axis=1)
  assert got[3] == 0 and np.all(got <= k) and np.mean(got == k) > 0.97
  r, pos, s = _selected(batch)
  np.testing.assert_array_equal(batch['masked_ids'][r, s], ids[r, pos])
  for row in range(50):
    valid = batch['masked_positions'][row][batch['masked_weights'][row] > 0]
    assert np.all(np.diff(valid) > 0)  # Distinct, ascending.
  pad = batch['masked_weights'] == 0
  assert np.all(batch['masked_positions'][pad] == 0) and np.all(batch['masked_ids'][pad] == 0)


@pytest.mark.parametrize('mode', masking.MODES)
def test_every_mode_is_a_function_of_seed_step_and_row(mode):
  ids = _rows(64, seed=11)
  m = _mode_masker(mode)
  whole = m(ids, seed=9, step=3, rows=np.arange(64))
  halves = [m(ids[:32], seed=9, step=3, rows=np.arange(32)),
            m(ids[32:], seed=9, step=3, rows=np.arange(32, 64))]
  for key in whole:
    np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves]))
  for other in (dict(seed=9, step=4), dict(seed=10, step=3)):
    assert not np.array_equal(whole['masked_positions'],
                              m(ids, rows=np.arange(64), **other)['masked_positions'])


def test_whole_word_mode_needs_the_word_starts():
  config = ml_collections.ConfigDict(dict(max_predictions=P, select_rate=0.15, mask_prob=0.8,
                                          random_prob=0.1, random_source='uniform',
                                          mode='whole_word', span_p=0.2, span_max_length=10))
  with pytest.raises(ValueError, match='word starts'):
    masking.make_masker_for_ids(config, V, None, S)


def test_slot_kinds_partition_the_masked_slots_in_the_configured_shares():
  ids = _rows(2000, seed=12)
  batch = _masker()(ids, seed=3, step=0, rows=np.arange(len(ids)))
  kinds, valid = batch['masked_kinds'], batch['masked_weights'] > 0
  np.testing.assert_array_equal(kinds > 0, valid)   # Every masked slot has one kind.
  r, pos, s = _selected(batch)
  shown, target = batch['input_ids'][r, pos], batch['masked_ids'][r, s]
  kind = kinds[r, s]
  assert np.all((shown == S.mask) == (kind == 1))
  assert np.all(shown[kind == 3] == target[kind == 3])  # Kept: the input shows the target.
  assert np.all(shown[kind == 2] != S.mask)
  shares = np.bincount(kind, minlength=4)[1:] / len(kind)
  n = len(kind)
  for share, expected in zip(shares, (0.8, 0.1, 0.1)):
    assert abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / n), shares


# RoBERTa's layout: <s>=0 <pad>=1 </s>=2 <unk>=3, <mask> the last id; 4 another special id.
ROBERTA = tok_lib.Specials(pad=1, unk=3, cls=0, sep=2, mask=V - 1,
                           tokens=('<pad>', '<unk>', '<s>', '</s>', '<mask>'))


@pytest.mark.parametrize('mode', masking.MODES)
def test_other_special_layouts_take_their_ids_from_the_specials(mode):
  rows = _rows(1000, seed=13, vocab_hi=V - 1)
  # The same rows in RoBERTa's ids: [CLS] 2 -> 0, [SEP] 3 -> 2, [PAD] 0 -> 1.
  ids = np.select([rows == S.cls, rows == S.sep, rows == S.pad], [0, 2, 1], rows)
  config = ml_collections.ConfigDict(dict(
      max_predictions=P, select_rate=0.15, mask_prob=0.5, random_prob=0.5,
      random_source='uniform', mode=mode, span_p=0.2, span_max_length=10))
  word_start = np.zeros(V, bool)
  word_start[::3] = True
  m = masking.make_masker_for_ids(config, V, None, ROBERTA, special_ids=(0, 1, 2, 3, 4, V - 1),
                                  word_start=word_start)
  batch = m(ids, seed=2, step=0, rows=np.arange(len(ids)))
  never = np.isin(ids, ROBERTA.never_masked)
  if mode != 'whole_word':  # Whole words may fall short of the budget.
    np.testing.assert_array_equal(batch['masked_weights'].sum(axis=1), _expected_k(rows))
  sel = _selected_mask(batch)
  assert sel.any() and not (sel & never).any()
  np.testing.assert_array_equal(batch['input_ids'][never], ids[never])
  np.testing.assert_array_equal(batch['attention_mask'], (ids != ROBERTA.pad).astype(np.int32))
  shown = batch['input_ids'][sel]
  replaced = shown[(shown != ids[sel])]
  assert (replaced == V - 1).mean() > 0.3          # [MASK] is the tokenizer's mask id...
  assert not np.isin(replaced[replaced != V - 1], (0, 1, 2, 3, 4)).any()  # ...no special drawn.
  # The same selection as with the default layout: only the ids differ.
  same = masking.make_masker_for_ids(config, V, None, S, word_start=word_start)(
      rows, seed=2, step=0, rows=np.arange(len(rows)))
  np.testing.assert_array_equal(batch['masked_positions'], same['masked_positions'])


# ---------------------------------------------------------------- rate schedules

def _scheduled(mode, schedule, p=64):
  """A masker of `mode` (rate 0.15 without a schedule) with `schedule` and room for 50%."""
  config = ml_collections.ConfigDict(dict(
      max_predictions=p, select_rate=0.15, mask_prob=0.8, random_prob=0.1,
      random_source='unigram', mode=mode, span_p=0.2, span_max_length=10))
  return masking.make_masker_for_ids(config, V, np.arange(V), S, word_start=WORD_START,
                                     rate_schedule=schedule)


def test_rate_schedules_as_functions_of_the_step():
  linear = masking.RateSchedule(10, 30, 0.3, 0.1, 'linear')
  np.testing.assert_allclose(linear.rate_at(np.array([0, 10, 20, 29, 30, 1000])),
                             [0.3, 0.3, 0.2, 0.3 - 0.2 * 19 / 20, 0.1, 0.1])
  assert linear.rate_at(30) == 0.1 and isinstance(linear.rate_at(20), float)
  step = masking.RateSchedule(0, 5, 0.3, 0.15, 'step')
  np.testing.assert_array_equal(step.rate_at(np.arange(8)), [0.3] * 5 + [0.15] * 3)
  assert masking.RateSchedule(0, 5, 0.2, 0.4, 'constant').rate_at(np.arange(9)).tolist() == [0.2] * 9
  # Counting from a phase's first step: nothing moves before it.
  later = masking.RateSchedule(100, 200, 0.15, 0.3, 'linear')
  np.testing.assert_allclose(later.rate_at(np.array([0, 100, 150, 200])), [0.15, 0.15, 0.225, 0.3])


@pytest.mark.parametrize('mode', masking.MODES)
def test_per_row_counts_follow_a_linear_schedule_exactly(mode):
  # 40 steps of 8 rows, masked in one call as a chunk of grain's is: each row
  # gets k = round(rate(its step) * n), the rate running from 0.5 down to 0.1.
  schedule = masking.RateSchedule(0, 30, 0.5, 0.1, 'linear')
  m = _scheduled(mode, schedule)
  ids = _rows(320, seed=14, vocab_lo=1000)
  steps = np.repeat(np.arange(40), 8)
  batch = m(ids, seed=5, step=steps, rows=np.arange(320))
  n = (~np.isin(ids, SPECIAL)).sum(axis=1)
  k = np.floor(schedule.rate_at(steps) * n + 0.5)
  assert len(np.unique(k)) > 20  # The rate really moves.
  np.testing.assert_array_equal(m.rate_at(steps), schedule.rate_at(steps))  # What a log reports.
  got = batch['masked_weights'].sum(axis=1)
  if mode == 'whole_word':  # Never a split word: short only where no word fits the rest.
    assert np.all(got <= k) and np.mean(got == k) > 0.9
  else:
    np.testing.assert_array_equal(got, k)
  assert not np.isin(ids[_selected_mask(batch)], SPECIAL).any()
  # The 80/10/10 split is the configured one whatever the rate.
  kinds = batch['masked_kinds'][batch['masked_weights'] > 0]
  assert abs(np.mean(kinds == 1) - 0.8) < 0.03
  # A row's mask depends on its own step only, not on the others in the call.
  alone = m(ids[:8], seed=5, step=0, rows=np.arange(8))
  for key in alone:
    np.testing.assert_array_equal(alone[key], batch[key][:8])


@pytest.mark.parametrize('mode', masking.MODES)
def test_step_schedule_switches_at_its_boundary(mode):
  m = _scheduled(mode, masking.RateSchedule(0, 100, 0.15, 0.4, 'step'))
  ids = _rows(400, seed=15, vocab_lo=1000)
  n = (~np.isin(ids, SPECIAL)).sum(axis=1)
  for step, rate in [(0, 0.15), (99, 0.15), (100, 0.4), (500, 0.4)]:
    got = m(ids, seed=1, step=step, rows=np.arange(400))['masked_weights'].sum(axis=1)
    k = np.floor(rate * n + 0.5)
    assert np.all(got <= k) and np.mean(got == k) > (0.9 if mode == 'whole_word' else 0.999)
    assert abs(got.sum() / n.sum() - rate) < 0.01


@pytest.mark.parametrize('mode', masking.MODES)
def test_no_schedule_masks_as_before(mode):
  # rate_schedule=None is today's masker; a constant schedule at select_rate
  # gives the same batch bit for bit.
  ids = _rows(200, seed=16)
  before = _mode_masker(mode)(ids, seed=3, step=7, rows=np.arange(200))
  config = base.get_config().masking
  config.update(dict(max_predictions=P, mode=mode))
  assert masking.RateSchedule.from_config(config, 0, 100) is None
  default = masking.make_masker_for_ids(config, V, np.arange(V), S, word_start=WORD_START)
  constant = masking.make_masker_for_ids(config, V, np.arange(V), S, word_start=WORD_START,
                                         rate_schedule=masking.RateSchedule(0, 9, 0.15, 0.3,
                                                                            'constant'))
  assert default.rate_at(5) == constant.rate_at(5) == 0.15
  for m in (default, constant):
    after = m(ids, seed=3, step=7, rows=np.arange(200))
    for key in before:
      np.testing.assert_array_equal(before[key], after[key])


def test_scheduled_masker_pickles_into_workers():
  m = _scheduled('span', masking.RateSchedule(0, 10, 0.3, 0.15, 'linear'))
  copy = pickle.loads(pickle.dumps(m))
  assert copy.rate_schedule == m.rate_schedule
  ids = _rows(40, seed=17)
  steps = np.repeat(np.arange(0, 20, 4), 8)
  a = m(ids, seed=2, step=steps, rows=np.arange(40))
  b = copy(ids, seed=2, step=steps, rows=np.arange(40))
  for key in a:
    np.testing.assert_array_equal(a[key], b[key])


def test_schedule_from_config_and_the_highest_rate():
  config = base.get_config().masking
  assert masking.max_rate(config) == 0.15
  config.update(dict(rate_schedule='step', select_rate=0.3, final_select_rate=0.15))
  assert masking.max_rate(config) == 0.3
  assert masking.RateSchedule.from_config(config, 5, 50) == masking.RateSchedule(
      start_step=5, end_step=50, start_rate=0.3, end_rate=0.15, kind='step')
  config.update(dict(rate_schedule='linear', select_rate=0.15, final_select_rate=0.4))
  assert masking.max_rate(config) == 0.4


def _schedule_config(**fields):
  config = base.get_config()
  config.data.seq_len = 130  # 128 maskable tokens at most.
  config.masking.max_predictions = 64
  config.masking.update(fields)
  return config.masking


@pytest.mark.parametrize('fields,words', [
    (dict(rate_schedule='cosine'),
     "config.masking.rate_schedule='cosine'"),
    (dict(rate_schedule='linear', final_select_rate=0.0),
     'config.masking.final_select_rate=0.0 must be in (0, 1]'),
    (dict(rate_schedule='step', final_select_rate=1.5),
     'config.masking.final_select_rate=1.5 must be in (0, 1]'),
    (dict(rate_change_tokens=-1), 'config.masking.rate_change_tokens=-1 must be >= 0'),
    # 0.6 * 128 = 76.8: P=64 is too small; the message names the P to set.
    (dict(rate_schedule='linear', final_select_rate=0.6),
     'set --config.masking.max_predictions=77 (the static P is sized for the highest rate)'),
])
def test_bad_rate_schedules_fail_in_one_line(fields, words):
  m = _schedule_config(**fields)
  with pytest.raises(ConfigError) as e:
    masking.check_config(m, 130)
  assert words in str(e.value) and '\n' not in str(e.value)


def test_a_schedule_within_p_passes_the_check():
  masking.check_config(_schedule_config(rate_schedule='linear', final_select_rate=0.5), 130)
  masking.check_config(_schedule_config(final_select_rate=0.9), 130)  # Unused when constant.
