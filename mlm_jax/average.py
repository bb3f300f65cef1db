"""Command line: python -m mlm_jax.average --workdir=RUN --steps=1000,2000 --out=AVERAGED
(checkpoints of one run) or --workdirs=A,B,C --out=AVERAGED (the latest checkpoints of
several runs of one shape and tokenizer).

Writes the mean of their parameters into AVERAGED, a workdir in a run's layout
that `export --workdir`, `finetune --workdir` and `--config.init.workdir` read
(mlm_jax/training/average.py). Sources of different shapes or tokenizers are
refused in one line.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.errors import ConfigError
from mlm_jax.training import average

_WORKDIR = flags.DEFINE_string('workdir', None, 'A training run whose checkpoints (--steps) '
                               'are averaged.')
_STEPS = flags.DEFINE_list('steps', None, 'With --workdir: the checkpoint steps to average, '
                           'e.g. 1000,2000.')
_WORKDIRS = flags.DEFINE_list('workdirs', None, 'Training runs of one shape and tokenizer whose '
                              'latest checkpoints are averaged, e.g. runs/a,runs/b.')
_OUT = flags.DEFINE_string('out', None, 'The new workdir to write the average into.')
flags.mark_flags_as_required(['out'])
flags.register_multi_flags_validator(
    ['workdir', 'workdirs'], lambda f: (f['workdir'] is None) != (f['workdirs'] is None),
    'name exactly one of --workdir (with --steps) and --workdirs.')
flags.register_multi_flags_validator(
    ['workdir', 'steps'], lambda f: (f['workdir'] is None) == (f['steps'] is None),
    '--steps goes with --workdir (the checkpoints of that run to average).')


def main() -> None:
  if _WORKDIR.value:
    try:
      steps = [int(s) for s in _STEPS.value]
    except ValueError:
      raise ConfigError(f'--steps={",".join(_STEPS.value)}: give checkpoint steps as '
                        'integers, e.g. --steps=1000,2000.') from None
    result = average.average_checkpoints(_WORKDIR.value, steps, _OUT.value)
  else:
    result = average.average_runs(_WORKDIRS.value, _OUT.value)
  sources = ', '.join(f'{w} step {s}' for w, s in result.sources)
  print(f'averaged {len(result.sources)} checkpoints ({sources}) into {result.out_dir} '
        f'(step {result.step})')


if __name__ == '__main__':
  cli.run(main)
