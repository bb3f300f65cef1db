"""Command line: python -m mlm_jax.domain_adaptation --out=DIR [--domain_steps=1000 ...].

The worked domain-adaptation example of docs/continued_pretraining.md,
measured on this machine: a general model (Hugging Face's ModernBertForMaskedLM
trained by transformers on the standard library's docstrings, saved in the
hub's layout) continued on the docstrings of numpy and scipy, beside a
from-scratch run with the same tokenizer and steps, and fine-tuned on a
domain task before and after. Each stage is kept in DIR and reused when the
command runs again. The model's shape and recipe are --config's
(configs/domain_adaptation.py unless given). See
mlm_jax/analysis/domain_adaptation.py.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from absl import flags

from mlm_jax import cli
from mlm_jax.analysis import domain_adaptation
from mlm_jax.errors import ConfigError

_CONFIG = cli.config_flag(default='configs/domain_adaptation.py')
_OUT = flags.DEFINE_string('out', None, 'Directory for the corpora, models, runs and figures.')
flags.mark_flags_as_required(['out'])
_GENERAL_STEPS = flags.DEFINE_integer('general_steps', 2000,
                                      'Steps of the general model (Hugging Face, PyTorch).')
_DOMAIN_STEPS = flags.DEFINE_integer('domain_steps', 1000,
                                     'Steps of continued pretraining and of the from-scratch run.')
_LEARNING_RATES = flags.DEFINE_list('learning_rates', ['1e-4', '3e-4', '1e-3'],
                                    'Peak learning rates of continued pretraining, one run each.')


def main() -> None:
  try:
    rates = [float(r) for r in _LEARNING_RATES.value]
  except ValueError:
    raise ConfigError(f'--learning_rates={",".join(_LEARNING_RATES.value)}: '
                                    'numbers, e.g. --learning_rates=1e-4,3e-4') from None
  result = domain_adaptation.run(_OUT.value, general_steps=_GENERAL_STEPS.value,
                                 domain_steps=_DOMAIN_STEPS.value, learning_rates=rates,
                                 config=_CONFIG.value,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
  result['command'] = shlex.join(['python', '-m', 'mlm_jax.domain_adaptation', *sys.argv[1:]])
  path = os.path.join(os.path.abspath(_OUT.value), 'result.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2)
  print(domain_adaptation.table(result))
  print(f'Written: {path}')


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True)
