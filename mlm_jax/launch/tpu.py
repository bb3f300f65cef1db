"""Pretraining on a Cloud TPU slice: options, checks, and the gcloud commands of each step.

launch/tpu_pod.sh runs `main`: pre-flight here (the train step compiled for
the slice), then create or reuse the slice, copy the working tree to every
worker, install it there, start training on every worker, and follow worker
0's log. `--help` (USAGE) says more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence

from mlm_jax.launch import cli
from mlm_jax.launch import runner
from mlm_jax.launch import shell

USAGE = r"""Usage: launch/tpu_pod.sh --name NAME --zone ZONE --accelerator_type TYPE --workdir DIR
                         [options] [-- TRAIN_FLAGS...]

Creates a Cloud TPU VM slice (or reuses the one called NAME), copies this
repository to every worker, installs it there with JAX for TPU, then starts the
same command on every worker:

  python -m mlm_jax.train --config=CONFIG --workdir=DIR TRAIN_FLAGS...

JAX finds the other workers of the slice by itself: no --coordinator_address,
--num_processes or --process_id. Each worker runs training under nohup and
writes REPO_DIR/train.log; this script then follows worker 0's log until the
run ends. Ctrl-C stops following, not the run.

Required:
  --name NAME              TPU VM name (with --queued, also the queued resource's name)
  --zone ZONE              e.g. us-central2-b, europe-west4-b
  --accelerator_type TYPE  e.g. v4-32, v5litepod-16, v5p-64, v6e-16
  --workdir DIR            run directory, on storage every worker sees (an NFS or
                           Filestore mount, a bucket mounted with gcsfuse); gs:// URLs
                           are not supported. A relative path is under REPO_DIR.

Options:
  --config FILE            experiment config, relative to the repository
                           (default: configs/base.py)
  --cache_dir DIR          shared directory for the prepared data (sets MLM_JAX_CACHE
                           on the workers); default: ~/.cache/mlm_jax on each worker.
                           With several workers, set it (or --config.data.data_dir)
                           to storage every worker sees
  --version VERSION        TPU VM runtime; default by generation: tpu-ubuntu2204-base
                           (v2, v3, v4), v2-alpha-tpuv5-lite (v5e), v2-alpha-tpuv5 (v5p),
                           v2-alpha-tpuv6e (v6e)
  --project PROJECT        Google Cloud project (default: gcloud's configured one)
  --preemptible            create a preemptible slice
  --spot                   create a Spot slice
  --queued                 request the slice as a queued resource (gcloud compute tpus
                           queued-resources create) and wait until it is ACTIVE;
                           add --spot for Spot capacity
  --repo_dir DIR           where the repository goes on the workers (default: ~/mlm_jax)
  --python VERSION         Python of the workers' virtualenv REPO_DIR/.venv, made with
                           uv (default: 3.12; the TPU images' python3 is 3.10, older
                           than this project needs)
  --no_preflight           skip the pre-flight: by default the train step is first
                           compiled here for TYPE (python -m mlm_jax.preflight, which
                           needs pip install -e '.[aot]') and nothing is created
                           unless it fits
  --dry_run                print the commands, one per line after "+ ", instead of
                           running them; gcloud is not called at all
  -h, --help               show this help

Options take "--opt VALUE" or "--opt=VALUE"; dashes work too (--accelerator-type).
Everything after "--" goes to the training command, e.g.
  -- --config.train.batch_size=1024 --config.train.num_steps=100000

Example:
  launch/tpu_pod.sh --name=bert-v4 --zone=us-central2-b --accelerator_type=v4-32 \
      --workdir=/mnt/shared/runs/base --cache_dir=/mnt/shared/cache \
      -- --config.train.batch_size=1024

Later (NAME, ZONE and REPO_DIR as above):
  follow the log:  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=0 \
                       --command='tail -n 50 -F ~/mlm_jax/train.log'
  stop the run:    gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all \
                       --command='kill $(cat ~/mlm_jax/train.pid)'
                   (SIGTERM: it writes a checkpoint, then exits; the same launch
                   command resumes it)
  delete:          gcloud compute tpus tpu-vm delete NAME --zone=ZONE
                   (--queued: gcloud compute tpus queued-resources delete NAME
                    --zone=ZONE --force)
"""

_VALUE_OPTIONS = ('name', 'zone', 'accelerator_type', 'version', 'project', 'workdir', 'config',
                  'cache_dir', 'repo_dir', 'python')
_FLAGS = ('dry_run', 'no_preflight', 'preemptible', 'spot', 'queued')
_DEFAULTS = {'config': 'configs/base.py', 'repo_dir': '~/mlm_jax', 'python': '3.12'}
# Required options, in the order they are asked for, and what each says about them.
_REQUIRED = (('name', "the TPU VM's name"), ('zone', 'e.g. us-central2-b'),
             ('accelerator_type', 'e.g. v4-32, v5litepod-16, v5p-64'),
             ('workdir', 'a directory every worker sees'))
# TPU VM runtime by accelerator type prefix.
_RUNTIMES = (
    (('v2-', 'v3-', 'v4-'), 'tpu-ubuntu2204-base'),
    (('v5litepod-', 'v5e-'), 'v2-alpha-tpuv5-lite'),
    (('v5p-',), 'v2-alpha-tpuv5'),
    (('v6e-',), 'v2-alpha-tpuv6e'),
)
_NAME = re.compile(r'[a-z]([-a-z0-9]*[a-z0-9])?')
_ACCELERATOR_TYPE = re.compile(r'[a-z0-9]+-[0-9]+')
# Where the tarball goes in a dry run, which makes no temporary directory.
_DRY_RUN_STAGING = '/tmp/mlm_jax-launch'
_TARBALL = 'mlm_jax-src.tar.gz'
_TAR_EXCLUDES = ('.git', '.venv', '__pycache__', '*.egg-info', '.pytest_cache', './runs',
                 './exported', './build', './dist')
_QUEUED_FAILED = ('FAILED', 'SUSPENDING', 'SUSPENDED')
_QUEUED_POLL_SECONDS = 30
_QUEUED_MAX_FAILURES = 5


@dataclasses.dataclass(frozen=True)
class Options:
  name: str
  zone: str
  accelerator_type: str
  workdir: str
  version: str                    # The runtime: given, or the generation's default.
  project: str = ''
  config: str = 'configs/base.py'
  cache_dir: str = ''
  repo_dir: str = '~/mlm_jax'     # On the workers.
  python_version: str = '3.12'    # Of the workers' virtualenv.
  preemptible: bool = False
  spot: bool = False
  queued: bool = False
  dry_run: bool = False
  preflight: bool = True
  train_flags: tuple[str, ...] = ()

  @property
  def gcloud_flags(self) -> list[str]:
    """The flags that every gcloud command of the slice takes."""
    return [f'--zone={self.zone}'] + ([f'--project={self.project}'] if self.project else [])


def main(argv: Sequence[str]) -> int:
  """argv: this launcher's script, the repository, then the user's arguments."""
  script, repo, *args = argv
  prog = os.path.basename(script)
  return cli.report(prog, lambda: launch(args, repo, prog, os.environ))


def launch(args: Sequence[str], repo: str, prog: str, environ: Mapping[str, str]) -> int:
  parsed = parse_args(args)
  if parsed.help:
    print(USAGE, end='', flush=True)
    return 0
  options = options_from(parsed, repo)
  out = runner.Runner(prog, options.dry_run, environ)
  if options.preflight:
    _preflight(out, options, repo)
  if options.dry_run:
    _plan_slice(out, options)
  else:
    _ensure_slice(out, options)
  with _staging_dir(options.dry_run) as staging:
    _copy(out, options, repo, staging)
  _install(out, options)
  _start(out, options)
  _follow(out, options)
  return 0


# --- Options ----------------------------------------------------------------------


def parse_args(args: Sequence[str]) -> cli.Arguments:
  return cli.parse(args, _VALUE_OPTIONS, _FLAGS)


def options_from(parsed: cli.Arguments, repo: str) -> Options:
  """The checked options with their defaults; the first problem found is the one reported."""
  values = {**_DEFAULTS, **parsed.values}
  for option, hint in _REQUIRED:
    if not values.get(option):
      raise cli.LaunchError(f'missing required option --{option} ({hint})')
  _check_values(values, repo)
  flags = parsed.flags
  if 'preemptible' in flags and 'spot' in flags:
    raise cli.LaunchError('--preemptible and --spot exclude each other')
  if 'queued' in flags and 'preemptible' in flags:
    raise cli.LaunchError('--preemptible does not apply to --queued; use --queued --spot')
  return Options(
      name=values['name'], zone=values['zone'], accelerator_type=values['accelerator_type'],
      workdir=values['workdir'],
      version=values.get('version') or runtime_version(values['accelerator_type']),
      project=values.get('project', ''), config=values['config'],
      cache_dir=values.get('cache_dir', ''), repo_dir=values['repo_dir'],
      python_version=values['python'], preemptible='preemptible' in flags,
      spot='spot' in flags, queued='queued' in flags, dry_run='dry_run' in flags,
      preflight='no_preflight' not in flags, train_flags=tuple(parsed.train_flags))


def _check_values(values: Mapping[str, str], repo: str) -> None:
  name, accelerator_type, workdir = values['name'], values['accelerator_type'], values['workdir']
  if not _NAME.fullmatch(name):
    raise cli.LaunchError(
        f"--name '{name}': use lower-case letters, digits and dashes, starting with a letter")
  if not _ACCELERATOR_TYPE.fullmatch(accelerator_type):
    raise cli.LaunchError(f"--accelerator_type '{accelerator_type}' is not of the form "
                          'GENERATION-SIZE (e.g. v4-32)')
  if workdir.startswith('gs://'):
    raise cli.LaunchError(
        f"--workdir '{workdir}': gs:// URLs are not supported; use a path on storage every "
        'worker mounts (NFS/Filestore, or the bucket mounted with gcsfuse)')
  if not values['repo_dir']:
    raise cli.LaunchError('--repo_dir must not be empty')
  cli.check_config(values['config'], repo)


def runtime_version(accelerator_type: str) -> str:
  """The TPU VM runtime for the accelerator type's generation."""
  for prefixes, version in _RUNTIMES:
    if accelerator_type.startswith(prefixes):
      return version
  raise cli.LaunchError(
      f'no default runtime for --accelerator_type={accelerator_type}; pass --version')


# --- Commands ----------------------------------------------------------------------


def preflight_command(python: str, options: Options) -> list[str]:
  return [python, '-m', 'mlm_jax.preflight', f'--config={options.config}',
          f'--target={options.accelerator_type}',
          *cli.prefixed(options.train_flags, '--config.')]


def local_python(environ: Mapping[str, str], repo: str) -> str:
  """The Python with mlm_jax[aot] here: MLM_JAX_PYTHON, else the repository's .venv."""
  if environ.get('MLM_JAX_PYTHON'):
    return environ['MLM_JAX_PYTHON']
  venv_python = f'{repo}/.venv/bin/python'
  return venv_python if os.access(venv_python, os.X_OK) else 'python3'


def create_command(options: Options) -> list[str]:
  if options.queued:
    command = ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', options.name,
               f'--node-id={options.name}', *options.gcloud_flags,
               f'--accelerator-type={options.accelerator_type}',
               f'--runtime-version={options.version}']
  else:
    command = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', options.name,
               *options.gcloud_flags, f'--accelerator-type={options.accelerator_type}',
               f'--version={options.version}']
    if options.preemptible:
      command.append('--preemptible')
  if options.spot:
    command.append('--spot')
  return command


