"""mlm_jax.launch: the launchers' options, checks, arithmetic, quoting and commands.

In-process and fast; nothing calls gcloud, sbatch or srun. The end-to-end
behaviour of launch/*.sh, with fake tools on PATH, is in test_launch.py.
"""

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from mlm_jax.launch import cli
from mlm_jax.launch import runner
from mlm_jax.launch import shell
from mlm_jax.launch import slurm
from mlm_jax.launch import tpu
from tests.conftest import REPO

SLURM_SCRIPT = str(REPO / 'launch' / 'slurm_gpu.sh')
TPU_ARGS = ['--name=bert-v4', '--zone=us-central2-b', '--accelerator_type=v4-32',
            '--workdir=/mnt/shared/runs/base']
EXTRA = '--config.train.batch_size=1024'
BASH = shutil.which('bash')
needs_bash = pytest.mark.skipif(not BASH, reason='no bash')


def _bash_words(line: str, cwd: pathlib.Path | None = None) -> list[str]:
  """The words bash makes of `line` (quote removal, tilde and glob expansion)."""
  script = 'eval "set -- $1"; printf "%s\\0" "$@"'
  done = subprocess.run([BASH, '-c', script, 'bash', line], capture_output=True, check=True,
                        cwd=cwd)
  return done.stdout.decode().split('\0')[:-1]


def _option(words: list[str], name: str) -> str:
  [value] = [w.split('=', 1)[1] for w in words if w.startswith(name + '=')]
  return value


def _tpu_options(*args: str) -> tpu.Options:
  return tpu.options_from(tpu.parse_args([*TPU_ARGS, *args]), str(REPO))


def _slurm_options(*args: str, repo: pathlib.Path = REPO, dry_run: bool = False,
                   **environ: str) -> slurm.Options:
  parsed = slurm.parse_args(args)
  return slurm.options_from(parsed, environ, str(repo), dry_run)


@pytest.fixture
def repo(tmp_path) -> pathlib.Path:
  """A repository with configs and no .venv (a checkout may have one, which changes defaults)."""
  root = tmp_path / 'repo'
  (root / 'configs').mkdir(parents=True)
  for name in ('base.py', 'tiny.py'):
    (root / 'configs' / name).write_text('')
  return root


def _error(function, *args, **kwargs) -> str:
  with pytest.raises(cli.LaunchError) as raised:
    function(*args, **kwargs)
  return str(raised.value)


# --- shell: quoting ----------------------------------------------------------------


@pytest.mark.parametrize('word,quoted', [
    ('plain', 'plain'),
    ('', "''"),
    ('a b', r'a\ b'),
    ("it's", r"it\'s"),
    ('a*b?[c]', r'a\*b\?\[c\]'),
    ('{a,b}', r'\{a\,b\}'),
    ('$HOME!x', r'\$HOME\!x'),
    ('x;y|z&w', r'x\;y\|z\&w'),
    ('<in >out', r'\<in\ \>out'),
    ('"q"`c`^', r'\"q\"\`c\`\^'),
    ('#c', r'\#c'),
    ('a#', 'a#'),
    ('~x', r'\~x'),
    ('a~', 'a~'),
    ('x=~', r'x=\~'),
    ('a:~b', r'a:\~b'),
    ('-x+y@z%', '-x+y@z%'),
    ('é', 'é'),
    ('a\tb', "$'a\\tb'"),
    ('nl\nx', "$'nl\\nx'"),
    ("\x1b\a\b\f\r\v\\'x\x01\x7f é", "$'\\E\\a\\b\\f\\r\\v\\\\\\'x\\001\\177 é'"),
])
def test_quote_writes_what_bash_printf_q_writes(word, quoted):
  assert shell.quote(word) == quoted


@needs_bash
def test_quote_reads_back_as_the_same_word_in_bash():
  words = ['a b', "it's", '*.txt', '~/x', 'x=~', '#c', '', 'é$x', 'tab\there', 'nl\nx',
           '\x01\x7f', '{a,b}', '\\', "'", '"']
  assert _bash_words(' '.join(shell.quote(w) for w in words)) == words


def test_quote_words_leaves_plain_words_alone():
  assert shell.quote_words(['--exclude=*.egg-info', 'a,b', '--x=value(y)', '-C', '/r/my repo']) == (
      r'--exclude=\*.egg-info a,b --x=value\(y\) -C /r/my\ repo')


@pytest.mark.parametrize('path,quoted', [
    ('~', '~'),
    ('~/mlm_jax', '~/mlm_jax'),
    ('~/my dir/x', r'~/my\ dir/x'),
    ('/opt/my repo', r'/opt/my\ repo'),
    ('~user/x', r'\~user/x'),
])
def test_remote_path_leaves_a_leading_tilde_to_the_workers(path, quoted):
  assert shell.remote_path(path) == quoted


# --- cli: options --------------------------------------------------------------------


@pytest.mark.parametrize('args', [
    ['--accelerator_type=v4-8'], ['--accelerator_type', 'v4-8'],
    ['--accelerator-type=v4-8'], ['--accelerator-type', 'v4-8'],
])
def test_parse_takes_both_forms_with_dashes_or_underscores(args):
  parsed = tpu.parse_args(args)
  assert parsed.values == {'accelerator_type': 'v4-8'} and not parsed.help


