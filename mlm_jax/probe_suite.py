"""Command line: python -m mlm_jax.probe_suite --workdir=W [--seeds=3] [--tasks=a,b] [--step=N].

Probes the run's frozen encoder on every built-in task (mlm_jax/probing/
tasks.py) and a randomly initialised encoder of the same shape, with the
scalar-mix probe, over `seeds` seeds, and writes the table of test
accuracies (mean ± std) to W/evaluation.{md,json}. Offline: the tasks are
made from the Python standard library's docstrings.
"""

from __future__ import annotations

import json
import os

from absl import flags

from mlm_jax import cli
from mlm_jax.probing import runs
from mlm_jax.probing import tasks

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir.')
flags.mark_flags_as_required(['workdir'])
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per task (examples, splits, probes, random init).',
                              lower_bound=1)
_TASKS = flags.DEFINE_multi_enum('tasks', list(tasks.TASKS), list(tasks.TASKS),
                                 'Tasks to run (repeat the flag for several).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')


def main() -> None:
  report = runs.evaluate_run(_WORKDIR.value, _SEEDS.value, tuple(_TASKS.value), _STEP.value)
  table = runs.format_evaluation(report)
  print(table)
  stem = os.path.join(report['workdir'], 'evaluation')
  with open(stem + '.json', 'w') as f:
    json.dump(report, f, indent=2)
  with open(stem + '.md', 'w') as f:
    f.write(f'Probe test accuracy of the scalar mix, mean ± std over {report["seeds"]} seeds '
            f'(python -m mlm_jax.probe_suite).\n\n{table}\n')
  print(f'Written: {stem}.{{md,json}}')


if __name__ == '__main__':
  cli.run(main)
