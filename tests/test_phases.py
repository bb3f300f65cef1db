"""A run in phases (config.phases) and the batch warm-up: the plan, its checks, and a run that
resumes bit-identically from a kill in its second phase."""

import json
import os
import signal
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from mlm_jax.config import checks
from mlm_jax.config import run_plan
from mlm_jax.config import phases
from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint
from mlm_jax.training import optimizer
from tests.conftest import REPO
from tests.conftest import as_modern
from tests.conftest import micro_config


def _phased(config: ml_collections.ConfigDict, data_dir: str = '') -> ml_collections.ConfigDict:
  """The micro config (modern: rotary positions) in three phases, the batch warming up in the
  first: T=32 at 15%; T=64 with the rate falling linearly from 30% to 15%; a fresh optimizer
  at 15%."""
  config = as_modern(config)
  config.train.batch_warmup_tokens = 8 * 32 * 3   # 3 steps of 8 rows, then 16.
  config.train.batch_warmup_start = 8
  config.train.grad_accum_steps = 2
  config.train.log_every, config.train.eval_every, config.train.checkpoint_every = 1, 100, 2
  long_data = {'seq_len': 64}
  if data_dir:
    long_data['data_dir'] = data_dir + '-T64'
  config.phases = (
      dict(name='short', steps=6,
           overrides=dict(train=dict(schedule='constant', warmup_steps=2))),
      dict(name='long', tokens=6 * 16 * 64,
           overrides=dict(data=long_data, model=dict(max_position_embeddings=64),
                          masking=dict(select_rate=0.3, final_select_rate=0.15,
                                       rate_schedule='linear', max_predictions=20),
                          train=dict(schedule='decay', warmup_steps=0, decay_shape='1-sqrt'))),
      dict(name='fresh', steps=2, fresh_optimizer=True,
           overrides=dict(train=dict(schedule='constant', learning_rate=1e-3),
                          masking=dict(rate_schedule='constant', select_rate=0.15))),
  )
  return config


@pytest.fixture
def config(tmp_path):
  return _phased(micro_config(str(tmp_path / 'none.txt'), ''))


# ------------------------------------------------------------------ the plan


def test_the_plan_places_every_step_in_its_phase_with_its_batch_and_rows(config):
  plan = phases.Plan(config)
  assert [(p.name, p.start_step, p.end_step) for p in plan.phases] == [
      ('short', 0, 6), ('long', 6, 12), ('fresh', 12, 14)]
  assert plan.num_steps == 14
  np.testing.assert_array_equal(plan.batch_size(np.arange(14)), [8] * 3 + [16] * 11)
  assert [p.config.train.num_steps for p in plan.phases] == [6, 12, 14]  # The loop's end.
  # Rows and nominal tokens (rows x T) add up step by step, T changing at the boundary.
  np.testing.assert_array_equal(plan.rows_before([0, 3, 6, 12]), [0, 24, 72, 168])
  np.testing.assert_array_equal(plan.tokens_before([6, 12]), [72 * 32, 72 * 32 + 96 * 64])
  assert plan.steps_for_tokens(6, 6 * 16 * 64) == 6


def test_batches_that_grow_take_every_row_of_the_stream_once_in_order(config):
  plan = phases.Plan(config)
  positions = plan.positions(np.arange(14), capacity=16, micro_batches=2)
  real = positions[positions >= 0]
  np.testing.assert_array_equal(np.sort(real), np.arange(plan.rows_before(14)))
  # A half batch fills micro-batch 0 (rows 0, 2, 4, ...: step.split_rows), the rest is padding.
  assert (positions[0, 0::2] >= 0).all() and (positions[0, 1::2] == -1).all()
  assert (positions[3:] >= 0).all()
  np.testing.assert_array_equal(plan.batch_size(np.arange(14)), (positions >= 0).sum(axis=1))


def test_the_masking_rate_follows_each_phase(config):
  plan = phases.Plan(config)
  rates = plan.masking_rate(np.arange(14))
  np.testing.assert_allclose(rates[:6], 0.15)
  np.testing.assert_allclose(rates[6:12], 0.3 + (0.15 - 0.3) * np.arange(6) / 6)
  np.testing.assert_allclose(rates[12:], 0.15)  # A step at the boundary.


