"""A run's saved config (WORKDIR/config.json) read back as a ConfigDict.

A run written before a field existed is read with the field's old value from
the field table (config/fields.py: what that run did, e.g. documents attended
to one another, text read from one corpus); a run lacking any other field of
today's config is refused, since what it did cannot be known.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections
from absl import logging

from mlm_jax.config import fields
from mlm_jax.errors import ConfigError


def read(saved: dict[str, Any], where: str) -> ml_collections.ConfigDict:
  """A run's saved config (its config.json) as a ConfigDict; ConfigError when it lacks a field
  of today's config that has no old value in the field table.

  Keys outside the config (e.g. 'resolved') are kept.
  """
  old = fields.old_values()
  missing = [name for name in fields.names() if not _has(saved, name)]
  refused = [m for m in missing if m not in old]
  if refused:
    listed = ', '.join(f'config.{m}' for m in refused[:3])
    more = f' and {len(refused) - 3} more' if len(refused) > 3 else ''
    raise ConfigError(
        f'{where} was written by an older version of mlm_jax: it lacks {listed}{more}. Train '
        'again in a new --workdir (preparing the data again) rather than reuse it.')
  config = ml_collections.ConfigDict(saved)
  for name in missing:
    section, key = name.split('.') if '.' in name else ('', name)
    with config.ignore_type():
      (config[section] if section else config)[key] = old[name]
  if missing:
    logging.info('%s predates %s: read as %s, what the run did.', where,
                 ', '.join(f'config.{m}' for m in missing),
                 ', '.join(f'{old[m]!r}' for m in missing))
  return config


def with_old_values(section: str, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A section saved apart from a run's config.json (a fine-tuned model's model.json), with
  the fields it predates set to their old values."""
  out = ml_collections.ConfigDict(dict(values))
  for key, f in fields.TABLE[section].items():
    if key not in out and f.has_old:
      with out.ignore_type():
        out[key] = f.old
  return out


def _has(saved: Mapping[str, Any], name: str) -> bool:
  if '.' not in name:
    return name in saved
  section, key = name.split('.')
  return isinstance(saved.get(section), Mapping) and key in saved[section]