def test_parse_flags_values_and_training_flags():
  parsed = tpu.parse_args(['--dry-run', '--no_preflight', '--config=a=b:c', '--spot', '--',
                          '--zone=x', 'stray', '--help'])
  assert parsed.flags == {'dry_run', 'no_preflight', 'spot'}
  assert parsed.values == {'config': 'a=b:c'}
  assert parsed.train_flags == ['--zone=x', 'stray', '--help'] and not parsed.help


def test_parse_help_stops_reading_but_not_before_an_error():
  for args in (['-h', '--bogus'], ['--name=x', '--help', 'stray']):
    assert tpu.parse_args(args).help
  assert 'unknown option --bogus' in _error(cli.parse, ['--bogus=1', '--help'], ['name'], [])


@pytest.mark.parametrize('args,message', [
    (['--name'], '--name needs a value'),
    (['--name', '--zone=x'], "--name needs a value (got '--zone=x')"),
    (['--zone=-x'], "--zone needs a value (got '-x')"),
    (['--bogus=-1'], "--bogus needs a value (got '-1')"),
    (['--bogus=1'], 'unknown option --bogus (see --help)'),
    (['--bogus', '1'], 'unknown option --bogus (see --help)'),
    (['--dry_run=1'], 'unknown option --dry_run (see --help)'),
    (['--=x'], 'unknown option -- (see --help)'),
    (['stray'], "unexpected argument 'stray' (flags for the training command go after --)"),
    (['-x'], "unexpected argument '-x' (flags for the training command go after --)"),
])
def test_parse_errors(args, message):
  assert _error(tpu.parse_args, args) == message


def test_report_turns_errors_into_messages_and_exit_statuses(capsys):
  def fail(error):
    def launch():
      raise error
    return launch
  assert cli.report('x.sh', fail(cli.LaunchError('it broke'))) == 2
  assert capsys.readouterr().err == 'x.sh: error: it broke\n'
  assert cli.report('x.sh', fail(runner.CommandFailed(5))) == 5
  assert cli.report('x.sh', fail(KeyboardInterrupt())) == 130
  assert cli.report('x.sh', lambda: 0) == 0
  assert capsys.readouterr().err == ''


def test_check_config_looks_in_the_repository():
  cli.check_config('configs/base.py', str(REPO))
  cli.check_config('configs/base.py:arg', str(REPO))
  cli.check_config('/absolute/is/not/checked.py', str(REPO))
  assert _error(cli.check_config, 'configs/nope.py:arg', str(REPO)) == (
      f"--config: no file 'configs/nope.py' in {REPO}")


# --- tpu: options and checks -----------------------------------------------------------


@pytest.mark.parametrize('accelerator_type,version', [
    ('v2-8', 'tpu-ubuntu2204-base'), ('v3-32', 'tpu-ubuntu2204-base'),
    ('v4-32', 'tpu-ubuntu2204-base'), ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
    ('v5e-8', 'v2-alpha-tpuv5-lite'), ('v5p-64', 'v2-alpha-tpuv5'), ('v6e-8', 'v2-alpha-tpuv6e'),
])
def test_runtime_version_by_generation(accelerator_type, version):
  assert tpu.runtime_version(accelerator_type) == version
  assert _tpu_options(f'--accelerator_type={accelerator_type}').version == version
  assert _tpu_options(f'--accelerator_type={accelerator_type}', '--version=v2-alpha').version == (
      'v2-alpha')


def test_runtime_version_unknown_generation():
  assert _error(tpu.runtime_version, 'tpu7x-8') == (
      'no default runtime for --accelerator_type=tpu7x-8; pass --version')


def test_tpu_defaults():
  options = _tpu_options('--', EXTRA)
  assert (options.config, options.repo_dir, options.python_version) == (
      'configs/base.py', '~/mlm_jax', '3.12')
  assert (options.project, options.cache_dir) == ('', '')
  assert options.preflight and not (options.dry_run or options.spot or options.preemptible
                                    or options.queued)
  assert options.train_flags == (EXTRA,)
  assert options.gcloud_flags == ['--zone=us-central2-b']
  assert _tpu_options('--project=p').gcloud_flags == ['--zone=us-central2-b', '--project=p']


@pytest.mark.parametrize('drop,message', [
    ('--name', "missing required option --name (the TPU VM's name)"),
    ('--zone', 'missing required option --zone (e.g. us-central2-b)'),
    ('--accelerator_type',
     'missing required option --accelerator_type (e.g. v4-32, v5litepod-16, v5p-64)'),
    ('--workdir', 'missing required option --workdir (a directory every worker sees)'),
])
def test_tpu_missing_required_option(drop, message):
  args = [a for a in TPU_ARGS if not a.startswith(drop + '=')]
  parsed = tpu.parse_args(args)
  assert _error(tpu.options_from, parsed, str(REPO)) == message
  assert _error(_tpu_options, drop + '=') == message  # Empty counts as missing.