def test_the_learning_rate_continues_over_phases_and_restarts_with_a_fresh_optimizer(config):
  plan = phases.Plan(config)
  run = optimizer.run_schedule(plan.phases)
  lr = config.train.learning_rate
  np.testing.assert_allclose([float(run(s)) for s in (0, 1, 2, 5)], [0, lr / 2, lr, lr],
                             rtol=1e-6)
  # 'long' decays from the peak as 1 - sqrt over its 6 steps.
  np.testing.assert_allclose([float(run(s)) for s in range(6, 12)],
                             lr * (1 - np.sqrt(np.arange(6) / 6)), rtol=1e-6)
  np.testing.assert_allclose(float(run(12)), 1e-3, rtol=1e-6)
  # A fresh optimizer counts from 0 at step 12: its rate at count c is the run's at 12 + c.
  fresh = optimizer.run_schedule(plan.phases, phases.learning_rate_offset(plan, plan.phases[2]))
  assert float(fresh(0)) == float(run(12))


def test_a_config_without_phases_is_one_phase_of_itself():
  config = micro_config('x', '')
  plan = phases.Plan(config)
  assert len(plan.phases) == 1 and plan.phases[0].config is config
  np.testing.assert_array_equal(plan.positions(np.array([0, 5]), 16, 1),
                                np.arange(16)[None, :] + np.array([[0], [80]]))


@pytest.mark.parametrize('change,message', [
    (lambda c: c.phases[1]['overrides']['model'].update(hidden_size=64),
     r"phase 'long' sets config.model.hidden_size=64, but the run has 32: .*shape"),
    (lambda c: c.phases[1]['overrides']['train'].update(optimizer='stable_adamw'),
     r'needs fresh_optimizer=True'),
    (lambda c: c.phases[0].update(steps=2),
     r"lasts 2 steps but the batch warm-up .* takes 3"),
    (lambda c: c.phases[0]['overrides']['train'].update(warmup_steps=9),
     r"phase 'short': config.train.warmup_steps=9 is longer than the phase \(6 steps\)"),
    (lambda c: c.phases[1]['overrides']['masking'].update(rate_change_tokens=10**6),
     r"rate_change_tokens=1,000,000 is longer than the phase"),
    (lambda c: c.phases[1].update(steps=3),
     r'exactly one of steps or tokens'),
    (lambda c: c.phases[1]['overrides']['data'].update(seq_lenn=3),
     r"overrides config.data.seq_lenn, which does not exist"),
    (lambda c: c.phases[0]['overrides'].update(tokenizer=dict(vocab_size=10)),
     r'the tokenizer and seed hold for the whole run'),
    (lambda c: c.phases[1]['overrides']['masking'].update(max_predictions=8),
     r'max_predictions'),
    (lambda c: c.phases[1]['overrides']['train'].update(batch_warmup_tokens=100),
     r"the batch warm-up is the run's, from its first step"),
    (lambda c: c.phases[1]['overrides']['model'].update(layer_norm_eps=1e-6),
     r"sets config.model.layer_norm_eps=1e-06, but the run has 1e-05: the model's architecture"),
    (lambda c: c.phases[1]['overrides'].update(mesh=dict(fsdp=2)),
     r"sets config.mesh.fsdp=2, but the run has 1"),
])
def test_bad_phases_are_one_line_naming_the_fix(config, change, message):
  config.phases = tuple(json.loads(json.dumps(config.phases)))  # Mutable copies.
  change(config)
  with pytest.raises(ConfigError, match=message) as e:
    checks.validate(config, 1, check_paths=False)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('train,message', [
    (dict(grad_accum_steps=1), r'set config.train.grad_accum_steps'),
    (dict(batch_warmup_start=5), r'batch_warmup_start=5 must be a multiple of the micro-batch'),
    (dict(batch_warmup_tokens=-1), r'must be >= 0'),
    # Sizes 12, 24, ...: 16 is none of them; 8 divides it.
    (dict(grad_accum_steps=4, batch_warmup_start=12),
     r'batch_size=16 must be a multiple of it \(e.g. batch_warmup_start=8\)'),
])
def test_a_bad_batch_warm_up_is_one_line(config, train, message):
  config.phases = ()
  config.train.update(train)
  with pytest.raises(ConfigError, match=message):
    checks.validate(config, 1, check_paths=False)


def test_a_phase_with_other_rows_needs_its_own_data_dir(config):
  config.data.data_dir = '/somewhere'
  with pytest.raises(ConfigError, match=r"phase 'long' changes config.data but "
                     r"keeps config.data.data_dir='/somewhere'"):
    checks.validate(config, 1, check_paths=False)


# ------------------------------------------------------------------- the run


