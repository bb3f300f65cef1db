"""Command line: python -m mlm_jax.fill_mask --workdir=runs/tiny "A [MASK] of strings." ...

Loads the latest checkpoint (or --step) of a training run and prints, for
every mask token of every sentence (as the run's tokenizer spells it:
[MASK], or <mask> for a RoBERTa tokenizer), the --top_k most probable
tokens. See mlm_jax/analysis/fill_mask.py.
"""

from __future__ import annotations

import sys

from absl import flags

from mlm_jax import cli
from mlm_jax.analysis import fill_mask
from mlm_jax.training import workdir

_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
flags.mark_flags_as_required(['workdir'])
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_TOP_K = flags.DEFINE_integer('top_k', 5, 'Predictions shown per mask token.')


def main(texts: list[str]) -> int:
  run = workdir.load(_WORKDIR.value, _STEP.value)
  try:
    results = fill_mask.predict(run, texts, _TOP_K.value)
  except ValueError as e:  # A text longer than the model's position table.
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(fill_mask.format_predictions(texts, results, run.tokenizer.specials.token('mask')))
  return 0


if __name__ == '__main__':
  cli.run(main, positional='one or more sentences containing the mask token ([MASK])')
