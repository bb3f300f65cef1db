"""Several processes: JAX's distributed runtime on 127.0.0.1 with gloo collectives."""

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.conftest import micro_config
from tests.conftest import run_training
from tests.conftest import write_config_file
from tests.conftest import xla_flags

# Room for the stop: the processes agree on a step a few after the notice.
NUM_STEPS = 12


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(devices_per_process: int) -> dict:
  env = dict(os.environ)
  env.pop('MLM_JAX_TEST_SIGNAL', None)
  env['XLA_FLAGS'] = xla_flags(devices_per_process)
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _command(config_file: str, workdir: str, num_processes: int) -> tuple[list[str], list[str]]:
  """(the train command, the flags of each process for it: one per process)."""
  cmd = [sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}', f'--workdir={workdir}']
  if num_processes == 1:
    return cmd, ['']
  cmd += [f'--coordinator_address=127.0.0.1:{_free_port()}', f'--num_processes={num_processes}']
  return cmd, [f'--process_id={i}' for i in range(num_processes)]


def _run(config_file: str, workdir: str, num_processes: int, devices: int,
         envs: list[dict] | None = None) -> list[str]:
  """Runs the train command in `num_processes` processes of `devices` CPU devices each (each
  with its own `envs` entry added, if given); asserts they succeed; returns their stderr."""
  cmd, flags = _command(config_file, workdir, num_processes)
  envs = envs or [{}] * num_processes
  procs = [subprocess.Popen(cmd + ([flag] if flag else []), cwd=REPO,
                            env={**_env(devices), **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
           for flag, env in zip(flags, envs)]
  errs = [p.communicate(timeout=300)[1] for p in procs]
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-3000:]
  return errs


def _train_losses(config_file: str, workdir: str, num_processes: int, devices: int,
                  env: dict | None = None) -> list:
  _run(config_file, workdir, num_processes, devices, [env or {}] * num_processes)
  return _logged_losses(workdir)


def _logged_losses(workdir: str) -> list:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return [(r['step'], r['loss']) for r in records if 'loss' in r]


@pytest.mark.slow
def test_two_processes_of_four_devices_stopped_by_sigterm_to_one_resume_as_one_of_eight_and_one(
    prepared, tmp_path):
  """2 processes x 4 devices: a preemption notice reaches one of them, both save the same step
  and stop; the same command resumes both, and the losses of every step are those of an
  uninterrupted run on 1 process x 8 devices and on 1 device."""
  config, data = prepared
  # One chain everywhere: auto would give the single device 2 chains, whose
  # rows draw other dropout masks (the micro config has dropout).
  train = dict(num_steps=NUM_STEPS, log_every=1, eval_every=NUM_STEPS,
               checkpoint_every=NUM_STEPS, concurrent_chains=1)
  config_file = write_config_file(tmp_path / 'micro.py', config.data.corpus, data.data_dir,
                                  **train)
  workdir = str(tmp_path / 'p2x4')
  # Process 1 only sends itself SIGTERM, right after step 2 (preemption.signal_hook_for_tests).
  errs = _run(config_file, workdir, 2, 4, [{}, {'MLM_JAX_TEST_SIGNAL': 'SIGTERM@2'}])
  stops = [re.search(r'Stopped by SIGTERM at step (\d+)', err) for err in errs]
  assert all(stops), errs[0][-2000:]
  stop_step = int(stops[0].group(1))
  assert int(stops[1].group(1)) == stop_step and 2 <= stop_step < NUM_STEPS
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == [str(stop_step)]
  # The same command (another coordinator port) resumes both processes from that checkpoint.
  for err in _run(config_file, workdir, 2, 4):
    assert f'at step {stop_step}' in err
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(NUM_STEPS)))
  two = _logged_losses(workdir)

  one = _train_losses(config_file, str(tmp_path / 'p1x1'), num_processes=1, devices=1)
  # 1 x 8: this process (tests/conftest.py gives it 8 devices), as the command trains.
  config = micro_config(config.data.corpus, data.data_dir)
  config.train.update(**train)
  run_training(config, str(tmp_path / 'p1x8'))
  eight = _logged_losses(str(tmp_path / 'p1x8'))
  print('stopped at', stop_step, 'losses 2x4:', two, '1x8:', eight, '1x1:', one)
  steps = list(range(1, NUM_STEPS + 1))
  assert [s for s, _ in two] == [s for s, _ in eight] == [s for s, _ in one] == steps
  np.testing.assert_allclose([l for _, l in two], [l for _, l in eight], rtol=1e-5)
  np.testing.assert_allclose([l for _, l in two], [l for _, l in one], rtol=1e-5)


