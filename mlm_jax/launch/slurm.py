"""Pretraining on GPU nodes of a SLURM cluster: options, checks, and the commands to run.

launch/slurm_gpu.sh runs `main`. Outside an allocation it runs the pre-flight
for the sizes the script's #SBATCH header asks for and submits the script
with sbatch; inside a job (sbatch or salloc) it activates the virtualenv,
exports what one process per node needs, runs the pre-flight for the job's
sizes and starts the processes with srun. `--help` (USAGE) says more.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from collections.abc import Sequence

from mlm_jax.launch import cli
from mlm_jax.launch import runner

PROG = 'slurm_gpu.sh'  # sbatch runs a copy of the script with another name.

USAGE = r"""Usage: sbatch [SBATCH_OPTIONS] launch/slurm_gpu.sh --workdir=DIR [options] [-- TRAIN_FLAGS...]
       launch/slurm_gpu.sh --workdir=DIR [options] [-- TRAIN_FLAGS...]

In a SLURM job (sbatch, or inside salloc) it starts one process per node:

  srun --ntasks-per-node=1 ... python -m mlm_jax.train --config=FILE --workdir=DIR TRAIN_FLAGS...

JAX's distributed runtime detects the SLURM job, so no --coordinator_address,
--num_processes or --process_id are needed. Outside a SLURM allocation, run
directly, it submits itself with sbatch (from a login node).

The #SBATCH lines at the top ask for 2 nodes x 8 GPUs for 24 hours; sbatch
options given on its command line override them, e.g.
  sbatch --nodes=4 --gpus-per-node=4 --partition=gpu --account=ACCOUNT \
      launch/slurm_gpu.sh --workdir=/shared/runs/base -- --config.train.batch_size=1024
Keep --ntasks-per-node=1: each process uses all GPUs of its node.

Options (each also read from the environment variable in brackets):
  --workdir DIR     run directory, on a filesystem every node sees [MLM_JAX_WORKDIR] (required)
  --config FILE     experiment config [MLM_JAX_CONFIG] (default: configs/base.py)
  --venv DIR        virtualenv to activate, with mlm_jax and jax[cuda12] (or
                    jax[cuda13]) installed [MLM_JAX_VENV] (default: the repository's .venv
                    if there is one, else the python on PATH)
  --cache_dir DIR   where the prepared data goes [MLM_JAX_CACHE] (default:
                    ~/.cache/mlm_jax); must be seen by every node, as must
                    --config.data.data_dir if set
  --gpu TYPE        the nodes' GPUs for the pre-flight: h100 or a100 [MLM_JAX_GPU]
                    (default: h100)
  --no_preflight    skip the pre-flight: by default the train step is first
                    compiled for the job's GPUs (python -m mlm_jax.preflight
                    --target=GPUxPER_NODExNODES, on the CPU, before sbatch and
                    again in the job before srun) and nothing runs unless it fits
  --dry_run         print the commands instead of running them (and, outside an
                    allocation, the sbatch command that would submit the job) [MLM_JAX_DRY_RUN=1]
  -h, --help        show this help
Relative paths are relative to the repository, which is found next to this script,
else in $MLM_JAX_REPO_DIR, else in the directory the job was submitted from.
Options take "--opt VALUE" or "--opt=VALUE". Everything after "--" goes to the
training command.

Set-up, once, in the repository on a filesystem every node sees:
  python3 -m venv .venv && .venv/bin/pip install -e . -U "jax[cuda12]"
"""

_VALUE_OPTIONS = ('workdir', 'config', 'venv', 'cache_dir', 'gpu')
_FLAGS = ('dry_run', 'no_preflight')
# Options that an environment variable may set (the command line wins), and their defaults.
_ENVIRONMENT = {'workdir': ('MLM_JAX_WORKDIR', ''), 'config': ('MLM_JAX_CONFIG', 'configs/base.py'),
                'venv': ('MLM_JAX_VENV', ''), 'cache_dir': ('MLM_JAX_CACHE', ''),
                'gpu': ('MLM_JAX_GPU', 'h100')}
_NUMBER = re.compile(r'[0-9]+')


@dataclasses.dataclass(frozen=True)
class Options:
  workdir: str
  config: str = 'configs/base.py'
  venv: str = ''                  # Given, or the repository's .venv if it has one.
  cache_dir: str = ''
  gpu: str = 'h100'
  dry_run: bool = False
  preflight: bool = True
  train_flags: tuple[str, ...] = ()


def main(argv: Sequence[str]) -> int:
  """argv: this launcher's script (maybe sbatch's copy), the repository, the user's arguments."""
  script, repo, *args = argv
  return cli.report(PROG, lambda: launch(args, repo, script, os.environ))