def describe_command(options: Options, queued: bool) -> list[str]:
  """Prints the state of the TPU VM, or of the queued resource, called NAME."""
  if queued:
    return ['gcloud', 'compute', 'tpus', 'queued-resources', 'describe', options.name,
            *options.gcloud_flags, '--format=value(state.state)']
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'describe', options.name,
          *options.gcloud_flags, '--format=value(state)']


def tar_command(tarball: str, repo: str) -> list[str]:
  # COPYFILE_DISABLE keeps macOS tar from adding ._* files.
  return ['env', 'COPYFILE_DISABLE=1', 'tar', '-czf', tarball,
          *(f'--exclude={pattern}' for pattern in _TAR_EXCLUDES), '-C', repo, '.']


def ssh_command(options: Options, worker: str, remote: str) -> list[str]:
  """Runs the command line `remote` in the shell of the workers (all, or one)."""
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', options.name, f'--worker={worker}',
          *options.gcloud_flags, f'--command={remote}']


def install_command(options: Options) -> str:
  """Unpacks the tarball into REPO_DIR and installs it in its virtualenv, unless a run is on."""
  rdir = shell.remote_path(options.repo_dir)
  return (
      f'set -e; mkdir -p {rdir}; cd {rdir}'
      '; if [ -f train.pid ] && kill -0 "$(cat train.pid)" 2>/dev/null; then'
      ' echo "error: a run is still going on $(hostname) (pid $(cat train.pid));'
      ' stop it first (see launch/tpu_pod.sh --help)" >&2; exit 1; fi'
      f'; tar -xzf ~/{_TARBALL}; rm -f ~/{_TARBALL}'
      '; if [ ! -x .venv/bin/python ]; then'
      ' python3 -m pip install --user --quiet --upgrade uv'
      f'; python3 -m uv venv --seed --python {shell.quote(options.python_version)} .venv; fi'
      "; .venv/bin/pip install --quiet -e . 'jax[tpu]'")


