"""Command line: python -m mlm_jax.probe --workdir=W --task=TASK [--seed=S] [--step=N] [--out=DIR].

Freezes the run's encoder and probes it on a built-in task
(sentence_length, word_content, bigram_shift, docstring_package): a
classifier on each layer alone and one on a learned scalar mix of all
layers (Tenney et al., 2019). Prints the test accuracy per layer and of the
mix, the mix weights and the expected layer, and writes them to
DIR/TASK.{json,png} (default DIR: W/probe). See mlm_jax/probing/.
"""

from __future__ import annotations

import os

from absl import flags

from mlm_jax import cli
from mlm_jax.probing import runs
from mlm_jax.probing import scalar_mix
from mlm_jax.probing import tasks

_WORKDIR = flags.DEFINE_string('workdir', None, 'Training workdir.')
_TASK = flags.DEFINE_enum('task', None, list(tasks.TASKS), 'Built-in probing task.')
flags.mark_flags_as_required(['workdir', 'task'])
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the examples, the splits and the probes.')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_OUT = flags.DEFINE_string('out', None, 'Output directory (default: WORKDIR/probe).')
_HIDDEN = flags.DEFINE_integer('hidden', scalar_mix.ProbeConfig.hidden,
                               "Probe MLP's hidden width; 0: a linear probe.", lower_bound=0)
_STEPS = flags.DEFINE_integer('steps', scalar_mix.ProbeConfig.steps, 'Probe training steps.',
                              lower_bound=1)


def main() -> None:
  cfg = scalar_mix.ProbeConfig(hidden=_HIDDEN.value, steps=_STEPS.value)
  report = runs.probe_run(_WORKDIR.value, _TASK.value, _SEED.value, _STEP.value, cfg)
  print(runs.format_probe(report))
  stem = runs.write_probe(report, _OUT.value or os.path.join(report['workdir'], 'probe'))
  print(f'Written: {stem}.{{json,png}}')


if __name__ == '__main__':
  cli.run(main)
