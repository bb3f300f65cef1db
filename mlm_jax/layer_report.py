"""Command line: python -m mlm_jax.layer_report --workdir=W [--max_batches=N] [--step=S].

Runs the trained MLM head of a checkpoint on the output of every layer for
the held-out masked tokens and writes the loss and accuracy per layer to
W/layer_report.{json,csv,png} and a table to stdout. See
mlm_jax/analysis/layer_report.py.
"""

from __future__ import annotations

import os

from absl import flags

from mlm_jax import cli
from mlm_jax.analysis import layer_report

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir.')
flags.mark_flags_as_required(['workdir'])
_MAX_BATCHES = flags.DEFINE_integer(
    'max_batches', None, 'Evaluation batches (default: config.eval.max_batches of the run; '
    '0: the whole validation split).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')


def main() -> None:
  report = layer_report.layer_report(_WORKDIR.value, max_batches=_MAX_BATCHES.value,
                                     step=_STEP.value)
  print(layer_report.format_table(report))
  print(f'Written: {os.path.join(report["workdir"], "layer_report.{json,csv,png}")}')


if __name__ == '__main__':
  cli.run(main)
