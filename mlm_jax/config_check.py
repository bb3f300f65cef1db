"""Checking a config: the error, and the two checks most fields need.

Each part of the data flow checks the config section it owns
(`check_config(section)` next to the code that uses it, with its allowed
values defined there once); mlm_jax.configuration runs them all, and the
checks that span sections, before anything expensive starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
  """A config value is invalid; the message names the field and the fix."""


def require(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def one_of(section: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
  """ConfigError unless config.<section>.<field> is one of `allowed`, listing them."""
  if value not in allowed:
    names = [repr(a) for a in allowed]
    choices = names[0] if len(names) == 1 else ', '.join(names[:-1]) + ' or ' + names[-1]
    raise ConfigError(f'config.{section}.{field}={value!r}: use {choices}.')