def train_command(options: Options) -> list[str]:
  return ['python', '-m', 'mlm_jax.train', f'--config={options.config}',
          f'--workdir={options.workdir}', *options.train_flags]


def start_command(options: Options) -> str:
  """Starts training in the background, detached from the ssh session, its pid in train.pid."""
  words = ''.join(' ' + shell.quote(word) for word in train_command(options)[1:])
  cache = (f'MLM_JAX_CACHE={shell.remote_path(options.cache_dir)} ' if options.cache_dir
           else '')
  return (f'set -e; cd {shell.remote_path(options.repo_dir)}; {cache}'
          f'setsid nohup .venv/bin/python{words} > train.log 2>&1 < /dev/null &'
          ' echo $! > train.pid')


def follow_command(options: Options) -> str:
  """Prints worker 0's log until its run ends."""
  return (f'cd {shell.remote_path(options.repo_dir)} && '
          'tail --pid="$(cat train.pid)" -n +1 -F train.log')


def stop_command(options: Options) -> str:
  return f'kill $(cat {shell.remote_path(options.repo_dir)}/train.pid)'


# --- Steps -------------------------------------------------------------------------


def _preflight(out: runner.Runner, options: Options, repo: str) -> None:
  check = preflight_command(local_python(out.env, repo), options)
  out.note(f'0. pre-flight: compile the train step for {options.accelerator_type} here; '
           'go on only if it fits')
  if out.status(check, cwd=repo):
    raise cli.LaunchError(
        f'the pre-flight for {options.accelerator_type} failed (see above); nothing was '
        'created. Change the config as it suggests, or pass --no_preflight to skip it')