def _assert_one_process_trains_the_same(two, config, workdir, steps):
  """`config` run here on 1 process x 8 devices at fsdp=8 logs the losses `two` (2 x 4) logged."""
  config.mesh.fsdp = 8
  config.train.update(num_steps=steps, log_every=1, eval_every=steps, checkpoint_every=steps,
                      concurrent_chains=1)
  run_training(config, workdir)
  eight = _logged_losses(workdir)
  print('losses 2x4:', two, '1x8:', eight)
  assert [s for s, _ in two] == [s for s, _ in eight] == list(range(1, steps + 1))
  np.testing.assert_allclose([l for _, l in two], [l for _, l in eight], rtol=1e-5)


@pytest.mark.slow
def test_continuing_a_published_checkpoint_with_added_words_and_fsdp_across_processes_matches_one(
    corpus_glob, tmp_path):
  """2 processes x 4 devices, the state split over all 8 (fsdp=8), continue a published BERT
  with 3 words added: each process places its shards of the checkpoint's tensors and of the
  grown embedding rows (no process can fetch the whole state), and the losses are those of
  1 process x 8 devices.

  The 2 x 4 run names the checkpoint by hub id from an offline cache holding it as
  pytorch_model.bin, the 1 x 8 run reads the directory's model.safetensors: the hub id and the
  PyTorch file continue too (test_continue checks each alone). config.init.workdir's weights
  are placed by the same code (init_from.place) from host arrays read by every process.
  """
  pytest.importorskip('transformers')
  from tests import published
  from tests.test_continue import as_hub_cache
  from tests.test_continue import as_pytorch_bin
  bert = published.make_bert(str(tmp_path / 'bert'), published.sample_texts(100))
  revision = as_hub_cache(str(tmp_path / 'hf'), 'example-org/bert-mini',
                          as_pytorch_bin(bert, str(tmp_path / 'bin')))
  words = tmp_path / 'words.txt'
  words.write_text('hyperparameterization\nbackpropagation\nxylophonist\n')
  steps, data_dir = 2, str(tmp_path / 'data')   # Prepared by the 2 x 4 run, read by the 1 x 8.
  config_file = write_config_file(
      tmp_path / 'continue.py', corpus_glob, data_dir,
      {'init.hf_dir': 'example-org/bert-mini', 'tokenizer.add_tokens': str(words),
       'mesh.fsdp': 8}, num_steps=steps, log_every=1, eval_every=steps,
      checkpoint_every=steps, concurrent_chains=1)
  two = _train_losses(config_file, str(tmp_path / 'p2x4'), num_processes=2, devices=4,
                      env={'HF_HOME': str(tmp_path / 'hf'), 'HF_HUB_OFFLINE': '1'})
  # 1 x 8: this process (tests/conftest.py gives it 8 devices), as the command trains.
  config = micro_config(corpus_glob, data_dir)
  config.init.hf_dir, config.tokenizer.add_tokens = bert, str(words)
  _assert_one_process_trains_the_same(two, config, str(tmp_path / 'p1x8'), steps)
  with open(tmp_path / 'p2x4' / 'config.json') as f:
    recorded = json.load(f)
  assert recorded['init']['hf_dir'] == f'example-org/bert-mini@{revision}'
  # The published table's rows and 3 more for the words.
  assert recorded['resolved']['vocab_size'] >= 400 + 3   # make_bert's table (400 rows).
