"""Command line: python -m mlm_jax.plot --workdir=runs/a [--workdir=runs/b ...] [--out=DIR].

Writes training curves (loss, MLM accuracy, learning rate, tokens/s) from
each run's metrics.jsonl as PNGs into DIR (default: the first workdir's
plots/), runs overlaid. See mlm_jax/analysis/plot.py.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.analysis import plot

_WORKDIRS = flags.DEFINE_multi_string('workdir', None,
                                      'Training workdir (repeat to overlay runs).')
flags.mark_flags_as_required(['workdir'])
_OUT = flags.DEFINE_string('out', None, "Output directory (default: the first workdir's plots/).")


def main() -> None:
  for path in plot.plot_runs(_WORKDIRS.value, _OUT.value):
    print(path)


if __name__ == '__main__':
  cli.run(main)