@pytest.mark.parametrize('args,message', [
    (['--name=Bad_Name'],
     "--name 'Bad_Name': use lower-case letters, digits and dashes, starting with a letter"),
    (['--name=a-'], "--name 'a-': use lower-case letters"),
    (['--name=9a'], "--name '9a': use lower-case letters"),
    (['--name=a\n'], "--name 'a\n': use lower-case letters"),
    (['--accelerator_type=v4'],
     "--accelerator_type 'v4' is not of the form GENERATION-SIZE (e.g. v4-32)"),
    (['--accelerator_type=V4-8'], "--accelerator_type 'V4-8' is not of the form"),
    (['--workdir=gs://bucket/run'],
     "--workdir 'gs://bucket/run': gs:// URLs are not supported; use a path on storage every "
     'worker mounts (NFS/Filestore, or the bucket mounted with gcsfuse)'),
    (['--repo_dir='], '--repo_dir must not be empty'),
    (['--config=configs/nope.py'], "--config: no file 'configs/nope.py' in"),
    (['--spot', '--preemptible'], '--preemptible and --spot exclude each other'),
    (['--queued', '--preemptible'],
     '--preemptible does not apply to --queued; use --queued --spot'),
    (['--accelerator_type=tpu7x-8'],
     'no default runtime for --accelerator_type=tpu7x-8; pass --version'),
])
def test_tpu_rejects(args, message):
  assert _error(_tpu_options, *args).startswith(message)


# --- tpu: commands ---------------------------------------------------------------------


def test_tpu_create_commands():
  base = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'bert-v4', '--zone=us-central2-b']
  assert tpu.create_command(_tpu_options()) == [
      *base, '--accelerator-type=v4-32', '--version=tpu-ubuntu2204-base']
  assert tpu.create_command(_tpu_options('--preemptible'))[-1] == '--preemptible'
  assert tpu.create_command(_tpu_options('--spot'))[-1] == '--spot'
  assert tpu.create_command(_tpu_options('--queued', '--spot', '--project=p',
                                         '--accelerator-type=v5p-64')) == [
      'gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'bert-v4', '--node-id=bert-v4',
      '--zone=us-central2-b', '--project=p', '--accelerator-type=v5p-64',
      '--runtime-version=v2-alpha-tpuv5', '--spot']


def test_tpu_install_and_start_commands():
  options = _tpu_options('--', EXTRA)
  assert tpu.install_command(options) == (
      'set -e; mkdir -p ~/mlm_jax; cd ~/mlm_jax; if [ -f train.pid ] && kill -0 '
      '"$(cat train.pid)" 2>/dev/null; then echo "error: a run is still going on $(hostname) '
      '(pid $(cat train.pid)); stop it first (see launch/tpu_pod.sh --help)" >&2; exit 1; fi; '
      'tar -xzf ~/mlm_jax-src.tar.gz; rm -f ~/mlm_jax-src.tar.gz; if [ ! -x .venv/bin/python ]; '
      'then python3 -m pip install --user --quiet --upgrade uv; python3 -m uv venv --seed '
      "--python 3.12 .venv; fi; .venv/bin/pip install --quiet -e . 'jax[tpu]'")
  assert tpu.start_command(options) == (
      'set -e; cd ~/mlm_jax; setsid nohup .venv/bin/python -m mlm_jax.train '
      '--config=configs/base.py --workdir=/mnt/shared/runs/base '
      f'{EXTRA} > train.log 2>&1 < /dev/null & echo $! > train.pid')
  options = _tpu_options('--repo_dir=~', '--cache_dir=~/my cache', '--python=3.11')
  assert '--python 3.11 .venv' in tpu.install_command(options)
  assert tpu.start_command(options).startswith(
      r'set -e; cd ~; MLM_JAX_CACHE=~/my\ cache setsid nohup')
  assert tpu.follow_command(options) == 'cd ~ && tail --pid="$(cat train.pid)" -n +1 -F train.log'
  assert tpu.stop_command(options) == 'kill $(cat ~/train.pid)'


def test_tpu_tar_leaves_out_what_workers_must_not_get():
  command = tpu.tar_command('/t/src.tar.gz', '/repo')
  assert command[:5] == ['env', 'COPYFILE_DISABLE=1', 'tar', '-czf', '/t/src.tar.gz']
  assert command[-3:] == ['-C', '/repo', '.']
  assert {'--exclude=.git', '--exclude=.venv', '--exclude=./runs', '--exclude=__pycache__',
          '--exclude=*.egg-info'} <= set(command)


def test_tpu_preflight_python(tmp_path):
  assert tpu.local_python({'MLM_JAX_PYTHON': '/my/python'}, str(tmp_path)) == '/my/python'
  assert tpu.local_python({}, str(tmp_path)) == 'python3'
  venv_python = tmp_path / '.venv' / 'bin' / 'python'
  venv_python.parent.mkdir(parents=True)
  venv_python.write_text('#!/bin/sh\n')
  venv_python.chmod(0o755)
  assert tpu.local_python({'MLM_JAX_PYTHON': ''}, str(tmp_path)) == str(venv_python)
  options = _tpu_options('--', EXTRA, '--config.data.data_dir=/d', '--other')
  assert tpu.preflight_command('py', options) == [
      'py', '-m', 'mlm_jax.preflight', '--config=configs/base.py', '--target=v4-32', EXTRA,
      '--config.data.data_dir=/d']


@needs_bash
@pytest.mark.skipif(not (shutil.which('setsid') and shutil.which('nohup')),
                    reason='no setsid or nohup')
