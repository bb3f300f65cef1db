"""A run is never lost or tangled: one run per workdir, past an unreadable checkpoint, a clean
stop on a full or failing disk, one line for every bad flag or config."""

import contextlib
import errno
import functools
import json
import logging as std_logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import types

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import logging

from mlm_jax.config import saved as saved_config
from mlm_jax.errors import ConfigError
from mlm_jax.finetuning import config as finetune_config
from mlm_jax.finetuning import loop as finetune_loop
from mlm_jax.training import checkpoint
from mlm_jax.training import lock
from mlm_jax.training import workdir as workdir_lib
from tests.conftest import REPO
from tests.conftest import write_config_file

NUM_STEPS = 12


def _cmd(config_file, workdir, *flags):
  return [sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}',
          f'--workdir={workdir}', *flags]


def _env(test_signal=None):
  env = dict(os.environ)
  env.pop('MLM_JAX_TEST_SIGNAL', None)
  if test_signal:
    env['MLM_JAX_TEST_SIGNAL'] = test_signal
  return env


def _run(cmd, test_signal=None, timeout=300):
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                        env=_env(test_signal))


def _only_error_line(stderr):
  """The one `error:` line of a command that failed cleanly (no traceback)."""
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and 'Traceback' not in stderr, stderr[-3000:]
  return errors[0]


def _steps(directory):
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def _params(workdir, step=None):
  return checkpoint.restore_params(os.path.join(workdir, 'checkpoints'), step)[1]


def _assert_same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope='module')
def setup(prepared, tmp_path_factory):
  """(config file, the params of an uninterrupted run, its workdir: checkpoints 2, 4, ..., 12)."""
  config, data = prepared
  tmp = tmp_path_factory.mktemp('reliability')
  config_file = write_config_file(tmp / 'micro.py', config.data.corpus, data.data_dir,
                                  num_steps=NUM_STEPS, log_every=1, eval_every=NUM_STEPS,
                                  checkpoint_every=2, keep_checkpoints=NUM_STEPS)
  reference = str(tmp / 'uninterrupted')
  out = _run(_cmd(config_file, reference))
  assert out.returncode == 0, out.stderr[-3000:]
  return config_file, _params(reference), reference


