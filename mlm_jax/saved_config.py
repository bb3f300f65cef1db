"""A run's saved config (WORKDIR/config.json) read back as a ConfigDict.

Its own module, below both sides: configuration reads an init run's config
with it, training/workdir.py a finished run's, and neither imports the other.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from absl import logging

from configs import base
from mlm_jax.errors import ConfigError

# Fields added to configs/base.py after runs were already saved, each with the
# value that reproduces what a run from before it did (documents attended to
# one another, positions counted from the row's start, text read from one
# corpus). A saved run lacking one is read with that value; any other missing
# field is refused, since what the older run did cannot be known.
ADDED_FIELDS = {
    'data.ids_key': '',
    'data.sources': (),
    'data.temperature': None,
    'data.tfds_export': False,
    'masking.final_select_rate': 0.0,
    'masking.rate_change_tokens': 0,
    'masking.rate_schedule': 'constant',
    'model.document_mask': False,
    'model.restart_positions': False,
    'train.ema_decay': 0.0,
    'train.optimizer': 'adamw',
}


def read(saved: dict[str, Any], where: str) -> ml_collections.ConfigDict:
  """A run's saved config (its config.json) as a ConfigDict; ConfigError when it lacks fields of
  today's config (configs/base.py): a run written by an older version, which is not guessed at,
  except for ADDED_FIELDS, which are filled with the behaviour the older run had.

  Keys outside the config (e.g. 'resolved') are kept.
  """
  missing = _missing_fields(base.get_config().to_dict(), saved)
  filled = [m for m in missing if m in ADDED_FIELDS]
  missing = [m for m in missing if m not in ADDED_FIELDS]
  if missing:
    listed = ', '.join(f'config.{m}' for m in missing[:3])
    more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
    raise ConfigError(
        f'{where} was written by an older version of mlm_jax: it lacks {listed}{more}. Train '
        'again in a new --workdir (preparing the data again) rather than reuse it.')
  config = ml_collections.ConfigDict(saved)
  for name in filled:
    section, key = name.split('.')
    config[section][key] = ADDED_FIELDS[name]
  if filled:
    logging.info('%s predates %s: read as %s, what the run did.', where,
                 ', '.join(f'config.{m}' for m in filled),
                 ', '.join(f'{ADDED_FIELDS[m]!r}' for m in filled))
  return config


def _missing_fields(fields: dict[str, Any], saved: dict[str, Any], prefix: str = '') -> list[str]:
  missing = []
  for key, value in fields.items():
    if key not in saved:
      missing.append(prefix + key)
    elif isinstance(value, dict) and isinstance(saved[key], dict):
      missing += _missing_fields(value, saved[key], f'{prefix}{key}.')
  return missing