def test_tpu_training_flags_survive_both_shells(tmp_path, capsys):
  """Printed line -> local shell -> gcloud's --command -> workers' shell -> python's argv."""
  (tmp_path / 'data').mkdir()
  for name in ('a.txt', 'b.txt'):  # A glob that matched would expand to these.
    (tmp_path / 'data' / name).write_text('')
  corpus = f'--config.data.corpus={tmp_path}/data/*.txt'
  odd = ["it's", '$HOME', 'a;b', '~/x', 'tab\there', '']
  repo_dir = tmp_path / 'my repo'
  python = repo_dir / '.venv' / 'bin' / 'python'
  python.parent.mkdir(parents=True)
  python.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > args\n'
                    'printf %s "$MLM_JAX_CACHE" > cache.tmp; mv cache.tmp cache\n')
  python.chmod(0o755)
  options = _tpu_options(f'--repo_dir={repo_dir}', '--cache_dir=/cache dir', '--', corpus, *odd)
  out = runner.Runner('tpu_pod.sh', dry_run=True)
  out.run(tpu.ssh_command(options, 'all', tpu.start_command(options)))
  printed = capsys.readouterr().out.removeprefix('+ ')
  remote = _option(_bash_words(printed, cwd=tmp_path / 'data'), '--command')
  subprocess.run([BASH, '-c', remote], cwd=tmp_path / 'data', check=True)
  for _ in range(200):  # It runs in the background; it writes `cache` last.
    if (repo_dir / 'cache').exists():
      break
    time.sleep(0.05)
  args = (repo_dir / 'args').read_text().split('\0')[:-1]
  assert args == ['-m', 'mlm_jax.train', '--config=configs/base.py',
                  '--workdir=/mnt/shared/runs/base', corpus, *odd]
  assert (repo_dir / 'cache').read_text() == '/cache dir'


def test_tpu_wait_until_active_notes_each_new_state(capsys):
  states = iter([None, '', 'WAITING_FOR_RESOURCES', 'WAITING_FOR_RESOURCES', 'PROVISIONING',
                 None, 'ACTIVE'])
  sleeps = []
  out = runner.Runner('tpu_pod.sh', dry_run=False)
  tpu.wait_until_active(out, _tpu_options(), lambda: next(states), sleeps.append)
  assert sleeps == [30] * 6
  notes = [line.split(': ', 1)[1] for line in capsys.readouterr().err.splitlines()]
  assert notes == [
      'queued resource bert-v4 is WAITING_FOR_RESOURCES; waiting until it is ACTIVE',
      'queued resource bert-v4 is PROVISIONING; waiting until it is ACTIVE',
      'queued resource bert-v4 is not visible yet; waiting until it is ACTIVE']


@pytest.mark.parametrize('states,message', [
    (['WAITING_FOR_RESOURCES', 'FAILED'],
     'queued resource bert-v4 is FAILED; see gcloud compute tpus queued-resources describe '
     'bert-v4 --zone=us-central2-b'),
    (['SUSPENDED'], 'queued resource bert-v4 is SUSPENDED; see'),
    ([None] * 5, 'cannot describe queued resource bert-v4 (gcloud compute tpus queued-resources '
                 'describe bert-v4 --zone=us-central2-b)'),
])
def test_tpu_wait_until_active_stops(states, message):
  states = iter(states)
  out = runner.Runner('tpu_pod.sh', dry_run=False)
  error = _error(tpu.wait_until_active, out, _tpu_options(), lambda: next(states), lambda _: None)
  assert error.startswith(message)


def test_tpu_wait_until_active_forgives_a_few_failures(capsys):
  # Four failed describes in a row are forgiven (a fifth stops it: see
  # test_tpu_wait_until_active_stops); a success starts the count again.
  polled = [None] * 4 + ['CREATING'] + [None] * 4 + ['ACTIVE']
  states, sleeps = iter(polled), []
  out = runner.Runner('tpu_pod.sh', dry_run=False)
  tpu.wait_until_active(out, _tpu_options(), lambda: next(states), sleeps.append)
  assert next(states, 'all polled') == 'all polled'   # It returned at ACTIVE, not before.
  assert sleeps == [30] * (len(polled) - 1)           # It waited after every poll but the last.
  notes = [line.split(': ', 1)[1] for line in capsys.readouterr().err.splitlines()]
  assert notes == [   # Not visible from the start is not news; losing sight of it again is.
      'queued resource bert-v4 is CREATING; waiting until it is ACTIVE',
      'queued resource bert-v4 is not visible yet; waiting until it is ACTIVE']


def test_tpu_help(capsys):
  assert tpu.launch(['--help', '--bogus'], str(REPO), 'tpu_pod.sh', {}) == 0
  assert capsys.readouterr().out == tpu.USAGE
  assert tpu.USAGE.startswith('Usage: launch/tpu_pod.sh ') and tpu.USAGE.endswith('--force)\n')


