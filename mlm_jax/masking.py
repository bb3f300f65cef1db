"""BERT masking on the host, in numpy: a fresh mask for every row every step.

Per row, exactly k = min(P, max(1, round(rate * n))) of its n maskable tokens
are selected ([CLS], [SEP] and [PAD] never are). Of the selected tokens,
`mask_prob` become [MASK], `random_prob` a random token drawn from the
corpus's unigram distribution (or uniformly from the normal vocabulary), and
the rest stay unchanged. Special tokens are never drawn.

Randomness is a counter-based hash of (seed, step, global row index, position)
rather than a stateful generator, so that a row's mask does not depend on
which process holds it or how many processes there are, and a whole batch is
masked with a few vectorised numpy calls.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mlm_jax import tokenizer as tok_lib

# Independent streams of the hash: one per random decision.
_SELECT, _ACTION, _TOKEN = 1, 2, 3
_NEVER_SELECTED = (tok_lib.PAD_ID, tok_lib.CLS_ID, tok_lib.SEP_ID)


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a bijective avalanche hash of uint64 values."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def uniform(seed: int, step: int, rows: np.ndarray, width: int, stream: int,
            positions: np.ndarray | None = None) -> np.ndarray:
  """Uniforms in [0, 1), a pure function of (seed, stream, step, row, position).

  [len(rows), width] for every position of each row, or, given positions
  [len(rows), P], the same values at just those positions.
  """
  key = np.array([seed, stream, step], np.uint64)
  k = _mix(_mix(_mix(key[:1] * np.uint64(0x9E3779B97F4A7C15) + key[1:2]) + key[2:3]))
  if positions is None:
    positions = np.arange(width)[None, :]
  counter = rows.astype(np.uint64)[:, None] * np.uint64(width) + positions.astype(np.uint64)
  bits = _mix(k + _mix(counter + np.uint64(0x632BE59BD9B4E019)))
  return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def replacement_distribution(source: str, vocab_size: int,
                             unigram_counts: np.ndarray | None) -> np.ndarray:
  """[vocab] float64 probabilities of random replacement tokens."""
  if source == 'unigram':
    if unigram_counts is None:
      raise ValueError("random_source='unigram' needs the corpus's unigram counts")
    weights = np.asarray(unigram_counts, np.float64)[:vocab_size].copy()
  elif source == 'uniform':
    weights = np.ones(vocab_size, np.float64)
  else:
    raise ValueError(f"config.masking.random_source={source!r}: use 'unigram' or 'uniform'")
  weights[list(tok_lib.SPECIAL_IDS)] = 0.0
  if weights.sum() <= 0:
    raise ValueError('no normal token has a positive count to draw replacements from')
  return weights / weights.sum()


@dataclasses.dataclass(frozen=True, eq=False)
class Masker:
  """Masks packed rows: `masker(input_ids, seed=, step=, rows=)` -> batch dict."""

  max_predictions: int  # P
  select_rate: float
  mask_prob: float
  random_prob: float
  replacement_probs: np.ndarray  # [vocab] float64, zero on special tokens

  def __post_init__(self):
    object.__setattr__(self, '_cdf', np.cumsum(self.replacement_probs))

  def num_selected(self, num_maskable: np.ndarray) -> np.ndarray:
    """Exact number of selections per row: min(P, max(1, round(rate*n))), 0 if n=0."""
    k = np.floor(self.select_rate * num_maskable + 0.5).astype(np.int64)
    k = np.clip(k, 1, self.max_predictions)
    return np.where(num_maskable > 0, k, 0)

  def __call__(self, input_ids: np.ndarray, *, seed: int, step: int,
               rows: np.ndarray) -> dict[str, np.ndarray]:
    """Masks `input_ids: [b, T]`; `rows: [b]` are the rows' global indices."""
    b, t = input_ids.shape
    p = self.max_predictions
    maskable = ~np.isin(input_ids, _NEVER_SELECTED)
    k = self.num_selected(maskable.sum(axis=1))

    # Selection: the k maskable positions with the smallest random keys.
    keys = np.where(maskable, uniform(seed, step, rows, t, _SELECT), 2.0)
    order = np.argsort(keys, axis=1, kind='stable')[:, :p]
    valid = np.arange(p)[None, :] < k[:, None]
    positions = np.sort(np.where(valid, order, t), axis=1)  # Valid ones first, ascending.
    valid = positions < t
    positions = np.where(valid, positions, 0)

    row_idx = np.arange(b)[:, None]
    targets = np.where(valid, input_ids[row_idx, positions], 0)

    # What each selected position becomes.
    action = uniform(seed, step, rows, t, _ACTION, positions)
    to_mask = valid & (action < self.mask_prob)
    to_random = valid & ~to_mask & (action < self.mask_prob + self.random_prob)
    draw = uniform(seed, step, rows, t, _TOKEN, positions)
    random_ids = np.searchsorted(self._cdf, draw * self._cdf[-1], side='right')
    random_ids = np.minimum(random_ids, len(self._cdf) - 1)

    new_values = np.where(to_mask, tok_lib.MASK_ID, np.where(to_random, random_ids, targets))
    masked_input = input_ids.copy()
    sel_rows, sel_slots = np.nonzero(valid)
    masked_input[sel_rows, positions[sel_rows, sel_slots]] = new_values[sel_rows, sel_slots]

    return {
        'input_ids': masked_input.astype(np.int32),                        # [b, T]
        'attention_mask': (input_ids != tok_lib.PAD_ID).astype(np.int32),  # [b, T]
        'segment_ids': np.zeros((b, t), np.int32),                         # [b, T]
        'masked_positions': positions.astype(np.int32),                    # [b, P]
        'masked_ids': targets.astype(np.int32),                            # [b, P]
        'masked_weights': valid.astype(np.float32),                        # [b, P]
    }


def make_masker(masking_config, vocab_size: int,
                unigram_counts: np.ndarray | None) -> Masker:
  return Masker(
      max_predictions=masking_config.max_predictions,
      select_rate=masking_config.select_rate,
      mask_prob=masking_config.mask_prob,
      random_prob=masking_config.random_prob,
      replacement_probs=replacement_distribution(
          masking_config.random_source, vocab_size, unigram_counts))