def _plan_slice(out: runner.Runner, options: Options) -> None:
  """Step 1 of a dry run, which cannot ask gcloud whether the slice exists."""
  out.note(f'dry run: gcloud is not called, so whether TPU {options.name} exists is not '
           'checked; the commands assume it must be created')
  out.note('1. create the slice')
  out.run(create_command(options))
  if options.queued:
    out.note('wait until this prints ACTIVE: '
             + shell.quote_words(describe_command(options, queued=True)))


def _ensure_slice(out: runner.Runner, options: Options) -> None:
  """Step 1: reuses a READY TPU VM called NAME, else creates (or requests) the slice."""
  state = _query_state(out, options, queued=False) or ''
  if state:
    if state != 'READY':
      raise cli.LaunchError(
          f'TPU {options.name} exists but is {state}, not READY; delete it (gcloud compute '
          f'tpus tpu-vm delete {options.name} {" ".join(options.gcloud_flags)}) or choose '
          'another --name')
    out.note(f'1. reusing TPU {options.name} (READY)')
  elif options.queued:
    queued = _query_state(out, options, queued=True)
    if queued:
      out.note(f'1. queued resource {options.name} exists ({queued})')
    else:
      out.note('1. request the slice')
      out.run(create_command(options))
    wait_until_active(out, options, lambda: _query_state(out, options, queued=True))
  else:
    out.note('1. create the slice')
    out.run(create_command(options))