_TPU_DRY_RUN = r"""# 0. pre-flight: compile the train step for v4-32 here; go on only if it fits
+ python -m mlm_jax.preflight --config=configs/base.py --target=v4-32 --config.train.batch_size=1024
# dry run: gcloud is not called, so whether TPU bert-v4 exists is not checked; the commands assume it must be created
# 1. create the slice
+ gcloud compute tpus tpu-vm create bert-v4 --zone=us-central2-b --accelerator-type=v4-32 --version=tpu-ubuntu2204-base
# 2. copy the working tree (without .git, .venv, runs and build outputs) to every worker
+ env COPYFILE_DISABLE=1 tar -czf /tmp/mlm_jax-launch/mlm_jax-src.tar.gz --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude=\*.egg-info --exclude=.pytest_cache --exclude=./runs --exclude=./exported --exclude=./build --exclude=./dist -C REPO .
+ gcloud compute tpus tpu-vm scp /tmp/mlm_jax-launch/mlm_jax-src.tar.gz bert-v4:mlm_jax-src.tar.gz --worker=all --zone=us-central2-b
# 3. install on every worker (virtualenv ~/mlm_jax/.venv, Python 3.12)
+ gcloud compute tpus tpu-vm ssh bert-v4 --worker=all --zone=us-central2-b --command=set\ -e\;\ mkdir\ -p\ ~/mlm_jax\;\ cd\ ~/mlm_jax\;\ if\ \[\ -f\ train.pid\ \]\ \&\&\ kill\ -0\ \"\$\(cat\ train.pid\)\"\ 2\>/dev/null\;\ then\ echo\ \"error:\ a\ run\ is\ still\ going\ on\ \$\(hostname\)\ \(pid\ \$\(cat\ train.pid\)\)\;\ stop\ it\ first\ \(see\ launch/tpu_pod.sh\ --help\)\"\ \>\&2\;\ exit\ 1\;\ fi\;\ tar\ -xzf\ ~/mlm_jax-src.tar.gz\;\ rm\ -f\ ~/mlm_jax-src.tar.gz\;\ if\ \[\ \!\ -x\ .venv/bin/python\ \]\;\ then\ python3\ -m\ pip\ install\ --user\ --quiet\ --upgrade\ uv\;\ python3\ -m\ uv\ venv\ --seed\ --python\ 3.12\ .venv\;\ fi\;\ .venv/bin/pip\ install\ --quiet\ -e\ .\ \'jax\[tpu\]\'
# 4. start on every worker: python -m mlm_jax.train --config=configs/base.py --workdir=/mnt/shared/runs/base --config.train.batch_size=1024
+ gcloud compute tpus tpu-vm ssh bert-v4 --worker=all --zone=us-central2-b --command=set\ -e\;\ cd\ ~/mlm_jax\;\ setsid\ nohup\ .venv/bin/python\ -m\ mlm_jax.train\ --config=configs/base.py\ --workdir=/mnt/shared/runs/base\ --config.train.batch_size=1024\ \>\ train.log\ 2\>\&1\ \<\ /dev/null\ \&\ echo\ \$\!\ \>\ train.pid
# 5. follow worker 0's log until the run ends (Ctrl-C stops following, not the run); stop the run: gcloud compute tpus tpu-vm ssh bert-v4 --worker=all --zone=us-central2-b --command=kill\ \$\(cat\ ~/mlm_jax/train.pid\)
+ gcloud compute tpus tpu-vm ssh bert-v4 --worker=0 --zone=us-central2-b --command=cd\ ~/mlm_jax\ \&\&\ tail\ --pid=\"\$\(cat\ train.pid\)\"\ -n\ +1\ -F\ train.log
"""


def test_tpu_dry_run_output_is_stable(capsys):
  """The whole dry run, byte for byte: users diff and paste it."""
  code = tpu.launch(['--dry_run', *TPU_ARGS, '--', EXTRA], str(REPO), 'tpu_pod.sh',
                    {'MLM_JAX_PYTHON': 'python'})
  assert code == 0
  captured = capsys.readouterr()
  assert captured.out == _TPU_DRY_RUN.replace('REPO', str(REPO))
  assert captured.err == (
      'tpu_pod.sh: warning: the prepared data goes to ~/.cache/mlm_jax on each worker; on a '
      'slice of several hosts pass --cache_dir or --config.data.data_dir on storage every '
      'worker sees\n')


# --- slurm: the allocation ---------------------------------------------------------------


@pytest.mark.parametrize('gpu,gpus,nodes,target', [
    ('h100', '8', '2', 'h100x8x2'), ('h100', '4', '1', 'h100x4'), ('a100', '2', '3', 'a100x2x3'),
    ('h100', '8', '01', 'h100x8'),
])
def test_preflight_target_from_nodes_and_gpus(gpu, gpus, nodes, target):
  assert slurm.preflight_target(gpu, gpus, nodes) == target


@pytest.mark.parametrize('gpus,nodes', [('x', '1'), ('', '2'), ('8', '2-4'), ('8', '')])
def test_preflight_target_needs_numbers(gpus, nodes):
  assert _error(slurm.preflight_target, 'h100', gpus, nodes) == (
      f"cannot tell the job's nodes ({nodes}) and GPUs per node ({gpus}) for the pre-flight; "
      'pass --no_preflight')


@pytest.mark.parametrize('gpus,ids', [
    ('8', '0,1,2,3,4,5,6,7'), ('1', '0'), ('2', '0,1'), ('0', None), ('', None), ('x', None),
])
def test_device_ids(gpus, ids):
  assert slurm.device_ids(gpus) == ids


@pytest.mark.parametrize('devices,count', [
    ('2,3', 2), ('0', 1), ('0,', 1), (',', 1), ('0,,', 2), ('0,,1', 3), (',0', 2),
    ('GPU-8f2c,GPU-77a1', 2),
])
def test_count_listed_splits_as_bash_read(devices, count):
  assert slurm.count_listed(devices) == count


def test_header_values_from_the_script():
  header = pathlib.Path(SLURM_SCRIPT).read_text()
  assert [slurm.header_value(header, o) for o in ('nodes', 'gpus-per-node', 'cpus-per-task')] == [
      '2', '8', '32']
  assert slurm.header_value(header, 'partition') == ''
  assert slurm.header_value('#SBATCH --nodes=4\n#SBATCH --nodes=9\n', 'nodes') == '4'


