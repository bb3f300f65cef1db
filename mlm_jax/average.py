"""Command line: python -m mlm_jax.average --workdir=RUN --steps=1000,2000 --out=AVERAGED
(checkpoints of one run) or --workdirs=A,B,C --out=AVERAGED (the latest checkpoints of
several runs of one shape and tokenizer); --method=ties --base=WORKDIR[:STEP] (or a STEP of
--workdir) [--trim=0.2] [--scale=1] TIES-merges them from the checkpoint they were trained from.

Writes the mean of their parameters (or their TIES merge) into AVERAGED, a
workdir in a run's layout that `export --workdir`, `finetune --workdir` and
`--config.init.workdir` read (mlm_jax/training/average.py). Sources of
different shapes or tokenizers, and flags that do not fit the method, are
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
_METHOD = flags.DEFINE_enum('method', 'mean', average.METHODS, 'mean: the plain mean of the '
                            'weights; ties: TIES merging from --base (trim, elect sign, '
                            'disjoint mean).')
_BASE = flags.DEFINE_string('base', None, 'With --method=ties: the checkpoint the merged runs '
                            'were trained from, WORKDIR or WORKDIR:STEP, or with --workdir a '
                            'STEP of that run.')
_TRIM = flags.DEFINE_float('trim', 0.2, "With --method=ties: the fraction of each run's change "
                           "from --base kept, its largest in magnitude (TIES's k).")
_SCALE = flags.DEFINE_float('scale', 1.0, "With --method=ties: the factor of the merged change "
                            "added to --base (TIES's lambda).")
flags.mark_flags_as_required(['out'])
flags.register_multi_flags_validator(
    ['workdir', 'workdirs'], lambda f: (f['workdir'] is None) != (f['workdirs'] is None),
    'name exactly one of --workdir (with --steps) and --workdirs.')
flags.register_multi_flags_validator(
    ['workdir', 'steps'], lambda f: (f['workdir'] is None) == (f['steps'] is None),
    '--steps goes with --workdir (the checkpoints of that run to average).')


def _ties() -> average.Ties | None:
  """The TIES settings the flags give, or None for the mean (flags of TIES alone refused)."""
  if _METHOD.value == 'mean':
    given = [f'--{f.name}' for f in (_BASE, _TRIM, _SCALE) if f.present]
    if given:
      raise ConfigError(f'{", ".join(given)} {"goes" if len(given) == 1 else "go"} with '
                        '--method=ties; the mean takes none.')
    return None
  if _BASE.value is None:
    raise ConfigError('--method=ties needs --base: the checkpoint the merged runs were trained '
                      'from (WORKDIR, WORKDIR:STEP, or with --workdir a STEP of that run).')
  return average.Ties(average.parse_base(_BASE.value, _WORKDIR.value), _TRIM.value,
                      _SCALE.value)


def main() -> None:
  ties = _ties()
  if _WORKDIR.value:
    try:
      steps = [int(s) for s in _STEPS.value]
    except ValueError:
      raise ConfigError(f'--steps={",".join(_STEPS.value)}: give checkpoint steps as '
                        'integers, e.g. --steps=1000,2000.') from None
    result = average.average_checkpoints(_WORKDIR.value, steps, _OUT.value, ties)
  else:
    result = average.average_runs(_WORKDIRS.value, _OUT.value, ties)
  sources = ', '.join(f'{w} step {s}' for w, s in result.sources)
  how = 'averaged' if ties is None else 'TIES-merged'
  print(f'{how} {len(result.sources)} checkpoints ({sources}) into {result.out_dir} '
        f'(step {result.step})')


if __name__ == '__main__':
  cli.run(main)