def _query_state(out: runner.Runner, options: Options, queued: bool) -> str | None:
  """The state gcloud prints; None if it fails (as when there is no such resource)."""
  returncode, printed = out.output(describe_command(options, queued), quiet=True)
  return None if returncode else printed.rstrip('\n')


def wait_until_active(out: runner.Runner, options: Options, state: Callable[[], str | None],
                      sleep: Callable[[float], None] = time.sleep) -> None:
  """Polls the queued resource until it is ACTIVE; stops if it fails or cannot be described."""
  describe = f'gcloud compute tpus queued-resources describe {options.name} ' + ' '.join(
      options.gcloud_flags)
  last, failures = '', 0
  while True:
    current = state()
    failures = 0 if current is not None else failures + 1
    current = current or ''
    if failures >= _QUEUED_MAX_FAILURES:
      raise cli.LaunchError(f'cannot describe queued resource {options.name} ({describe})')
    if current == 'ACTIVE':
      return
    if current in _QUEUED_FAILED:
      raise cli.LaunchError(f'queued resource {options.name} is {current}; see {describe}')
    if current != last:
      out.note(f'queued resource {options.name} is {current or "not visible yet"}; '
               'waiting until it is ACTIVE')
      last = current
    sleep(_QUEUED_POLL_SECONDS)


@contextlib.contextmanager
def _staging_dir(dry_run: bool) -> Iterator[str]:
  """Where the tarball is made: a temporary directory, removed afterwards."""
  if dry_run:
    yield _DRY_RUN_STAGING
    return
  path = tempfile.mkdtemp()
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


def _copy(out: runner.Runner, options: Options, repo: str, staging: str) -> None:
  tarball = f'{staging}/{_TARBALL}'
  out.note('2. copy the working tree (without .git, .venv, runs and build outputs) to every '
           'worker')
  out.run(tar_command(tarball, repo))
  out.run(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', tarball, f'{options.name}:{_TARBALL}',
           '--worker=all', *options.gcloud_flags])


def _install(out: runner.Runner, options: Options) -> None:
  out.note(f'3. install on every worker (virtualenv {options.repo_dir}/.venv, '
           f'Python {options.python_version})')
  out.run(ssh_command(options, 'all', install_command(options)))


def _start(out: runner.Runner, options: Options) -> None:
  if not options.cache_dir and not cli.prefixed(options.train_flags, '--config.data.data_dir'):
    out.warn('the prepared data goes to ~/.cache/mlm_jax on each worker; on a slice of several '
             'hosts pass --cache_dir or --config.data.data_dir on storage every worker sees')
  out.note('4. start on every worker: ' + shell.quote_words(train_command(options)))
  out.run(ssh_command(options, 'all', start_command(options)))


def _follow(out: runner.Runner, options: Options) -> None:
  stop = shell.quote_words(ssh_command(options, 'all', stop_command(options)))
  out.note("5. follow worker 0's log until the run ends (Ctrl-C stops following, not the run); "
           f'stop the run: {stop}')
  out.run(ssh_command(options, '0', follow_command(options)))
  if not options.dry_run:
    out.note(f"the run on worker 0 has ended; the other workers' logs are in "
             f'{options.repo_dir}/train.log (gcloud compute tpus tpu-vm ssh {options.name} '
             f'{" ".join(options.gcloud_flags)} --worker=N)')


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