def launch(args: Sequence[str], repo: str, script: str, environ: Mapping[str, str]) -> int:
  dry_run = dry_run_from_environment(environ)
  parsed = parse_args(args)
  if parsed.help:
    print(USAGE, end='', flush=True)
    return 0
  options = options_from(parsed, environ, repo, dry_run)
  header = _read_header(script)
  out = runner.Runner(PROG, options.dry_run, environ)
  if not environ.get('SLURM_JOB_ID'):
    _submit(out, options, repo, header)
    if not options.dry_run:
      return 0
  _run_job(out, options, repo, header)
  return 0


# --- Options ----------------------------------------------------------------------


def parse_args(args: Sequence[str]) -> cli.Arguments:
  return cli.parse(args, _VALUE_OPTIONS, _FLAGS)


def dry_run_from_environment(environ: Mapping[str, str]) -> bool:
  value = environ.get('MLM_JAX_DRY_RUN') or '0'
  if value not in ('0', '1'):
    raise cli.LaunchError(f"MLM_JAX_DRY_RUN must be 0 or 1 (got '{value}')")
  return value == '1'


def options_from(parsed: cli.Arguments, environ: Mapping[str, str], repo: str,
                 dry_run: bool) -> Options:
  """The options from the command line, else the environment, else the defaults; checked."""
  values = {option: parsed.values.get(option, environ.get(variable) or default)
            for option, (variable, default) in _ENVIRONMENT.items()}
  workdir = values['workdir']
  if not workdir:
    raise cli.LaunchError(
        'missing required option --workdir (or MLM_JAX_WORKDIR): a directory every node sees')
  if workdir.startswith(('gs://', 's3://')):
    raise cli.LaunchError(f"--workdir '{workdir}': use a path on a filesystem every node mounts")
  cli.check_config(values['config'], repo)
  dry_run = dry_run or 'dry_run' in parsed.flags
  venv = values['venv']
  if not venv and os.path.isfile(f'{repo}/.venv/bin/activate'):
    venv = f'{repo}/.venv'
  if venv and not dry_run and not os.path.isfile(os.path.join(repo, venv, 'bin', 'activate')):
    raise cli.LaunchError(f"--venv: no virtualenv in '{venv}' (no bin/activate)")
  return Options(workdir=workdir, config=values['config'], venv=venv,
                 cache_dir=values['cache_dir'], gpu=values['gpu'], dry_run=dry_run,
                 preflight='no_preflight' not in parsed.flags,
                 train_flags=tuple(parsed.train_flags))



# --- The allocation ----------------------------------------------------------------


def _read_header(script: str) -> str:
  """The script's text, for its #SBATCH lines; '' if it cannot be read (sizes then unknown)."""
  try:
    with open(script, encoding='utf-8', errors='replace') as f:
      return f.read()
  except OSError:
    return ''


def header_value(header: str, option: str) -> str:
  """The value of the first "#SBATCH --OPTION=VALUE" line of the script; '' if none."""
  prefix = f'#SBATCH --{option}='
  for line in header.splitlines():
    if line.startswith(prefix):
      return line[len(prefix):]
  return ''


def num_nodes(env: Mapping[str, str], header: str) -> str:
  """Nodes of this job (in a job), else those the #SBATCH header asks for."""
  if env.get('SLURM_JOB_ID'):
    return env.get('SLURM_JOB_NUM_NODES') or env.get('SLURM_NNODES') or '1'
  return header_value(header, 'nodes')


def gpus_per_node(out: runner.Runner, header: str) -> str:
  """GPUs of this node (in a job), else those the #SBATCH header asks for; '' if unknown."""
  env = out.env
  if not env.get('SLURM_JOB_ID'):
    return header_value(header, 'gpus-per-node')
  if env.get('SLURM_GPUS_ON_NODE'):
    return env['SLURM_GPUS_ON_NODE']
  if env.get('CUDA_VISIBLE_DEVICES'):
    return str(count_listed(env['CUDA_VISIBLE_DEVICES']))
  if out.which('nvidia-smi'):
    _, listing = out.output(['nvidia-smi', '-L'])
    return str(sum(line.startswith('GPU ') for line in listing.splitlines()))
  return ''


def count_listed(devices: str) -> int:
  """Entries of a comma-separated list, split as bash's `read -a` does (a last comma ends it)."""
  fields = devices.split(',')
  if devices.endswith(','):
    fields.pop()
  return len(fields)


def cpus_per_task(env: Mapping[str, str], header: str) -> str:
  """CPUs per task of this job (in a job), else those the #SBATCH header asks for."""
  if env.get('SLURM_JOB_ID'):
    return env.get('SLURM_CPUS_PER_TASK', '')
  return header_value(header, 'cpus-per-task')


def device_ids(gpus: str) -> str | None:
  """JAX_LOCAL_DEVICE_IDS for a process that uses all `gpus` GPUs; None if that is unknown."""
  if not _NUMBER.fullmatch(gpus) or int(gpus) == 0:
    return None
  return ','.join(str(i) for i in range(int(gpus)))