def test_sizes_in_a_job_and_outside(tmp_path):
  header = '#SBATCH --nodes=2\n#SBATCH --gpus-per-node=8\n#SBATCH --cpus-per-task=32\n'

  def gpus(**env):
    return slurm.gpus_per_node(runner.Runner('s', False, {'PATH': str(tmp_path), **env}), header)

  assert (slurm.num_nodes({}, header), gpus(), slurm.cpus_per_task({}, header)) == ('2', '8', '32')
  job = {'SLURM_JOB_ID': '1'}
  assert slurm.num_nodes(job, header) == '1'
  assert slurm.num_nodes({**job, 'SLURM_NNODES': '3'}, header) == '3'
  assert slurm.num_nodes({**job, 'SLURM_JOB_NUM_NODES': '4', 'SLURM_NNODES': '3'}, header) == '4'
  assert slurm.cpus_per_task(job, header) == ''
  assert slurm.cpus_per_task({**job, 'SLURM_CPUS_PER_TASK': '16'}, header) == '16'
  assert gpus(**job) == ''  # No way to tell.
  assert gpus(**job, CUDA_VISIBLE_DEVICES='2,3') == '2'
  assert gpus(**job, SLURM_GPUS_ON_NODE='4', CUDA_VISIBLE_DEVICES='2,3') == '4'
  nvidia_smi = tmp_path / 'nvidia-smi'
  nvidia_smi.write_text('#!/bin/sh\necho "GPU 0: H100 (UUID: a)"\necho "GPU 1: H100 (UUID: b)"\n'
                        'echo "  MIG 1g.10gb Device 0"\n')
  nvidia_smi.chmod(0o755)
  assert gpus(**job) == '2'


# --- slurm: options ----------------------------------------------------------------------


def test_slurm_options_from_the_environment_and_the_command_line(repo):
  environ = {'MLM_JAX_WORKDIR': '/w', 'MLM_JAX_CONFIG': 'configs/tiny.py', 'MLM_JAX_VENV': '/v',
             'MLM_JAX_CACHE': '/c', 'MLM_JAX_GPU': 'a100'}
  options = _slurm_options(dry_run=True, **environ)
  assert (options.workdir, options.config, options.venv, options.cache_dir, options.gpu) == (
      '/w', 'configs/tiny.py', '/v', '/c', 'a100')
  options = _slurm_options('--workdir', '/x', '--config=configs/base.py', '--gpu=h100',
                           '--cache-dir=/d', '--venv=/u', '--dry-run', '--no-preflight', '--',
                           EXTRA, **environ)
  assert (options.workdir, options.config, options.venv, options.cache_dir, options.gpu) == (
      '/x', 'configs/base.py', '/u', '/d', 'h100')
  assert options.dry_run and not options.preflight and options.train_flags == (EXTRA,)
  defaults = _slurm_options('--workdir=/w', repo=repo, MLM_JAX_CONFIG='', MLM_JAX_GPU='')
  assert (defaults.config, defaults.gpu, defaults.venv, defaults.cache_dir) == (
      'configs/base.py', 'h100', '', '')


@pytest.mark.parametrize('value,dry_run', [(None, False), ('', False), ('0', False), ('1', True)])
def test_slurm_dry_run_from_the_environment(value, dry_run):
  environ = {} if value is None else {'MLM_JAX_DRY_RUN': value}
  assert slurm.dry_run_from_environment(environ) == dry_run


def test_slurm_dry_run_variable_must_be_0_or_1(capsys):
  assert _error(slurm.dry_run_from_environment, {'MLM_JAX_DRY_RUN': 'yes'}) == (
      "MLM_JAX_DRY_RUN must be 0 or 1 (got 'yes')")
  # Even --help does not get past it.
  environ = {'MLM_JAX_DRY_RUN': 'true'}
  assert _error(slurm.launch, ['--help'], str(REPO), SLURM_SCRIPT, environ) == (
      "MLM_JAX_DRY_RUN must be 0 or 1 (got 'true')")


@pytest.mark.parametrize('args,message', [
    ([], 'missing required option --workdir (or MLM_JAX_WORKDIR): a directory every node sees'),
    (['--workdir='], 'missing required option --workdir (or MLM_JAX_WORKDIR)'),
    (['--workdir=gs://b/r'], "--workdir 'gs://b/r': use a path on a filesystem every node mounts"),
    (['--workdir=s3://b/r'], "--workdir 's3://b/r': use a path on a filesystem every node mounts"),
    (['--workdir=/w', '--config=configs/nope.py'], "--config: no file 'configs/nope.py' in "),
    (['--workdir=/w', '--venv=/nope'], "--venv: no virtualenv in '/nope' (no bin/activate)"),
    (['--workdir=/w', '--spot'], '--spot needs a value'),
    (['--workdir=/w', '--bogus=1'], 'unknown option --bogus (see --help)'),
])
def test_slurm_rejects(args, message):
  assert _error(_slurm_options, *args).startswith(message)


def test_slurm_venv_default_and_check(repo):
  assert _slurm_options('--workdir=/w', repo=repo).venv == ''
  assert _slurm_options('--workdir=/w', '--venv=/nope', dry_run=True).venv == '/nope'
  activate = repo / '.venv' / 'bin' / 'activate'
  activate.parent.mkdir(parents=True)
  activate.write_text('')
  assert _slurm_options('--workdir=/w', repo=repo).venv == f'{repo}/.venv'
  # Relative paths are relative to the repository.
  assert _slurm_options('--workdir=/w', '--venv=.venv', repo=repo).venv == '.venv'


