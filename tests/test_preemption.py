"""Kills at any moment leave a workdir that resumes to bit-identical parameters.

Each run interrupts itself at an exact step or save (MLM_JAX_TEST_SIGNAL): no race with a
live process.
"""

import os
import signal
import subprocess
import sys

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


@pytest.mark.slow
@pytest.mark.parametrize('test_signal,last_complete', [
    ('SIGTERM@3', 3),          # A clean stop between checkpoints: it saves step 3.
    ('SIGKILL@save:6', 4),     # No chance to save step 6: back to the last checkpoint.
    ('SIGKILL@saving:6', 4),   # In the middle of the asynchronous save of step 6.
])
def test_interrupted_run_resumes_to_identical_parameters(setup, tmp_path, test_signal,
                                                        last_complete):
  config_file, reference = setup
  workdir = str(tmp_path / 'run')
  # The run signals itself at that exact point (preemption.signal_hook_for_tests).
  env = dict(os.environ, MLM_JAX_TEST_SIGNAL=test_signal)
  out = subprocess.run(_cmd(config_file, workdir), cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
  killed = test_signal.startswith('SIGKILL')
  assert out.returncode == (-signal.SIGKILL if killed else 0), out.stderr[-2000:]

  ckpt_dir = os.path.join(workdir, 'checkpoints')
  complete = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  assert complete[-1] == last_complete
  out = _run_to_end(config_file, workdir)
  assert f'at step {last_complete}' in out.stderr  # Resumed from the last complete one.
  assert not [d for d in os.listdir(ckpt_dir) if 'tmp' in d]  # A partial save is cleaned up.
  params = _final_params(workdir)
  for a, b in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b)