def preflight_target(gpu: str, gpus: str, nodes: str) -> str:
  """The pre-flight's target name: GPUxPER_NODE, or GPUxPER_NODExNODES for several nodes."""
  if not (_NUMBER.fullmatch(nodes) and _NUMBER.fullmatch(gpus)):
    raise cli.LaunchError(f"cannot tell the job's nodes ({nodes}) and GPUs per node ({gpus}) "
                          'for the pre-flight; pass --no_preflight')
  return f'{gpu}x{gpus}' + (f'x{nodes}' if int(nodes) > 1 else '')


# --- Commands ----------------------------------------------------------------------


def preflight_command(python: str, options: Options, target: str) -> list[str]:
  return [python, '-m', 'mlm_jax.preflight', f'--config={options.config}', f'--target={target}',
          *cli.prefixed(options.train_flags, '--config.')]


def submit_command(options: Options, repo: str) -> list[str]:
  """Submits the repository's launcher with the options as they are now (the job checks again)."""
  command = ['sbatch', f'--chdir={repo}', f'{repo}/launch/slurm_gpu.sh',
             f'--config={options.config}', f'--workdir={options.workdir}', f'--gpu={options.gpu}']
  if options.venv:
    command.append(f'--venv={options.venv}')
  if options.cache_dir:
    command.append(f'--cache_dir={options.cache_dir}')
  if not options.preflight:
    command.append('--no_preflight')
  if options.train_flags:
    command += ['--', *options.train_flags]
  return command


def srun_command(options: Options, cpus: str) -> list[str]:
  """One training process per node."""
  # srun does not take --cpus-per-task from the allocation in every SLURM version.
  return ['srun', '--ntasks-per-node=1', '--kill-on-bad-exit=1',
          *([f'--cpus-per-task={cpus}'] if cpus else []), 'python', '-m', 'mlm_jax.train',
          f'--config={options.config}', f'--workdir={options.workdir}', *options.train_flags]


# --- Steps -------------------------------------------------------------------------


def _preflight(out: runner.Runner, options: Options, python: str, repo: str, header: str) -> None:
  """Compiles the train step for the job's GPUs on this machine's CPU; stops unless it fits."""
  nodes = num_nodes(out.env, header)
  target = preflight_target(options.gpu, gpus_per_node(out, header), nodes)
  out.note(f'pre-flight: compile the train step for {target} here; go on only if it fits')
  if out.status(preflight_command(python, options, target), cwd=repo):
    raise cli.LaunchError(
        f'the pre-flight for {target} failed (see above); nothing was started. Change the '
        'config as it suggests, or pass --no_preflight to skip it')


def _submit(out: runner.Runner, options: Options, repo: str, header: str) -> None:
  """Outside an allocation: pre-flight for the header's sizes, then sbatch."""
  if options.preflight:
    python = f'{options.venv}/bin/python' if options.venv else 'python3'
    _preflight(out, options, out.env.get('MLM_JAX_PYTHON') or python, repo, header)
  submit = submit_command(options, repo)
  if options.dry_run:
    out.note('dry run: not inside a SLURM allocation; this submits the job:')
    out.run(submit)
    out.note("and the job runs (with the #SBATCH header's sizes):")
    return
  if not out.which('sbatch'):
    raise cli.LaunchError(
        'not inside a SLURM allocation and no sbatch on PATH: run this on a login node')
  out.run(submit)


def _run_job(out: runner.Runner, options: Options, repo: str, header: str) -> None:
  """In the job: one process per node, each with all GPUs of its node."""
  out.cd(repo)
  if options.venv:
    out.source(f'{options.venv}/bin/activate')
  elif not options.dry_run and not out.which('python'):
    raise cli.LaunchError(
        'no python on PATH: pass --venv (or MLM_JAX_VENV) with mlm_jax installed')
  if options.cache_dir:
    out.export('MLM_JAX_CACHE', options.cache_dir)
  elif not cli.prefixed(options.train_flags, '--config.data.data_dir'):
    out.warn('the prepared data goes to ~/.cache/mlm_jax on each node; with several nodes '
             'pass --cache_dir or --config.data.data_dir on storage every node sees')
  # JAX's SLURM detection gives each process only the GPU numbered SLURM_LOCALID
  # (one process per GPU); with one process per node it must see all of them.
  if not out.env.get('JAX_LOCAL_DEVICE_IDS'):
    ids = device_ids(gpus_per_node(out, header))
    if ids:
      out.export('JAX_LOCAL_DEVICE_IDS', ids)
    else:
      out.warn('cannot tell how many GPUs this node has; set JAX_LOCAL_DEVICE_IDS=0,1,...,N-1 '
               'or each process sees one GPU only')
  if options.preflight:
    _preflight(out, options, out.env.get('MLM_JAX_PYTHON') or 'python', repo, header)
  out.run(srun_command(options, cpus_per_task(out.env, header)))


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