def _stopped_at_4(reference, tmp_path):
  """A workdir as a run killed after its checkpoint of step 4 leaves it (checkpoints 2, 4)."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(reference, workdir)
  checkpoints = os.path.join(workdir, 'checkpoints')
  for step in _steps(checkpoints):
    if step > 4:
      shutil.rmtree(os.path.join(checkpoints, str(step)))
  return workdir


# ------------------------------------------------------------ one run per workdir


@pytest.mark.slow
def test_second_run_in_a_workdir_is_refused_and_a_dead_runs_lock_taken_over(setup, tmp_path,
                                                                             caplog):
  config_file, _, _ = setup
  workdir = str(tmp_path / 'run')
  # The first run stops itself (SIGSTOP) after step 1: alive, holding the lock.
  with open(tmp_path / 'first.err', 'w') as err:
    first = subprocess.Popen(_cmd(config_file, workdir), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=err, env=_env('SIGSTOP@1'))
  _, status = os.waitpid(first.pid, os.WUNTRACED)
  assert os.WIFSTOPPED(status), (tmp_path / 'first.err').read_text()[-3000:]
  try:
    second = _run(_cmd(config_file, workdir))
    assert second.returncode == 2
    line = _only_error_line(second.stderr)
    assert f'{workdir} is in use by another run: pid {first.pid} on host ' in line
    assert f'delete {workdir}/run.lock' in line
  finally:
    first.kill()
    first.wait()
  # Its process is gone: the next run on this host takes the lock over, with a warning.
  with lock.hold(workdir):
    with open(os.path.join(workdir, lock.FILE_NAME)) as f:
      assert json.load(f)['pid'] == os.getpid()
  assert f'process {first.pid} no longer exists' in caplog.text
  assert not os.path.exists(os.path.join(workdir, lock.FILE_NAME))


def test_finetune_out_dir_is_locked_too(tmp_path):
  out = str(tmp_path / 'out')
  with lock.hold(out):  # This process: a run that is alive.
    with pytest.raises(lock.WorkdirLockedError, match=f'{out} is in use by another run'):
      finetune_loop.finetune(str(tmp_path / 'pretrained'), out, 'classify', 'train.jsonl',
                             'eval.jsonl', finetune_config.get_config())


def test_lock_held_from_another_host_is_taken_over_only_once_its_heartbeat_is_old(tmp_path):
  path = tmp_path / lock.FILE_NAME
  path.write_text(json.dumps({'host': 'elsewhere', 'pid': 4242, 'started': '2030-01-01T00:00:00',
                              'command': 'python -m mlm_jax.train'}))
  with pytest.raises(lock.WorkdirLockedError, match='pid 4242 on host elsewhere'):
    with lock.hold(str(tmp_path)):
      pytest.fail("a lock whose heartbeat is fresh was taken from another host's run")
  old = path.stat().st_mtime - lock.STALE_AFTER_S - 60
  os.utime(path, (old, old))
  with lock.hold(str(tmp_path)):
    assert json.loads(path.read_text())['pid'] == os.getpid()
  assert not path.exists()


# ------------------------------------------------------ past an unreadable checkpoint


@pytest.mark.slow
def test_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes_bit_identical(setup,
                                                                                  tmp_path):
  config_file, reference, uninterrupted = setup
  workdir = _stopped_at_4(uninterrupted, tmp_path)
  damaged = os.path.join(workdir, 'checkpoints', '4')
  # The state's data file that a restore reads (OCDBT's merged database, state/d/).
  data = os.path.join(damaged, 'state', 'd')
  victim = max((os.path.join(data, name) for name in os.listdir(data)), key=os.path.getsize)
  size = os.path.getsize(victim)
  os.truncate(victim, size // 2)

  out = _run(_cmd(config_file, workdir))
  assert out.returncode == 0, out.stderr[-3000:]
  warnings = [line for line in out.stderr.splitlines() if 'does not read' in line]
  assert len(warnings) == 1 and 'Checkpoint 4 does not read' in warnings[0], out.stderr[-3000:]
  assert 'at step 2' in out.stderr
  _assert_same(reference, _params(workdir))
  # Kept aside, damage and all (the run saved a new step 4 in its place).
  aside = damaged + checkpoint.UNREADABLE_SUFFIX
  assert os.path.getsize(victim.replace(damaged, aside)) == size // 2


@flax.struct.dataclass
class _State:
  step: jax.Array
  params: dict
  opt_state: dict


def _tiny_state(value=1.0, extra=False):
  params = {'w': jnp.full((64, 64), value), 'b': jnp.zeros(64)}
  if extra:
    params['c'] = jnp.zeros(3)
  return _State(step=jnp.int32(0), params=params, opt_state={'mu': jax.tree_util.tree_map(
      jnp.zeros_like, params)})


def _checkpointer(directory, keep=10):
  return checkpoint.Checkpointer(directory, ml_collections.ConfigDict(
      {'checkpoint_every': 1, 'keep_checkpoints': keep}))


def _saved(directory, steps, keep=10):
  saver = _checkpointer(directory, keep)
  for step in steps:
    saver.save(step, _tiny_state(float(step)), {'v': 1}, force=True)
  saver.wait()
  saver.close()


def _truncate_data(step_dir):
  for root, _, names in os.walk(step_dir):
    for name in names:
      if os.sep + 'd' + os.sep in os.path.join(root, name):
        os.truncate(os.path.join(root, name), 10)


def test_when_no_checkpoint_reads_the_run_stops_and_nothing_is_renamed(tmp_path):
  directory = str(tmp_path / 'checkpoints')
  _saved(directory, [1, 2])
  for step in (1, 2):
    _truncate_data(os.path.join(directory, str(step)))
  saver = _checkpointer(directory)
  with pytest.raises(checkpoint.CheckpointReadError, match=r'no checkpoint in .* reads \(step 2: '):
    saver.restore_latest(_tiny_state(), {'v': 1})
  saver.close()
  assert sorted(os.listdir(directory)) == ['1', '2']


def test_a_checkpoint_of_another_structure_is_refused_not_set_aside(tmp_path):
  directory = str(tmp_path / 'checkpoints')
  _saved(directory, [1, 2])
  saver = _checkpointer(directory)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r'params\.c is not in the checkpoint'):
    saver.restore_latest(_tiny_state(extra=True), {'v': 1})
  with pytest.raises(checkpoint.CheckpointMismatchError, match='v: checkpoint 1, config 2'):
    saver.restore_latest(_tiny_state(), {'v': 2})
  saver.close()
  assert sorted(os.listdir(directory)) == ['1', '2']


def test_rotation_keeps_the_checkpoint_resumed_from_until_a_newer_one_has_read(tmp_path):
  directory = str(tmp_path / 'checkpoints')
  _saved(directory, [1, 2], keep=1)
  assert _steps(directory) == [2]
  _saved(directory, [3], keep=2)
  saver = _checkpointer(directory, keep=2)
  state, step = saver.restore_latest(_tiny_state(), {'v': 1})
  assert step == 3 and float(state.params['w'][0, 0]) == 3.0
  for step in (4, 5, 6):
    saver.save(step, _tiny_state(float(step)), {'v': 1}, force=True)
  saver.wait()
  saver.close()
  assert _steps(directory) == [3, 5, 6]  # 3 read at the resume; 5 and 6 never have.


# ----------------------------------------------------------- a full or failing disk


def test_a_save_the_disk_has_no_room_for_stops_and_the_one_before_warns(tmp_path, monkeypatch,
                                                                         caplog):
  # Read the warnings off absl's own logger: a command run earlier in this
  # process may have changed its level or handlers (cli.run).
  # A library configuring logging may also have disabled existing loggers, or all logging
  # below some level (logging.disable).
  absl_logger = logging.get_absl_logger()
  monkeypatch.setattr(absl_logger, 'propagate', True)
  monkeypatch.setattr(absl_logger, 'disabled', False)
  monkeypatch.setattr(std_logging.root.manager, 'disable', std_logging.NOTSET)
  caplog.set_level(std_logging.WARNING, logger=absl_logger.name)
  monkeypatch.setattr(absl_logger, 'handlers', [*absl_logger.handlers, caplog.handler])
  directory = str(tmp_path / 'checkpoints')
  saver = _checkpointer(directory)
  saver.save(1, _tiny_state(), {'v': 1}, force=True)
  saver.wait()
  # The disk's free space in units of the last checkpoint's size, which is what the saver
  # measures: one run's checkpoints differ in size by a few percent.
  size = lambda step: _disk_bytes(os.path.join(directory, str(step)))
  free = {'bytes': size(1) * 100}
  monkeypatch.setattr(checkpoint.shutil, 'disk_usage',
                      lambda _: types.SimpleNamespace(free=free['bytes']))
  saver.save(2, _tiny_state(), {'v': 1}, force=True)
  saver.wait()
  assert 'but not for the next' not in caplog.text
  free['bytes'] = int(size(2) * 1.5)  # Room for one (x ROOM_MARGIN 1.2), not two.
  saver.save(3, _tiny_state(), {'v': 1}, force=True)
  saver.wait()
  assert 'has room for checkpoint 3 but not for the next' in caplog.text, (
      caplog.text[-2000:], saver._size, size(2), absl_logger.level, absl_logger.handlers)
  free['bytes'] = int(size(3) * 0.5)
  with pytest.raises(checkpoint.CheckpointWriteError,
                     match=rf'no room for checkpoint 4 in {directory}: .* free, a checkpoint '
                           r'takes .*resume from step 3'):
    saver.save(4, _tiny_state(), {'v': 1}, force=True)
  saver.close()
  assert _steps(directory) == [1, 2, 3]


@functools.cache
def _small_disk_works(probe_dir):
  """Whether this machine lets a test mount a tmpfs in a user and mount namespace."""
  if shutil.which('unshare') is None:
    return False
  probe = subprocess.run(['unshare', '-rm', 'mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs',
                          probe_dir], capture_output=True, check=False)
  return probe.returncode == 0


def _disk_bytes(path):
  return sum(os.stat(os.path.join(root, n)).st_blocks * 512 for root, _, names in os.walk(path)
             for n in names)


def _on_small_disk(spec):
  """Runs spec['cmd'] with WORKDIR/checkpoints on a 64 MiB tmpfs holding what was there.

  Inside a user and mount namespace (`unshare -rm`). `spec['fill']`: 'room'
  leaves less free space than a checkpoint before the run starts; 'full'
  fills the disk once the run stops itself before writing (its
  MLM_JAX_TEST_SIGNAL='SIGSTOP@save:STEP'). The tmpfs's checkpoints come
  back in WORKDIR/checkpoints.after; (return code, stderr) in
  WORKDIR/small_disk.json.
  """
  workdir = spec['workdir']
  checkpoints, on_disk = os.path.join(workdir, 'checkpoints'), os.path.join(workdir, 'before')
  shutil.copytree(checkpoints, on_disk)
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=64m', 'tmpfs', checkpoints], check=True)
  shutil.copytree(on_disk, checkpoints, dirs_exist_ok=True)
  ballast = os.path.join(checkpoints, 'ballast')
  err_path = os.path.join(workdir, 'small_disk.err')
  with open(err_path, 'w') as err:
    if spec['fill'] == 'room':
      latest = os.path.join(checkpoints, str(_steps(checkpoints)[-1]))
      _fill(ballast, leave=int(_disk_bytes(latest) * 0.3))
    run = subprocess.Popen(spec['cmd'], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                           env=spec['env'])
    returncode = None
    if spec['fill'] == 'full':
      _, status = os.waitpid(run.pid, os.WUNTRACED)
      if os.WIFSTOPPED(status):
        _fill(ballast, leave=0)
        os.kill(run.pid, signal.SIGCONT)
      else:
        returncode = os.waitstatus_to_exitcode(status)
    if returncode is None:
      returncode = run.wait(timeout=300)
  if os.path.exists(ballast):
    os.remove(ballast)
  shutil.copytree(checkpoints, os.path.join(workdir, 'checkpoints.after'))
  with open(err_path) as f:
    result = {'returncode': returncode, 'stderr': f.read()}
  with open(os.path.join(workdir, 'small_disk.json'), 'w') as f:
    json.dump(result, f)


def _fill(path, leave):
  """Takes all but `leave` bytes of the free space of `path`'s filesystem."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT)
  try:
    size = shutil.disk_usage(os.path.dirname(path)).free - leave
    with contextlib.suppress(OSError):
      os.posix_fallocate(fd, 0, max(size, 1))
    os.lseek(fd, 0, os.SEEK_END)
    while not leave:  # To the last page.
      os.write(fd, b'\0' * 4096)
  except OSError as e:
    assert e.errno == errno.ENOSPC
  finally:
    os.close(fd)


