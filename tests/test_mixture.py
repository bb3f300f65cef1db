"""Weighted mixtures of corpora: the draw, its config checks, training, resume, reports."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import types
import zlib

import jax
import numpy as np
import pytest

from mlm_jax.config import checks
from mlm_jax.config import fields
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import mixture
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.errors import ConfigError
from mlm_jax.training import preemption
from tests.conftest import REPO
from tests.conftest import micro_config
from tests.conftest import run_training
from tests.conftest import write_config_file
from tests.test_train import _params
from tests.test_train import _records

DOCS = [re.sub(r'\n\s*\n', '\n', d) for d, _ in zip(corpus.stdlib_docstrings(), range(600))]


def test_rows_are_drawn_in_the_weights_ratio_by_position_alone():
  mix = mixture.Mixture([0.8, 0.2], [500, 300], seed=3)
  batch, steps = 16, 500
  member, drawn = mix.draw(np.arange(batch * steps))
  per_step = np.bincount(np.repeat(np.arange(steps), batch), weights=member == 1,
                         minlength=steps)
  # Tolerance: every batch holds each source's share of its rows to within one row.
  assert np.all(np.abs(per_step - 0.2 * batch) <= 1)
  assert abs((member == 1).mean() - 0.2) < 1 / (batch * steps) + 1e-12
  # A member's k-th row is its k-th draw; the closed-form counts agree with the draw.
  for k in (0, 1):
    np.testing.assert_array_equal(drawn[member == k], np.arange((member == k).sum()))
  np.testing.assert_array_equal(mix.rows_drawn(batch * steps), np.bincount(member))
  # Any slice of positions, in any order, draws the same (processes, resumes).
  positions = np.random.default_rng(0).permutation(batch * steps)[:700]
  np.testing.assert_array_equal(mix.draw(positions)[0], member[positions])
  flat = mix(np.arange(batch * steps), shuffle=pipeline.stream_to_source)
  np.testing.assert_array_equal(mix(positions, shuffle=pipeline.stream_to_source),
                                flat[positions])
  # Each epoch of a member is a permutation of its rows (flat indices offset per member).
  first_epoch = flat[member == 1][:300]
  assert sorted(first_epoch) == list(range(500, 800))
  assert not np.array_equal(mixture.Mixture([0.8, 0.2], [500, 300], seed=4).draw(
      np.arange(100))[0], member[:100])                    # The seed moves the pattern.


def test_an_epoch_cap_ends_a_member_and_the_others_take_its_share():
  mix = mixture.Mixture([0.5, 0.3, 0.2], [40, 30, 20], seed=0, max_epochs=[0, 2, 1])
  member, drawn = mix.draw(np.arange(2000))
  counts = np.bincount(member, minlength=3)
  assert counts[1] == 60 and counts[2] == 20                 # 2 epochs of 30, 1 of 20.
  assert counts[0] == 2000 - 80 and mix.max_rows is None
  last = max(np.flatnonzero(member == 1)[-1], np.flatnonzero(member == 2)[-1])
  assert np.all(member[last + 1:] == 0)
  # Before the first cap, the three share the rows by weight.
  head = member[:100]
  assert abs((head == 0).mean() - 0.5) <= 0.02 and abs((head == 2).mean() - 0.2) <= 0.02
  # When every member is capped, the mixture has an end and a run past it is refused early.
  capped = mixture.Mixture([1, 1], [10, 10], seed=0, max_epochs=[1, 3])
  assert capped.max_rows == 40
  with pytest.raises(ValueError, match='past the 40 rows'):
    capped.draw(np.array([40]))
  with pytest.raises(ConfigError, match=r'allow 40 rows, 5 steps of 8.*num_steps=6'):
    mixture.check_steps(capped, 6, 8, ['a', 'b'])
  mixture.check_steps(capped, 5, 8, ['a', 'b'])


def test_shares_follow_source_sizes_by_temperature_in_closed_form():
  tokens = [1_000, 4_000, 16_000]   # Sizes 1 : 4 : 16.
  # tau=1: in proportion to size; 0.5: to size squared; 2: to its square root.
  for tau, expected in [(1, [1, 4, 16]), (0.5, [1, 16, 256]), (2, [1, 2, 4])]:
    np.testing.assert_allclose(mixture.shares([1, 1, 1], tokens, tau),
                               np.array(expected) / sum(expected), rtol=1e-12)
  # A weight multiplies its source's share before the shares are normalised.
  np.testing.assert_allclose(mixture.shares([2, 1, 1], tokens, 1), np.array([2, 4, 16]) / 22,
                             rtol=1e-12)
  # Temperature 0: the weights, handed to the draw unchanged (so its rounding is as before).
  assert mixture.draw_weights([0.8, 0.2], [5, 1], 0).tolist() == [0.8, 0.2]
  # Sizes far apart at a low temperature stay finite.
  assert mixture.shares([1, 1], [10**12, 1], 0.05)[0] == 1.0
  # The draw holds the shares in every batch of 16: the first source to within a row, the
  # nested ones to within a row per source before them; over 4,800 rows to within 3 rows.
  weights = mixture.draw_weights([1, 1, 1], tokens, 2)
  member, _ = mixture.Mixture(weights, [100, 100, 100], seed=0).draw(np.arange(16 * 300))
  per_batch = np.stack([np.bincount(b, minlength=3) for b in member.reshape(300, 16)])
  error = np.abs(per_batch - 16 * np.array([1, 2, 4]) / 7).max(axis=0)
  assert error[0] < 1 and np.all(error < 2)
  assert np.all(np.abs(np.bincount(member) - 4800 * np.array([1, 2, 4]) / 7) < 3)


def test_a_mixture_without_a_continuation_draws_what_it_always_drew():
  # Digests of (member, row count, flat row) at positions 0..999 drawn by the mixture
  # before it could continue another: a capped three-source one and a two-source one.
  for args, digest in [(([0.5, 0.3, 0.2], [40, 30, 20], 0, [0, 2, 1]), 379252780),
                       (([0.8, 0.2], [500, 300], 3, None), 3981657029)]:
    for mix in (mixture.Mixture(*args),
                mixture.Mixture(*args, start_position=0, rows_before=[0] * len(args[1]))):
      positions = np.arange(1000)
      member, drawn = mix.draw(positions)
      flat = mix(positions, shuffle=pipeline.stream_to_source)
      assert zlib.crc32(np.stack([member, drawn, flat]).astype(np.int64).tobytes()) == digest


def test_a_continuing_mixture_goes_on_with_each_source_stream_at_its_new_shares():
  rows = [50, 30, 20]
  first = mixture.Mixture([0.6, 0.3, 0.1], rows, seed=1, max_epochs=[0, 0, 10])
  change, after = 537, 16 * 60   # The change falls inside a batch of 16.
  second = first.continued(change, [0.2, 0.3, 0.5])
  explicit = mixture.Mixture([0.2, 0.3, 0.5], rows, 1, [0, 0, 10], start_position=change,
                             rows_before=first.rows_drawn(change))
  positions = np.arange(change, change + after)
  np.testing.assert_array_equal(second.draw(positions), explicit.draw(positions))
  member = np.concatenate([first.draw(np.arange(change))[0], second.draw(positions)[0]])
  drawn = np.concatenate([first.draw(np.arange(change))[1], second.draw(positions)[1]])
  flat = np.concatenate([first(np.arange(change), shuffle=pipeline.stream_to_source),
                         second(positions, shuffle=pipeline.stream_to_source)])
  offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
  for k, n in enumerate(rows):
    # Each source's draws across the change are rows 0, 1, 2, ... of its own stream, so every
    # epoch of it is its rows once each, the epoch that spans the change included.
    np.testing.assert_array_equal(drawn[member == k], np.arange((member == k).sum()))
    mine = flat[member == k]
    for e in range(len(mine) // n):
      assert sorted(mine[e * n:(e + 1) * n]) == list(range(offsets[k], offsets[k] + n))
  # The cap counts the rows drawn before the change: source 2 gives 10 epochs in all.
  assert (member == 2).sum() == 200
  np.testing.assert_array_equal(second.rows_drawn(change + after),
                                np.bincount(member, minlength=3))
  # After the change, every batch of 16 holds the new shares to within a row (in this draw;
  # the nested sources' bound is a row per source before them), until the cap.
  capped_at = np.flatnonzero(member == 2)[-1] - change
  windows = second.draw(positions[:capped_at // 16 * 16])[0].reshape(-1, 16)
  counts = np.stack([np.bincount(w, minlength=3) for w in windows])
  assert len(counts) >= 5 and np.all(np.abs(counts - 16 * np.array([0.2, 0.3, 0.5])) <= 1)
  # Positions before the change are the earlier mixture's.
  with pytest.raises(ValueError, match='before 537'):
    second.draw(np.array([536]))
  with pytest.raises(ValueError, match='before 537'):
    second.rows_drawn(500)


class _Rows:
  """A source's train rows [n, T]: what MixtureRun reads of a prepared split."""

  def __init__(self, rows: np.ndarray):
    self.rows = rows

  def __len__(self) -> int:
    return len(self.rows)

  def read(self, indices: np.ndarray) -> np.ndarray:
    return self.rows[indices]


