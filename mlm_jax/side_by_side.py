"""Command line: python -m mlm_jax.side_by_side --config=FILE --workdir=DIR [--seeds=0,1,2].

Trains our model and Hugging Face's model of the same architecture
(BertForMaskedLM for variant 'bert', ModernBertForMaskedLM for 'modern') on
the same rows, masks, shape, recipe and steps, once per seed, and prints both
held-out accuracies at [MASK] slots next to the most frequent token's rate
there. Our runs are ordinary workdirs (DIR/seed<S>); the figures go to
DIR/side_by_side.json. See mlm_jax/analysis/side_by_side.py and
docs/results.md.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from absl import flags

from mlm_jax import cli
from mlm_jax.analysis import side_by_side
from mlm_jax.errors import ConfigError

_CONFIG = cli.config_flag()
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for both systems\' runs, one '
                               'subdirectory per seed; a stopped comparison continues there.')
flags.mark_flags_as_required(['workdir'])
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (config.seed of each pair of runs).')


def main() -> None:
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError:
    raise ConfigError(
        f'--seeds={",".join(_SEEDS.value)}: seeds are integers, e.g. --seeds=0,1,2.') from None
  result = side_by_side.run(_CONFIG.value, _WORKDIR.value, seeds,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
  result['command'] = shlex.join(['python', '-m', 'mlm_jax.side_by_side', *sys.argv[1:]])
  path = os.path.join(result['workdir'], 'side_by_side.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2)
  print(side_by_side.table(result))
  print(f'Written: {path}')


if __name__ == '__main__':
  cli.run(main)
