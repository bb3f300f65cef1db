"""Branching a run (config.init.branch): a new workdir goes on from a checkpoint of another
run with its whole train state, as that run would have; a run in phases keeps each phase's
last checkpoint to branch from; bad branches are refused in one line before any work."""

from __future__ import annotations

import json
import os
import types

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax.config import run_plan
from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint
from tests.conftest import micro_config
from tests.conftest import run_training


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _branch_config(corpus_glob: str, data_dir: str, trunk: str, step: int):
  config = micro_config(corpus_glob, data_dir)
  config.init.workdir, config.init.step, config.init.branch = trunk, step, True
  return config


@pytest.mark.slow
def test_a_branch_at_a_checkpoint_goes_on_as_the_run_did(micro_run, corpus_glob, tmp_path):
  """micro_run (8 steps, saved at 4 and 8) branched at step 4 with its own config: steps 5..8
  log the losses and the evaluation micro_run logged (its optimizer's moments, step and data
  position carried), after micro_run's own records up to step 4."""
  workdir = str(tmp_path / 'branch')
  summary = run_training(_branch_config(corpus_glob, str(tmp_path / 'data'), micro_run, 4),
                         workdir)
  assert summary['step'] == 8
  trunk, branch = _records(micro_run), _records(workdir)
  assert branch[:len([r for r in trunk if r['step'] <= 4])] == [r for r in trunk
                                                                 if r['step'] <= 4]
  after = lambda records, key: {r['step']: r[key] for r in records if r['step'] > 4 and key in r}
  assert sorted(after(branch, 'loss')) == [6, 8] and sorted(after(branch, 'eval_loss')) == [8]
  assert after(branch, 'loss') == pytest.approx(after(trunk, 'loss'), rel=1e-6)
  assert after(branch, 'eval_loss') == pytest.approx(after(trunk, 'eval_loss'), rel=1e-6)
  assert sorted(os.listdir(os.path.join(micro_run, 'checkpoints'))) == ['4', '8']  # Untouched.
  with open(os.path.join(workdir, 'config.json')) as f:
    init = json.load(f)['init']
  assert (init['workdir'], init['step'], init['branch']) == (micro_run, 4, True)


def test_bad_branches_are_refused_in_one_line(micro_run, corpus_glob, tmp_path):
  data_dir = str(tmp_path / 'data')
  config = _branch_config(corpus_glob, data_dir, micro_run, 3)
  with pytest.raises(ConfigError, match=r'config.init.step=3: .* holds checkpoints of steps 4, '
                                        r'8; give one of them \(0: the latest\)'):
    run_plan.resolve(config, 8)
  config = _branch_config(corpus_glob, data_dir, micro_run, 8)   # Nothing left to train.
  with pytest.raises(ConfigError, match=r"continues the run in .* at step 8, .*"
                                        r"num_steps=8 \(it counts that run's steps too\): "
                                        r"train to step 8 \+"):
    run_plan.resolve(config, 8)
  config = _branch_config(corpus_glob, data_dir, micro_run, 0)
  config.train.optimizer = 'stable_adamw'
  with pytest.raises(ConfigError, match=r"laid out otherwise \(config.train.optimizer: "
                                        r"'stable_adamw', the run's 'adamw'\)"):
    run_plan.resolve(config, 8)
  config = micro_config(corpus_glob, data_dir)
  config.init.branch = True
  with pytest.raises(ConfigError, match='config.init.workdir, which is not set'):
    run_plan.resolve(config, 8)


def test_the_checkpoints_a_run_is_told_to_keep_outlive_rotation(tmp_path):
  train = ml_collections.ConfigDict({'checkpoint_every': 2, 'keep_checkpoints': 1})
  saver = checkpoint.Checkpointer(str(tmp_path), train, keep_steps=[4])
  for step in (2, 4, 6, 8):
    state = types.SimpleNamespace(step=jnp.asarray(step), params={'w': jnp.ones(3) * step},
                                  opt_state={}, ema_params=None)
    saver.save(step, state, {})
    saver.wait()
  saver.close()
  assert sorted(os.listdir(tmp_path)) == ['4', '8']


def test_a_branch_draws_a_mixtures_streams_on_from_its_trunks_hand_over(tmp_path):
  """A branch at a phase boundary whose phase reads the rows of the one before continues each
  source's stream from the hand-over its trunk recorded there, as the trunk's own phase does."""
  from mlm_jax.config import phases
  from mlm_jax.training import loop
  from mlm_jax.training import mixture_run
  from mlm_jax.training import workdir as workdir_lib
  from tests.test_mixture import _three_sources
  config, data = _three_sources(tmp_path, temperature=1.0)
  data.num_parts = 3
  config.phases = (dict(name='near', steps=6), dict(name='far', steps=6, overrides=dict(
      data=dict(temperature=4.0))))
  plan = phases.Plan(config)
  near, far = plan.phases
  trunk, branch = str(tmp_path / 'trunk'), str(tmp_path / 'branch')
  os.makedirs(trunk)
  first = mixture_run.MixtureRun(near.config, data, 0, {},
                                 position_of=lambda s: int(plan.rows_before(s)))
  loop._hand_over(trunk, plan, near, first)  # pylint: disable=protected-access
  workdir_lib.start_handovers_from(trunk, branch, far.index)
  ours = loop._mixture(branch, data, plan, far, far.start_step, {})  # pylint: disable=protected-access
  theirs = loop._mixture(trunk, data, plan, far, far.start_step, {})  # pylint: disable=protected-access
  assert ours.mix.start_position == theirs.mix.start_position == int(plan.rows_before(6))
  np.testing.assert_array_equal(ours.mix.rows_before, theirs.mix.rows_before)
  assert np.any(ours.mix.rows_before)