def _three_sources(tmp_path, temperature: float):
  """A config and prepared data of three sources of 10, 40 and 160 rows of T=32 (each last
  row with 5 padding slots), without preparing anything."""
  config = micro_config('', str(tmp_path / 'data'))
  config.data.sources = tuple({'corpus': n, 'name': n} for n in ('small', 'mid', 'large'))
  config.data.temperature = temperature
  config.train.num_steps = 100
  sources = []
  for n in (10, 40, 160):
    rows = np.ones((n, 32), np.int32)
    rows[-1, -5:] = 0   # [PAD].
    sources.append(_Rows(rows))
  data = types.SimpleNamespace(
      stats={'parts': [{'train': {'tokens': 30 * len(s) - 5}} for s in sources]},
      tokenizer=types.SimpleNamespace(specials=types.SimpleNamespace(pad=0)),
      source=lambda split, k: sources[k])
  return config, data


def test_a_mixture_run_logs_its_shares_and_continues_at_another_temperature(tmp_path, caplog):
  from mlm_jax.training import mixture_run
  config, data = _three_sources(tmp_path, temperature=1.0)
  caplog.set_level(logging.INFO, logger='absl')
  run = mixture_run.MixtureRun(config, data, 0, {})
  sizes = np.array([30 * n - 5 for n in (10, 40, 160)])
  np.testing.assert_allclose(run.shares, sizes / sizes.sum())
  assert ('Mixture drawn from position 0, temperature 1: small 0.0469 (295 train tokens), '
          'mid 0.1901 (1,195 train tokens), large 0.7629 (4,795 train tokens)') in caplog.text
  figures = [run.figures(step) for step in (2, 4, 6)]   # Logged every 2 steps of 16 rows.
  for f in figures:
    shares = np.array([f[f'share/{n}'] for n in ('small', 'mid', 'large')])
    assert shares.sum() == pytest.approx(1)
    assert np.all(np.abs(shares * 32 - run.shares * 32) < 2)   # Rows of the interval.
  assert figures[-1]['epochs_seen/large'] == run.mix.rows_drawn(96)[2] / 160
  assert sum(figures[-1][f'tokens_seen/{n}'] for n in ('small', 'mid', 'large')) <= 96 * 32

  # A later phase at temperature 4 from step 6 on: each stream goes on, the counts carry on.
  later_config, _ = _three_sources(tmp_path, temperature=4.0)
  later = mixture_run.MixtureRun(later_config, data, 6, {}, **run.handover(96))
  np.testing.assert_array_equal(later.mix.rows_before, run.mix.rows_drawn(96))
  expected = (sizes ** 0.25) / (sizes ** 0.25).sum()
  np.testing.assert_allclose(later.shares, expected)
  after = later.figures(20)
  shares = np.array([after[f'share/{n}'] for n in ('small', 'mid', 'large')])
  assert np.all(np.abs(shares * 224 - expected * 224) < 2)   # 14 steps of 16 rows.
  whole = run.tokens_between(0, 96) + later.tokens_between(96, 320)
  assert [after[f'tokens_seen/{n}'] for n in ('small', 'mid', 'large')] == whole.tolist()
  # Resumed at step 20 without the log: the tokens are counted again from the boundary on.
  resumed = mixture_run.MixtureRun(later_config, data, 20, {}, **run.handover(96))
  assert resumed.figures(20)['tokens_seen/large'] == after['tokens_seen/large']


