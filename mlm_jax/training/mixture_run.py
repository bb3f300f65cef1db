"""A run over a weighted mixture (config.data.sources): its draw order and per-source figures.

The draw itself is data/mixture.py's, a function of (seed, stream position);
this module builds it from the prepared data and reports, at every log step,
the tokens and epochs each source has given the run so far:

  tokens_seen/NAME   real (non-padding) tokens of the rows drawn from the source
  epochs_seen/NAME   rows drawn from it / its train rows

Epochs are a closed form of the step. Tokens are counted over each log
interval's global batches (every row is T real tokens but a source's last,
padded one) and carried over a resume from metrics.jsonl, as the run's own
tokens_seen is.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_collections
import numpy as np

from mlm_jax.data import mixture
from mlm_jax.data import pipeline
from mlm_jax.data import prepared

# Positions counted per call when tokens are recounted from step 0.
_CHUNK = 1 << 20


class MixtureRun:
  """The mixture of a run: `order` for the input pipeline, `figures(step)` for its log."""

  def __init__(self, config: ml_collections.ConfigDict, data: prepared.PreparedData,
               start_step: int, series: dict[str, dict[int, float]]):
    members = mixture.members(config.data)
    self.names = [m.name for m in members]
    self.global_batch = config.train.batch_size
    sources = [data.source('train', k) for k in range(len(members))]
    rows = [len(s) for s in sources]
    self.mix = mixture.Mixture([m.weight for m in members], rows, config.seed,
                               [m.max_epochs for m in members])
    mixture.check_steps(self.mix, config.train.num_steps, self.global_batch, self.names)
    self.order = functools.partial(self.mix, shuffle=pipeline.stream_to_source)
    pad = data.tokenizer.specials.pad
    # Each source's last row is its only one with padding.
    self._seq_len = config.data.seq_len
    self._last_row_padding = np.array(
        [int((s.read(np.array([len(s) - 1]))[0] == pad).sum()) for s in sources], np.int64)
    self._last_rows = self.mix.offsets + self.mix.rows - 1
    self._step = start_step
    earlier = [series.get(f'tokens_seen/{n}', {}).get(start_step) for n in self.names]
    if start_step == 0:
      self._tokens = np.zeros(len(members), np.int64)
    elif all(t is not None for t in earlier):
      self._tokens = np.asarray(earlier, np.int64)
    else:  # Not logged at the step this run resumes from: counted again.
      self._tokens = self._tokens_between(0, start_step * self.global_batch)

  def _tokens_between(self, first: int, last: int) -> np.ndarray:
    """[K] real tokens of the rows drawn at global stream positions [first, last)."""
    tokens = np.zeros(len(self.names), np.int64)
    for a in range(first, last, _CHUNK):
      positions = np.arange(a, min(a + _CHUNK, last), dtype=np.int64)
      member, _ = self.mix.draw(positions)
      flat = self.order(positions)
      drawn = np.bincount(member, minlength=len(self.names))
      padded = np.bincount(member[flat == self._last_rows[member]], minlength=len(self.names))
      tokens += drawn * self._seq_len - padded * self._last_row_padding
    return tokens

  def figures(self, step: int) -> dict[str, Any]:
    """tokens_seen/NAME and epochs_seen/NAME of every source after `step` steps."""
    self._tokens += self._tokens_between(self._step * self.global_batch,
                                         step * self.global_batch)
    self._step = step
    rows = self.mix.rows_drawn(step * self.global_batch)
    out: dict[str, Any] = {}
    for k, name in enumerate(self.names):
      out[f'tokens_seen/{name}'] = int(self._tokens[k])
      out[f'epochs_seen/{name}'] = float(rows[k] / self.mix.rows[k])
    return out


def for_run(config: ml_collections.ConfigDict, data: prepared.PreparedData, start_step: int,
            series: dict[str, dict[int, float]]) -> MixtureRun | None:
  """The run's mixture, or None for one corpus."""
  return MixtureRun(config, data, start_step, series) if data.num_parts > 1 else None
