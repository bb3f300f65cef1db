"""A source's 'tokens' (config.data.sources): the size the temperature sees instead of its
files', checked early, and no part of what its rows are."""

import ml_collections
import numpy as np
import pytest

from mlm_jax.config import fields
from mlm_jax.data import mixture
from mlm_jax.errors import ConfigError


def _data(sources, temperature=2.0):
  data = ml_collections.ConfigDict({'corpus': '', 'tfds_name': '', 'text_key': 'text'})
  data.sources = sources
  data.temperature = temperature
  return data


def test_a_given_count_replaces_the_measured_one_under_the_temperature():
  """Two language samples of equal files drawn as their whole corpora's sizes at tau = 2:
  shares ∝ sqrt(4e12) : sqrt(1e12) = 2 : 1, where the files alone would give 1 : 1."""
  data = _data(({'corpus': 'eng', 'tokens': 4 * 10**12}, {'corpus': 'xho', 'tokens': 10**12},
                {'corpus': 'code'}))
  mixture.check_config(data)
  members = mixture.members(data)
  measured = [10**9, 10**9, 10**9]
  sizes = mixture.temperature_tokens(members, measured)
  assert sizes == [4 * 10**12, 10**12, 10**9]  # The third gives none: its files' count.
  shares = mixture.shares([m.weight for m in members], sizes, 2.0)
  np.testing.assert_allclose(shares[0] / shares[1], 2.0)
  # Without counts, equal files draw equally.
  np.testing.assert_allclose(mixture.shares([1, 1], measured[:2], 2.0), [0.5, 0.5])


@pytest.mark.parametrize('entry, temperature, message', [
    ({'corpus': 'a', 'tokens': 0}, 2.0, r'sources\[0\]\.tokens=0 must be a whole number'),
    ({'corpus': 'a', 'tokens': 1.5e9}, 2.0, 'must be a whole number'),
    ({'corpus': 'a', 'weight': 1, 'tokens': 10**9}, None, 'temperature sees, which is unset'),
])
def test_a_bad_count_is_refused_with_the_fix(entry, temperature, message):
  data = _data((entry, {'corpus': 'b', 'weight': 1}), temperature)
  with pytest.raises(ConfigError, match=message):
    mixture.check_config(data)


def test_the_count_is_no_part_of_the_rows_key():
  """Same files, other counts: the same prepared rows (only the draw changes)."""
  a = _data(({'corpus': 'x', 'tokens': 10**9}, {'corpus': 'y'}))
  b = _data(({'corpus': 'x', 'tokens': 5 * 10**9}, {'corpus': 'y'}))
  for data in (a, b):
    data.update({k: '' for k in ('document_split', 'ids_key', 'tfds_data_dir', 'split')})
    data.update({'seq_len': 128, 'val_fraction': 0.0, 'split_seed': 0})
  assert fields.rows_key(a) == fields.rows_key(b)
  assert 'tokens' in mixture.DRAW_FIELDS and 'tokens' in fields.MEMBER_DRAW_FIELDS