@pytest.mark.parametrize('sources, message', [
    (({'corpus': 'a', 'weight': 0},), r'sources\[0\].weight=0 must be a number > 0'),
    (({'corpus': 'a', 'weight': float('nan')},), r'weight=nan must be'),
    (({'corpus': 'a'},), r"sources\[0\] has no 'weight'"),
    (({'corpus': 'a', 'weight': 1, 'wieght': 2},), r"unknown fields \['wieght'\]"),
    (({'corpus': 'a', 'weight': 1, 'max_epochs': -1},), r'max_epochs=-1 must be'),
    (({'corpus': 'a', 'weight': 1, 'name': 'x'}, {'corpus': 'b', 'weight': 1, 'name': 'x'}),
     r"name='x' names two sources"),
    (({'corpus': 'a', 'weight': 1, 'name': 'a b'},), r"name='a b' may hold only"),
    (('a.txt',), r'must be a dict'),
    (({'corpus': 'a', 'weight': 1}, {'corpus': 'b', 'weight': 1}, -1.0),
     r'temperature=-1.0 must be a number > 0'),
    (({'corpus': 'a', 'weight': 1}, {'corpus': 'b', 'weight': 1}, 0.0),
     r'temperature=0.0 must be a number > 0'),
    (({'corpus': 'a', 'weight': 1}, 0.7), r'temperature=0.7 needs a mixture of two or more'),
    ((0.7,), r'temperature=0.7 needs a mixture of two or more'),
])
def test_an_invalid_mixture_is_one_line_naming_the_field(tmp_path, sources, message):
  """A trailing number in `sources` is config.data.temperature; () alone: one corpus."""
  config = micro_config('', str(tmp_path / 'data'))
  if sources and isinstance(sources[-1], float):
    sources, config.data.temperature = sources[:-1], sources[-1]
  if sources:
    config.data.sources = sources
  else:
    config.data.corpus = 'a.txt'
  with pytest.raises(ConfigError, match=message) as raised:
    checks.validate(config, check_paths=False)
  assert '\n' not in str(raised.value)


