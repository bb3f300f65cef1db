"""Kills at any moment leave a workdir that resumes to bit-identical parameters."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mlm_jax.training import checkpoint
from tests.conftest import REPO
from tests.conftest import write_config_file

NUM_STEPS = 12


def _cmd(config_file, workdir):
  return [sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}', f'--workdir={workdir}']


def _run_to_end(config_file, workdir):
  out = subprocess.run(_cmd(config_file, workdir), cwd=REPO, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def _final_params(workdir):
  step, params, _ = checkpoint.restore_params(os.path.join(workdir, 'checkpoints'))
  assert step == NUM_STEPS
  return params


def _steps_logged(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if '"loss"' in line)


def _saving(workdir):
  directory = os.path.join(workdir, 'checkpoints')
  return os.path.isdir(directory) and any('tmp' in d for d in os.listdir(directory))


@pytest.fixture(scope='module')
def setup(prepared, tmp_path_factory):
  config, data = prepared
  tmp = tmp_path_factory.mktemp('preemption')
  config_file = write_config_file(tmp / 'micro.py', config.data.corpus, data.data_dir,
                                  num_steps=NUM_STEPS, log_every=1, eval_every=NUM_STEPS,
                                  checkpoint_every=2, keep_checkpoints=2)
  reference = str(tmp / 'uninterrupted')
  _run_to_end(config_file, reference)
  return config_file, _final_params(reference)


@pytest.mark.parametrize('how,when', [
    ('SIGTERM', 3),            # A clean stop between checkpoints.
    ('SIGKILL', 5),            # No chance to save: back to the last checkpoint.
    ('SIGKILL', 'saving'),     # In the middle of an asynchronous save.
])
def test_interrupted_run_resumes_to_identical_parameters(setup, tmp_path, how, when):
  config_file, reference = setup
  workdir = str(tmp_path / 'run')
  proc = subprocess.Popen(_cmd(config_file, workdir), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    # A save after the first one, so that a complete checkpoint exists too.
    if when == 'saving' and _steps_logged(workdir) >= 5 and _saving(workdir):
      break
    if when != 'saving' and _steps_logged(workdir) >= when:
      break
    time.sleep(0.001 if when == 'saving' else 0.05)
  assert proc.poll() is None, 'the run ended before it could be interrupted'
  proc.send_signal(getattr(signal, how))
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == (0 if how == 'SIGTERM' else -signal.SIGKILL), err[-2000:]

  ckpt_dir = os.path.join(workdir, 'checkpoints')
  complete = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()]
  assert complete, 'no complete checkpoint survived'
  if when == 'saving':
    assert any('tmp' in d for d in os.listdir(ckpt_dir)), 'the kill missed the save'
  out = _run_to_end(config_file, workdir)
  assert f'at step {max(complete)}' in out.stderr  # Resumed from the last complete one.
  params = _final_params(workdir)
  for a, b in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b)