def _run_on_small_disk(cmd, workdir, fill, test_signal=None):
  spec = {'cmd': cmd, 'workdir': workdir, 'fill': fill, 'env': _env(test_signal)}
  code = ('import json, sys; from tests.test_reliability import _on_small_disk; '
          '_on_small_disk(json.loads(sys.argv[1]))')
  subprocess.run(['unshare', '-rm', sys.executable, '-c', code, json.dumps(spec)], cwd=REPO,
                 check=True, timeout=600)
  with open(os.path.join(workdir, 'small_disk.json')) as f:
    result = json.load(f)
  checkpoints = os.path.join(workdir, 'checkpoints')
  shutil.rmtree(checkpoints)
  os.rename(checkpoints + '.after', checkpoints)
  return result['returncode'], result['stderr']


def _earlier_checkpoints_restore(workdir, uninterrupted):
  checkpoints = os.path.join(workdir, 'checkpoints')
  assert _steps(checkpoints) == [2, 4]
  for step in (2, 4):
    _assert_same(_params(uninterrupted, step), _params(workdir, step))


@pytest.mark.slow
def test_a_full_disk_stops_the_run_before_it_writes_with_one_line(setup, tmp_path):
  if not _small_disk_works(str(tmp_path)):
    pytest.skip('needs a tmpfs in a user and mount namespace (unshare -rm)')
  config_file, _, uninterrupted = setup
  workdir = _stopped_at_4(uninterrupted, tmp_path)
  returncode, stderr = _run_on_small_disk(_cmd(config_file, workdir), workdir, 'room')
  assert returncode == 1
  line = _only_error_line(stderr)
  assert f'no room for checkpoint 6 in {workdir}/checkpoints: ' in line
  assert 'resume from step 4' in line
  _earlier_checkpoints_restore(workdir, uninterrupted)
  assert not [d for d in os.listdir(os.path.join(workdir, 'checkpoints')) if 'tmp' in d]