# --- slurm: commands ---------------------------------------------------------------------


def test_slurm_submit_srun_and_preflight_commands(repo):
  # `repo` has no .venv: a checkout's own .venv would become the default --venv.
  options = _slurm_options('--workdir=/w', '--', EXTRA, '--config.data.data_dir=/d', '--x=1',
                           repo=repo)
  assert slurm.submit_command(options, '/repo') == [
      'sbatch', '--chdir=/repo', '/repo/launch/slurm_gpu.sh', '--config=configs/base.py',
      '--workdir=/w', '--gpu=h100', '--', EXTRA, '--config.data.data_dir=/d', '--x=1']
  assert slurm.srun_command(options, '16') == [
      'srun', '--ntasks-per-node=1', '--kill-on-bad-exit=1', '--cpus-per-task=16', 'python', '-m',
      'mlm_jax.train', '--config=configs/base.py', '--workdir=/w', EXTRA,
      '--config.data.data_dir=/d', '--x=1']
  assert '--cpus-per-task' not in ' '.join(slurm.srun_command(options, ''))
  assert slurm.preflight_command('py', options, 'h100x8x2') == [
      'py', '-m', 'mlm_jax.preflight', '--config=configs/base.py', '--target=h100x8x2', EXTRA,
      '--config.data.data_dir=/d']
  options = _slurm_options('--workdir=/w', '--venv=/v', '--cache_dir=/c d', '--no_preflight',
                           dry_run=True)
  assert slurm.submit_command(options, '/repo')[3:] == [
      '--config=configs/base.py', '--workdir=/w', '--gpu=h100', '--venv=/v', '--cache_dir=/c d',
      '--no_preflight']


_SLURM_DRY_RUN = """\
# pre-flight: compile the train step for h100x8x2 here; go on only if it fits
+ python -m mlm_jax.preflight --config=configs/base.py --target=h100x8x2 --config.train.batch_size=1024
# dry run: not inside a SLURM allocation; this submits the job:
+ sbatch --chdir=REPO REPO/launch/slurm_gpu.sh --config=configs/base.py --workdir=/shared/runs/base --gpu=h100 -- --config.train.batch_size=1024
# and the job runs (with the #SBATCH header's sizes):
+ cd REPO
+ export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7
# pre-flight: compile the train step for h100x8x2 here; go on only if it fits
+ python -m mlm_jax.preflight --config=configs/base.py --target=h100x8x2 --config.train.batch_size=1024
+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=32 python -m mlm_jax.train --config=configs/base.py --workdir=/shared/runs/base --config.train.batch_size=1024
"""

_SLURM_DRY_RUN_IN_JOB = """\
+ cd REPO
+ source /venv/bin/activate
+ export JAX_LOCAL_DEVICE_IDS=0,1,2,3
# pre-flight: compile the train step for h100x4 here; go on only if it fits
+ python -m mlm_jax.preflight --config=configs/tiny.py --target=h100x4
+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=16 python -m mlm_jax.train --config=configs/tiny.py --workdir=/w x
"""


def test_slurm_dry_run_outputs_are_stable(repo, capsys):
  """Both dry runs, byte for byte: outside an allocation and in a job."""
  environ = {'MLM_JAX_PYTHON': 'python', 'PATH': os.defpath}
  assert slurm.launch(['--dry_run', '--workdir=/shared/runs/base', '--', EXTRA], str(repo),
                      SLURM_SCRIPT, environ) == 0
  assert capsys.readouterr().out == _SLURM_DRY_RUN.replace('REPO', str(repo))
  environ.update(SLURM_JOB_ID='1', SLURM_GPUS_ON_NODE='4', SLURM_CPUS_PER_TASK='16',
                 MLM_JAX_CONFIG='configs/tiny.py', MLM_JAX_WORKDIR='/w', MLM_JAX_VENV='/venv',
                 MLM_JAX_DRY_RUN='1')
  assert slurm.launch(['--', 'x'], str(repo), SLURM_SCRIPT, environ) == 0
  captured = capsys.readouterr()
  assert captured.out == _SLURM_DRY_RUN_IN_JOB.replace('REPO', str(repo))
  assert captured.err == (
      'slurm_gpu.sh: warning: the prepared data goes to ~/.cache/mlm_jax on each node; with '
      'several nodes pass --cache_dir or --config.data.data_dir on storage every node sees\n')


def test_slurm_in_job_warnings_and_checks(repo, tmp_path, capsys):
  environ = {'SLURM_JOB_ID': '1', 'PATH': str(tmp_path), 'MLM_JAX_WORKDIR': '/w'}
  # No python on PATH and no virtualenv: nothing to train with.
  assert _error(slurm.launch, ['--no_preflight'], str(repo), SLURM_SCRIPT, environ) == (
      'no python on PATH: pass --venv (or MLM_JAX_VENV) with mlm_jax installed')
  assert capsys.readouterr().err == f'+ cd {repo}\n'
  # A dry run does not look; it cannot tell the GPUs, so it says how to set them.
  assert slurm.launch(['--dry_run', '--no_preflight', '--cache_dir=/c'], str(repo), SLURM_SCRIPT,
                      environ) == 0
  captured = capsys.readouterr()
  assert '+ export MLM_JAX_CACHE=/c\n' in captured.out
  assert captured.err == (
      'slurm_gpu.sh: warning: cannot tell how many GPUs this node has; set '
      'JAX_LOCAL_DEVICE_IDS=0,1,...,N-1 or each process sees one GPU only\n')
  assert _error(slurm.launch, ['--dry_run'], str(repo), SLURM_SCRIPT, environ) == (
      "cannot tell the job's nodes (1) and GPUs per node () for the pre-flight; "
      'pass --no_preflight')
  capsys.readouterr()
  # JAX_LOCAL_DEVICE_IDS already set: kept.
  environ.update(JAX_LOCAL_DEVICE_IDS='0', SLURM_GPUS_ON_NODE='2')
  assert slurm.launch(['--dry_run', '--', '--config.data.data_dir=/d'], str(repo), SLURM_SCRIPT,
                      environ) == 0
  captured = capsys.readouterr()
  assert 'export' not in captured.out and captured.err == ''