def _config_file(path, corpus_glob, data_dir):
  path.write_text(
      'import sys\n'
      f'sys.path.insert(0, {str(REPO)!r})\n'
      'from tests.conftest import micro_config\n'
      'from tests.test_phases import _phased\n\n'
      'def get_config():\n'
      f'  return _phased(micro_config({corpus_glob!r}, {data_dir!r}), {data_dir!r})\n')
  return str(path)


def _train(config_file, workdir, env=None):
  return subprocess.run([sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}',
                         f'--workdir={workdir}'], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env=env)


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if '"loss"' in line]


@pytest.fixture(scope='module')
def phased_run(prepared, tmp_path_factory):
  """An uninterrupted run of the three phases (subprocess, as a user runs it)."""
  config, data = prepared
  tmp = tmp_path_factory.mktemp('phases')
  config_file = _config_file(tmp / 'phased.py', config.data.corpus, data.data_dir)
  workdir = str(tmp / 'uninterrupted')
  out = _train(config_file, workdir)
  assert out.returncode == 0, out.stderr[-3000:]
  return config_file, workdir, out


@pytest.mark.slow
def test_every_logged_step_names_its_phase_batch_rate_and_tokens(phased_run):
  config_file, workdir, out = phased_run
  plan = phases.Plan(_phased(micro_config('x', 'd'), 'd'))
  records = _records(workdir)
  assert [r['step'] for r in records] == list(range(1, 15))
  for r in records:
    s = r['step'] - 1  # The step just taken.
    assert r['phase'] == plan.phase_at(s).name
    assert r['batch_size'] == plan.batch_size(s)
    assert r['masking_rate'] == pytest.approx(plan.masking_rate(s)[0])
    assert r['planned_tokens'] == plan.tokens_before(s + 1)
  # Real tokens: every row of the micro corpus is full but a split's last.
  assert records[-1]['tokens_seen'] <= plan.tokens_before(14)
  assert records[-1]['tokens_seen'] > 0.9 * plan.tokens_before(14)
  # The masks drawn at each step hold its rate: |M| / maskable tokens.
  for name in ('short', 'long', 'fresh'):
    assert f"Phase {['short', 'long', 'fresh'].index(name) + 1}/3 '{name}'" in out.stderr
  with open(os.path.join(workdir, 'phases.json')) as f:
    assert [p['phase'] for p in json.load(f)] == ['short', 'long', 'fresh']
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['data']['seq_len'] == 64  # The last phase's config.


@pytest.mark.slow
def test_a_run_killed_in_its_second_phase_resumes_bit_identically(phased_run, tmp_path):
  config_file, reference, _ = phased_run
  workdir = str(tmp_path / 'killed')
  # Killed as it is about to save step 10, inside 'long': step 8's checkpoint is the last.
  env = dict(os.environ, MLM_JAX_TEST_SIGNAL='SIGKILL@save:10')
  out = _train(config_file, workdir, env)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  assert checkpoint.latest_step(os.path.join(workdir, 'checkpoints')) == 8
  out = _train(config_file, workdir)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'at step 8' in out.stderr
  final = [checkpoint.restore_params(os.path.join(w, 'checkpoints'))
           for w in (reference, workdir)]
  assert final[0][0] == final[1][0] == 14
  for a, b in zip(jax.tree_util.tree_leaves(final[0][1]), jax.tree_util.tree_leaves(final[1][1])):
    np.testing.assert_array_equal(a, b)
  # The metrics of the steps after the kill are the uninterrupted run's.
  ref = {r['step']: r['loss'] for r in _records(reference)}
  assert all(ref[r['step']] == r['loss'] for r in _records(workdir) if r['step'] > 8)


def test_steps_given_on_the_command_line_to_a_run_in_phases_are_refused(config):
  with pytest.raises(ConfigError, match=r'run is in phases .* give each phase its '
                     r'steps or tokens'):
    run_plan.resolve(config, 1, ['train.num_steps'])