def test_with_a_temperature_a_weight_is_optional(tmp_path):
  config = micro_config('', str(tmp_path / 'data'))
  config.data.sources = ({'corpus': 'a', 'name': 'a'}, {'corpus': 'b', 'weight': 3})
  config.data.temperature = 1.0
  checks.validate(config, check_paths=False)
  assert [m.weight for m in mixture.members(config.data)] == [1.0, 3.0]


def test_a_mixture_with_a_corpus_or_a_missing_member_is_refused(tmp_path):
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS[:10]))
  config = micro_config(str(tmp_path / 'a.txt'), str(tmp_path / 'data'))
  config.data.sources = ({'corpus': str(tmp_path / 'a.txt'), 'weight': 1},)
  with pytest.raises(ConfigError, match='sources and config.data.corpus'):
    checks.validate(config)
  config.data.corpus = ''
  config.data.sources = ({'corpus': str(tmp_path / 'a.txt'), 'weight': 1},
                         {'corpus': str(tmp_path / 'none.txt'), 'weight': 1})
  with pytest.raises(ConfigError,
                     match=r"config.data.sources\[1\].corpus=.*none.txt': no such file"):
    checks.validate(config)


def _mixture_config(tmp_path, **train):
  """Two sources: 'domain' (jsonl) at 0.8 and 'general' (text) at 0.2."""
  (tmp_path / 'domain.jsonl').write_text(
      ''.join(json.dumps({'text': d}) + '\n' for d in DOCS[:300]))
  (tmp_path / 'general.txt').write_text('\n\n'.join(DOCS[300:]))
  config = micro_config('', str(tmp_path / 'data'))
  config.data.sources = (
      {'corpus': str(tmp_path / 'domain.jsonl'), 'weight': 0.8, 'name': 'domain'},
      {'corpus': str(tmp_path / 'general.txt'), 'weight': 0.2, 'name': 'general'})
  config.data.num_workers = 1
  for k, v in train.items():
    config.train[k] = v
  return config


def _unmasked(batch: dict) -> np.ndarray:
  """The rows a batch was masked from: its input ids with the masked slots' targets put back."""
  rows = batch['input_ids'].copy()
  r, s = np.nonzero(batch['masked_weights'])
  rows[r, batch['masked_positions'][r, s]] = batch['masked_ids'][r, s]
  return rows


