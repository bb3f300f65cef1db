"""Command line: python -m mlm_jax.widen --workdir=RUN [--step=N] --out=WIDENED
[--num_layers=28] [--hidden_size=1024] [--intermediate_size=2624] [--num_heads=16]

Writes checkpoint N (default: the latest) of a ModernBERT run widened and
deepened to the sizes given (the others stay the run's), as ModernBERT-large
was started from ModernBERT-base: layers mapped by round(i·L/L'), every
weight tiled from the middle (mlm_jax/training/widen.py). WIDENED is a
workdir in a run's layout: start a run from it with
`--config.init.workdir=WIDENED`. A model that is not variant 'modern', a size
below the run's and a directory already holding a run are refused in one line.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.training import widen

_WORKDIR = flags.DEFINE_string('workdir', None, 'The ModernBERT training run to widen.')
_STEP = flags.DEFINE_integer('step', None, 'Its checkpoint to widen (default: the latest).')
_OUT = flags.DEFINE_string('out', None, 'The new workdir to write the widened weights into.')
_SIZES = {name: flags.DEFINE_integer(name, None, f'The new config.model.{name} (default: the '
                                     "run's).") for name in widen.SIZES}
flags.mark_flags_as_required(['workdir', 'out'])


def main() -> None:
  sizes = {name: flag.value for name, flag in _SIZES.items() if flag.value is not None}
  result = widen.widen_run(_WORKDIR.value, _OUT.value, sizes, _STEP.value)
  print(f'widened {_WORKDIR.value} step {result.step} to '
        f'{", ".join(f"{k}={v}" for k, v in result.sizes.items())} into {result.out_dir} '
        f'(new layer i from old layer {result.layers})')


if __name__ == '__main__':
  cli.run(main)