def test_slurm_outside_allocation_needs_sbatch(repo, tmp_path):
  environ = {'PATH': str(tmp_path), 'MLM_JAX_WORKDIR': '/w'}
  assert _error(slurm.launch, ['--no_preflight'], str(repo), SLURM_SCRIPT, environ) == (
      'not inside a SLURM allocation and no sbatch on PATH: run this on a login node')


def test_slurm_help(capsys):
  assert slurm.launch(['--help', '--bogus'], str(REPO), SLURM_SCRIPT, {}) == 0
  assert capsys.readouterr().out == slurm.USAGE
  assert slurm.USAGE.startswith('Usage: sbatch [SBATCH_OPTIONS] launch/slurm_gpu.sh')
  assert '$MLM_JAX_REPO_DIR' in slurm.USAGE


# --- runner ------------------------------------------------------------------------------


def test_runner_prints_then_runs(tmp_path, capsys):
  out = runner.Runner('x.sh', dry_run=False, env={'PATH': os.defpath}, cwd=str(tmp_path))
  out.run([sys.executable, '-c', 'import os; open("here", "w").write(os.getcwd())'])
  assert (tmp_path / 'here').read_text() == str(tmp_path)
  assert capsys.readouterr().err.startswith(f'+ {sys.executable} -c import\\ os\\;')
  with pytest.raises(runner.CommandFailed) as failed:
    out.run([sys.executable, '-c', 'raise SystemExit(3)'])
  assert failed.value.returncode == 3
  assert out.status([sys.executable, '-c', 'import os; os.kill(os.getpid(), 9)']) == 137
  assert out.status(['no-such-command-here']) == 127
  assert 'x.sh: no-such-command-here: command not found' in capsys.readouterr().err


def test_runner_dry_run_prints_and_runs_nothing(tmp_path, capsys):
  out = runner.Runner('x.sh', dry_run=True, env={})
  assert out.status(['touch', str(tmp_path / 'no')]) == 0
  out.note('a comment')
  out.cd('/my dir')
  out.export('A', 'b c')
  out.source('/v/bin/activate')
  out.warn('careful')
  captured = capsys.readouterr()
  assert captured.out == (f'+ touch {tmp_path}/no\n# a comment\n+ cd /my\\ dir\n'
                          '+ export A=b\\ c\n+ source /v/bin/activate\n')
  assert captured.err == 'x.sh: warning: careful\n'
  assert not (tmp_path / 'no').exists()
  assert (out.cwd, out.env) == ('/my dir', {'A': 'b c'})


@needs_bash
def test_runner_source_takes_the_environment_of_an_activate_script(tmp_path, capfd):
  activate = tmp_path / 'activate'
  activate.write_text('echo "activating"\nexport VIRTUAL_ENV=/v PATH="/v/bin:$PATH"\n'
                      'unset DROPPED\n')
  out = runner.Runner('x.sh', dry_run=False, env={'PATH': os.defpath, 'DROPPED': '1'})
  out.source(str(activate))
  assert out.env['VIRTUAL_ENV'] == '/v' and out.env['PATH'] == f'/v/bin:{os.defpath}'
  assert 'DROPPED' not in out.env
  assert 'activating' in capfd.readouterr().err  # Not mistaken for the environment.
  activate.write_text('return 4\n')
  with pytest.raises(runner.CommandFailed):
    out.source(str(activate))


# --- The package -------------------------------------------------------------------------


def test_launch_imports_only_the_standard_library():
  """The launchers run where neither jax nor numpy is installed."""
  code = ('import json, sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); '
          'import mlm_jax.launch.tpu, mlm_jax.launch.slurm; '
          'print(json.dumps(sorted(set(sys.modules) - before)))')
  done = subprocess.run([sys.executable, '-I', '-c', code, str(REPO)], capture_output=True,
                        text=True, check=True)
  imported = json.loads(done.stdout)
  others = {m.split('.')[0] for m in imported} - {'mlm_jax'}
  assert others <= set(sys.stdlib_module_names), others - set(sys.stdlib_module_names)
  ours = {m for m in imported if m.startswith('mlm_jax')}
  assert ours <= {'mlm_jax', 'mlm_jax.launch', 'mlm_jax.launch.cli', 'mlm_jax.launch.runner',
                  'mlm_jax.launch.shell', 'mlm_jax.launch.slurm', 'mlm_jax.launch.tpu'}


def test_printed_lines_read_back_as_the_commands():
  words = ['gcloud', '--command=set -e; cd ~/my dir', "it's", '*.txt', '']
  assert shlex.split(shell.quote_words(words)) == words
