"""The driver end to end: outputs, resume, signals, bad input."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from mlm_jax.training import checkpoint
from mlm_jax.training import optimizer
from tests.conftest import micro_config
from tests.conftest import run_training
from tests.conftest import write_config_file

REPO = pathlib.Path(__file__).resolve().parent.parent


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _params(workdir, step, config):
  """The parameters of checkpoint `step`, as numpy."""
  import orbax.checkpoint as ocp
  path = os.path.join(workdir, 'checkpoints', str(step), 'state')
  restored = ocp.StandardCheckpointer().restore(path)
  return restored['params']


@pytest.mark.slow
def test_train_writes_metrics_config_checkpoints_and_resumes_identically(prepared, tmp_path):
  config, _ = prepared
  workdir = str(tmp_path / 'run')
  summary = run_training(config, workdir)
  assert summary['step'] == 8
  records = _records(workdir)
  train = [r for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  assert [r['step'] for r in train] == [2, 4, 6, 8]
  assert [r['step'] for r in evals] == [4, 8]
  for r in train:
    assert set(r) >= {'loss', 'mlm_accuracy', 'learning_rate', 'grad_norm', 'tokens_per_sec'}
    assert np.isfinite(r['loss']) and r['tokens_per_sec'] > 0
  assert set(evals[-1]) >= {'eval_loss', 'eval_mlm_accuracy', 'eval_baseline_accuracy'}
  saved = json.load(open(os.path.join(workdir, 'config.json')))
  assert saved['model']['hidden_size'] == 32 and saved['resolved']['vocab_size'] > 0
  assert os.path.exists(os.path.join(workdir, 'tokenizer.model'))
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4', '8']
  final = _params(workdir, 8, config)

  # Lose the last checkpoint, run the same command again: it resumes at 4 and
  # reaches the very same parameters (data, masks and dropout are functions
  # of (seed, step); the schedule continues from the restored step).
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '8'))
  summary = run_training(config, workdir)
  assert summary['step'] == 8
  resumed = _records(workdir)[len(records):]
  assert [r['step'] for r in resumed if 'loss' in r] == [6, 8]
  again = _params(workdir, 8, config)
  for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(again)):
    np.testing.assert_array_equal(a, b)

  # Already at num_steps: a rerun does nothing and says so.
  assert run_training(config, workdir)['step'] == 8


@pytest.mark.slow
def test_resume_with_another_model_shape_is_refused(prepared, tmp_path):
  config, _ = prepared
  workdir = str(tmp_path / 'run')
  config = config.copy_and_resolve_references()
  config.train.num_steps = 4
  run_training(config, workdir)
  config.model.hidden_size = 64
  config.train.num_steps = 8
  with pytest.raises(checkpoint.CheckpointMismatchError, match='hidden_size'):
    run_training(config, workdir)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4']
  # The refused resume left the run's record alone.
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['model']['hidden_size'] != 64


@pytest.mark.slow
def test_resume_with_another_tokenizer_is_refused(prepared, tmp_path):
  config, data = prepared
  workdir = tmp_path / 'run'
  config = config.copy_and_resolve_references()
  config.train.num_steps = 2
  run_training(config, str(workdir))
  # Same vocabulary size, other pieces: a data dir prepared again with other settings.
  recorded = (workdir / 'tokenizer.model').read_bytes()
  (workdir / 'tokenizer.model').write_bytes(recorded + b'\0')
  config.train.num_steps = 4
  with pytest.raises(checkpoint.CheckpointMismatchError, match='tokenizer'):
    run_training(config, str(workdir))
  assert (workdir / 'tokenizer.model').read_bytes() == recorded + b'\0'
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']


def _train_cmd(config_file, workdir):
  return [sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}', f'--workdir={workdir}']


@pytest.mark.slow
def test_signal_saves_a_checkpoint_and_rerun_continues_the_schedule(prepared, tmp_path):
  # Ctrl-C; a preemption's SIGTERM takes the same handler (tests/test_preemption.py).
  sig = signal.SIGINT
  config, data = prepared
  num_steps = 60
  config_file = write_config_file(
      tmp_path / 'micro.py', config.data.corpus, data.data_dir, num_steps=num_steps,
      warmup_steps=20, log_every=1, eval_every=1000, checkpoint_every=1000)
  workdir = str(tmp_path / 'run')
  # The run signals itself right after step 5 (preemption's test hook): no race.
  env = {**os.environ, 'MLM_JAX_TEST_SIGNAL': f'{sig.name}@5'}
  proc = subprocess.run(_train_cmd(config_file, workdir), cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=env)
  err = proc.stderr
  assert proc.returncode == 0, err[-3000:]
  assert f'Stopped by {sig.name}' in err
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')))
  stopped_at = steps[-1]
  assert stopped_at == 5

  # The same command continues from there, with the learning rate of a run
  # that never stopped.
  before = len(_records(workdir))
  out = subprocess.run(_train_cmd(config_file, workdir), cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'Resumed from' in out.stderr and f'at step {stopped_at}' in out.stderr
  after = [r for r in _records(workdir)[before:] if 'loss' in r]
  assert after[0]['step'] == stopped_at + 1 and after[-1]['step'] == num_steps
  cfg = micro_config(config.data.corpus, data.data_dir)
  cfg.train.num_steps, cfg.train.warmup_steps = num_steps, 20
  schedule = optimizer.learning_rate_schedule(cfg.train)
  for r in after[:3]:
    assert r['learning_rate'] == pytest.approx(float(schedule(r['step'] - 1)), rel=1e-5)
  assert 'MLM accuracy' in out.stdout


@pytest.mark.slow
def test_bad_input_is_one_clear_line_before_anything_runs(prepared, tmp_path):
  config, data = prepared
  cases = [
      ('--config.model.num_heads=3', 'config.model.hidden_size=32 is not divisible'),
      ('--config.data.corpus=/no/such/place/*.txt', 'the glob matches no files'),
      ('--config.train.batch_size=12', 'not divisible by the 8 devices'),
  ]
  config_file = write_config_file(tmp_path / 'micro.py', config.data.corpus, data.data_dir)
  env = dict(os.environ)
  for flag, words in cases:
    workdir = tmp_path / 'run'
    out = subprocess.run(_train_cmd(config_file, workdir) + [flag], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and words in last, out.stderr[-2000:]
    assert not (workdir / 'checkpoints').exists()


@pytest.mark.slow
def test_diverging_run_stops_with_the_step_and_keeps_the_last_good_checkpoint(prepared, tmp_path):
  config, _ = prepared
  config = config.copy_and_resolve_references()
  workdir = str(tmp_path / 'run')
  config.train.num_steps = 4
  run_training(config, workdir)
  config.train.num_steps = 40
  config.train.learning_rate = 1e30
  config.train.grad_clip_norm = 0.0
  config.train.log_every = 3  # Does not divide checkpoint_every: saves check too.
  with pytest.raises(FloatingPointError, match=r'at step \d+'):
    run_training(config, workdir)
  kept = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')))
  params = _params(workdir, kept[-1], config)
  assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(params))