def test_a_phase_that_changes_the_shares_continues_each_sources_stream(tmp_path):
  from mlm_jax.training import loop
  from mlm_jax.training import mixture_run
  from tests.test_mixture import _three_sources
  config, data = _three_sources(tmp_path, temperature=1.0)
  config = as_modern(config)  # Rotary positions: a phase may lengthen the rows.
  data.num_parts = 3
  config.train.batch_warmup_tokens, config.train.batch_warmup_start = 8 * 32 * 2, 8
  config.train.grad_accum_steps = 2
  config.phases = (dict(name='near', steps=6), dict(name='far', steps=6, overrides=dict(
      data=dict(temperature=4.0))), dict(name='long', steps=4, overrides=dict(
          data=dict(seq_len=64, data_dir=str(tmp_path / 'data-T64')),
          model=dict(max_position_embeddings=64))))
  plan = phases.Plan(config)
  near, far, long = plan.phases
  boundary = int(plan.rows_before(far.start_step))
  assert boundary == 2 * 8 + 4 * 16
  first = mixture_run.MixtureRun(near.config, data, 0, {},
                                 position_of=lambda s: int(plan.rows_before(s)))
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  # Without the hand-over 'near' records at its last step, 'far' cannot know where it stands.
  with pytest.raises(checkpoint.CheckpointReadError, match="no record of where the mixture"):
    loop._mixture(workdir, data, plan, far, far.start_step, {})  # pylint: disable=protected-access
  loop._hand_over(workdir, plan, near, first)  # pylint: disable=protected-access
  run = loop._mixture(workdir, data, plan, far, far.start_step, {})  # pylint: disable=protected-access
  assert run.mix.start_position == boundary
  np.testing.assert_array_equal(run.mix.rows_before, first.mix.rows_drawn(boundary))
  sizes = np.array([30 * n - 5 for n in (10, 40, 160)])
  np.testing.assert_allclose(run.shares, sizes ** 0.25 / (sizes ** 0.25).sum())
  # Other rows (another length): the sources' streams start anew at the phase's first row.
  loop._hand_over(workdir, plan, far, run)  # pylint: disable=protected-access: records nothing
  other = loop._mixture(workdir, data, plan, long, long.start_step, {})  # pylint: disable=protected-access
  assert other.mix.start_position == int(plan.rows_before(long.start_step))
  assert not np.any(other.mix.rows_before)


def test_a_phase_that_changes_only_runtime_fields_reads_the_same_rows(tmp_path, corpus_glob):
  """Worker counts, the tfds export, prefetch, cadence: the same data dir, the same tokenizer,
  and the mixture's streams go on from where the phase before left them."""
  from mlm_jax.config import fields
  from mlm_jax.data import prepared
  from mlm_jax.training import loop
  from mlm_jax.training import mixture_run
  from tests.test_mixture import _three_sources
  runtime = dict(data=dict(num_workers=3, tfds_export=True), input=dict(worker_count=2,
                                                                        prefetch=4),
                 train=dict(log_every=2, checkpoint_every=3))
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  # Two sources of real files, their data dir named by the fingerprint (no data_dir given).
  config = micro_config(corpus_glob, '')
  config.data.sources = ({'corpus': corpus_glob, 'name': 'a'},
                         {'corpus': corpus_glob, 'name': 'b', 'weight': 2.0})
  config.phases = (dict(name='first', steps=6), dict(name='second', steps=6, overrides=runtime))
  first, second = run_plan.plan_run(config, workdir).phases
  # One rows key: the phases read the same rows, so the second names no other tokenizer...
  assert fields.same_rows(first.config, second.config)
  assert second.config.tokenizer.model_file == first.config.tokenizer.model_file == ''
  # ...and its data dir, named by the fingerprint made from that key, is the first's.
  dirs = [prepared.resolve_data_dir(*fields.data_request(p.config)) for p in (first, second)]
  assert dirs[0] == dirs[1]
  # The second phase continues the sources' streams from the first's hand-over.
  config, data = _three_sources(tmp_path, temperature=1.0)
  data.num_parts = 3
  config.phases = (dict(name='first', steps=6), dict(name='second', steps=6, overrides=runtime))
  plan = run_plan.plan_run(config, workdir).plan
  first, second = plan.phases
  before = mixture_run.MixtureRun(first.config, data, 0, {},
                                  position_of=lambda s: int(plan.rows_before(s)))
  loop._hand_over(workdir, plan, first, before)  # pylint: disable=protected-access
  after = loop._mixture(workdir, data, plan, second, 6, {})  # pylint: disable=protected-access
  np.testing.assert_array_equal(after.mix.rows_before,
                                before.mix.rows_drawn(int(plan.rows_before(6))))
  # Another row length is other rows: the later phase reads the run's tokenizer, decided in
  # the plan, not patched by the loop.
  config.phases = (dict(name='first', steps=6), dict(name='long', steps=6, overrides=dict(
      data=dict(seq_len=64, data_dir=str(tmp_path / 'data-T64')))))
  config.model.max_position_embeddings = 64
  first, long = run_plan.plan_run(config, workdir).phases
  assert not fields.same_rows(first.config, long.config)
  assert long.config.tokenizer.model_file == os.path.join(workdir, 'tokenizer.model')