@pytest.mark.slow
def test_a_mixture_trains_in_its_ratio_resumes_exactly_and_reports_per_source(tmp_path):
  config = _mixture_config(tmp_path, num_steps=10, log_every=2, eval_every=5,
                           checkpoint_every=5)
  checks.validate(config)
  data = prepare.prepare(*fields.data_request(config))
  assert data.num_parts == 2 and data.part_names == ('domain', 'general')
  parts = data.stats['parts']
  assert parts[0]['train']['documents'] + parts[0]['validation']['documents'] == 300
  assert data.stats['train']['rows'] == parts[0]['train']['rows'] + parts[1]['train']['rows']
  # The batches hold rows of each source in the weights' ratio (each row found among the
  # source's own rows), the same for 1 and 2 processes.
  sets = [{row.tobytes() for row in data.source('train', k).read(
      np.arange(len(data.source('train', k))))} for k in (0, 1)]
  from mlm_jax.training import mixture_run
  run = mixture_run.MixtureRun(config, data, 0, {})
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  kwargs = dict(global_batch=16, seed=config.seed, order=run.order)
  one = pipeline.train_batches(data.source('train'), masker, **kwargs)
  halves = [pipeline.train_batches(data.source('train'), masker, process_index=p,
                                   process_count=2, **kwargs) for p in (0, 1)]
  general = 0
  for _ in range(100):
    batch = next(one)
    rows = _unmasked(batch)
    in_general = np.array([row.tobytes() in sets[1] for row in rows])
    assert all(row.tobytes() in sets[0] for row in rows[~in_general])
    assert abs(in_general.sum() - 0.2 * 16) <= 1
    general += in_general.sum()
    split = [next(h) for h in halves]
    np.testing.assert_array_equal(batch['input_ids'],
                                  np.concatenate([s['input_ids'] for s in split]))
  assert abs(general / 1600 - 0.2) <= 0.001
  for it in [one, *halves]:
    it.close()

  # Train 10 steps, stopped by SIGTERM after step 3 and run again: bit-identical to a
  # run that never stopped.
  whole = str(tmp_path / 'whole')
  run_training(config, whole)
  stopped = str(tmp_path / 'stopped')
  old = preemption._TEST_SIGNAL
  preemption._TEST_SIGNAL = (signal.SIGTERM, 'step', 3)
  try:
    assert run_training(config, stopped)['step'] == 3
  finally:
    preemption._TEST_SIGNAL = old
  assert run_training(config, stopped)['step'] == 10
  for a, b in zip(jax.tree_util.tree_leaves(_params(whole, 10, config)),
                  jax.tree_util.tree_leaves(_params(stopped, 10, config))):
    np.testing.assert_array_equal(a, b)
  records = {r['step']: r for r in _records(whole) if 'loss' in r}
  resumed = {r['step']: r for r in _records(stopped) if 'loss' in r}
  for step in (2, 4, 6, 8, 10):
    r = records[step]
    assert r['tokens_seen/domain'] + r['tokens_seen/general'] == r['tokens_seen']
    # The drawn shares of each log interval (2 batches of 16): 0.8/0.2 to within a row a batch.
    assert r['share/domain'] + r['share/general'] == pytest.approx(1)
    assert abs(r['share/general'] - 0.2) * 32 <= 2
    assert r['epochs_seen/general'] == pytest.approx(
        run.mix.rows_drawn(step * 16)[1] / run.mix.rows[1])
    for key in ('tokens_seen/domain', 'tokens_seen/general', 'epochs_seen/domain'):
      assert resumed[step][key] == r[key], (step, key)
  evals = [r for r in _records(whole) if 'eval_loss' in r]
  assert {'eval_mask_accuracy/domain', 'eval_mask_accuracy/general',
          'eval_loss/domain', 'eval_mask_accuracy'} <= set(evals[-1])
  summary = json.loads((tmp_path / 'whole' / 'summary.json').read_text())
  assert 'eval_mask_accuracy/general' in summary


@pytest.mark.slow
def test_a_mixture_given_on_the_command_line_trains_and_prints_each_source(tmp_path):
  config = _mixture_config(tmp_path)
  config_file = write_config_file(tmp_path / 'c.py', '', str(tmp_path / 'data'), num_steps=4,
                                  log_every=2, eval_every=4, checkpoint_every=4)
  sources = repr(tuple(dict(s) for s in config.data.sources))
  out = subprocess.run([sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}',
                        f'--workdir={tmp_path / "run"}', f'--config.data.sources={sources}'],
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert out.returncode == 0, out.stderr[-3000:]
  assert re.search(r'by source at \[MASK\] slots: domain [\d.]+, general [\d.]+', out.stdout)
  assert 'tokens_seen/general=' in out.stderr
  bad = subprocess.run([sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}',
                        f'--workdir={tmp_path / "bad"}',
                        "--config.data.sources=({'corpus': 'x', 'weight': -1},)"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and 'weight=-1 must be a number > 0' in bad.stderr
  assert not (tmp_path / 'bad').exists()