@pytest.mark.slow
def test_a_disk_failing_during_a_save_stops_the_run_with_one_line(setup, tmp_path):
  """The disk fills up (or refuses large files) once the save of step 6 has begun."""
  config_file, _, uninterrupted = setup
  workdir = _stopped_at_4(uninterrupted, tmp_path)
  cmd = _cmd(config_file, workdir)
  if _small_disk_works(str(tmp_path)):
    returncode, stderr = _run_on_small_disk(cmd, workdir, 'full', test_signal='SIGSTOP@save:6')
    cause = 'No space left on device'
  else:  # Files over 100 kB fail (EFBIG) from the save on: all checkpoint data files do.
    with open(tmp_path / 'err', 'w') as err:
      run = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                             env=_env('SIGSTOP@save:6'))
    _, status = os.waitpid(run.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status)
    resource.prlimit(run.pid, resource.RLIMIT_FSIZE, (100_000, 100_000))
    os.kill(run.pid, signal.SIGCONT)
    returncode, stderr = run.wait(timeout=300), (tmp_path / 'err').read_text()
    cause = 'File too large'
  assert returncode == 1
  line = _only_error_line(stderr)
  assert f'checkpoint 6 could not be written to {workdir}/checkpoints (' in line
  assert cause in line and 'Checkpoint 4 and those before it are intact' in line
  assert 'Event loop is closed' not in stderr
  _earlier_checkpoints_restore(workdir, uninterrupted)


# ------------------------------------------------------ one line for every bad input


@pytest.mark.slow
def test_misspelt_or_mistyped_flags_are_one_line_and_status_2(setup, tmp_path):
  config_file, _, _ = setup
  workdir = str(tmp_path / 'run')
  cases = [
      (_cmd(config_file, workdir, '--config.train.learnin_rate=1e-3'),
       "--config.train.learnin_rate=1e-3: no field 'learnin_rate' in config.train. Did you mean "
       '"learning_rate"'),
      (_cmd(config_file, workdir, '--config.train.num_steps=1.5'),
       "--config.train.num_steps=1.5: invalid literal for int()"),
      (_cmd(config_file, workdir, '--worksdir=x'), "Unknown command line flag 'worksdir'"),
      ([sys.executable, '-m', 'mlm_jax.train', '--config=no/such/config.py',
        f'--workdir={workdir}'], '--config=no/such/config.py: [Errno 2] No such file'),
      ([sys.executable, '-m', 'mlm_jax.finetune', f'--workdir={workdir}', '--out=o',
        '--task=classify', '--train_data=t', '--eval_data=e', '--config.train.learnin_rate=1'],
       "no field 'learnin_rate' in config.train. Did you mean"),
  ]
  for cmd, words in cases:
    out = _run(cmd, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert words in _only_error_line(out.stderr), out.stderr[-3000:]
  assert not os.path.exists(workdir)


def test_a_workdir_of_an_older_version_is_one_line_not_filled_in(prepared, tmp_path):
  config, _ = prepared
  saved = config.to_dict()
  del saved['masking']['mode']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  with pytest.raises(ConfigError, match=r'written by an older version of mlm_jax: '
                                                       r'it lacks config\.masking\.mode'):
    workdir_lib.load(str(tmp_path))


def test_fields_added_since_a_run_was_saved_are_read_as_what_the_run_did(prepared):
  from mlm_jax.config import fields
  config, _ = prepared
  saved = config.to_dict()
  for name in fields.old_values():
    section, key = name.split('.') if '.' in name else ('', name)
    del (saved[section] if section else saved)[key]
  read = saved_config.read(saved, 'config.json')
  assert not read.model.document_mask and not read.model.restart_positions
  assert read.data.ids_key == '' and tuple(read.data.sources) == () and tuple(read.phases) == ()
  assert read.model.to_dict() == {**config.model.to_dict(), 'document_mask': False,
                                  'restart_positions': False}
  del saved['masking']['mode']  # A field without an old value: still refused, and named alone.
  with pytest.raises(ConfigError, match=r'it lacks config\.masking\.mode\. Train'):
    saved_config.read(saved, 'config.json')
