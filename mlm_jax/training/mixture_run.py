"""A run over a weighted mixture (config.data.sources): its draw order and per-source figures.

The draw itself is data/mixture.py's, a function of (seed, stream position);
this module builds it from the prepared data, logs the shares it draws by
once at the start, and reports at every log step:

  tokens_seen/NAME   real (non-padding) tokens of the rows drawn from the source so far
  epochs_seen/NAME   rows drawn from it so far / its train rows
  share/NAME         the fraction of the rows drawn since the previous log step (rows, not
                     tokens) that came from the source: its configured share to within a row
                     per source per batch, less once a source reaches its epoch cap

The shares are the sources' weights, or with config.data.temperature tau > 0
p_k ∝ w_k n_k^(1/tau), n_k the source's train tokens as prepare counted them
(stats.json: parts[k].train.tokens, the documents' tokens before packing,
without [CLS], [SEP] or padding), or the source's 'tokens' where it gives them
(mixture.temperature_tokens).

Epochs and shares are closed forms of the stream position. Tokens are counted
over each log interval's rows (every row is T real tokens but a source's
last, padded one) and carried over a resume from metrics.jsonl, as the run's
own tokens_seen is.

A training phase that changes the shares builds a new MixtureRun that
continues the last one: MixtureRun(config, data, start_step, series,
**earlier.handover(position)), position being the stream position of the
boundary (see handover).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import ml_collections
import numpy as np
from absl import logging

from mlm_jax.data import mixture
from mlm_jax.data import pipeline
from mlm_jax.data import prepared

# Positions counted per call when tokens are recounted from step 0.
_CHUNK = 1 << 20


def train_tokens(data: prepared.PreparedData) -> list[int]:
  """[K] each source's train tokens as prepare counted them (stats.json parts[k].train)."""
  return [int(part['train']['tokens']) for part in data.stats['parts']]


class MixtureRun:
  """The mixture of a run: `order` for the input pipeline, `figures(step)` for its log.

  Keywords, for a run whose shares change (training phases) or whose batch grows:
    start_position: the global stream position from which this mixture draws.
    rows_before: [K] rows each source gave before start_position, when this mixture's
      sources are the rows the earlier one drew from (same data dir); None: 0 each, a
      stream that starts anew.
    tokens_before: [K] tokens each source gave before start_position; read only where
      metrics.jsonl lacks the step this run starts from.
    position_of: step -> the global stream position that step starts at; None:
      step * config.train.batch_size.
  """

  def __init__(self, config: ml_collections.ConfigDict, data: prepared.PreparedData,
               start_step: int, series: dict[str, dict[int, float]], *,
               start_position: int = 0, rows_before: Sequence[int] | None = None,
               tokens_before: Sequence[int] | None = None,
               position_of: Callable[[int], int] | None = None):
    members = mixture.members(config.data)
    self.names = [m.name for m in members]
    self.global_batch = config.train.batch_size
    self.position_of = position_of or (lambda step: step * self.global_batch)
    sources = [data.source('train', k) for k in range(len(members))]
    rows = [len(s) for s in sources]
    weights = [m.weight for m in members]
    tokens = mixture.temperature_tokens(members, train_tokens(data))
    temperature = float(config.data.get('temperature') or 0.0)
    self.shares = mixture.shares(weights, tokens, temperature)
    self.mix = mixture.Mixture(mixture.draw_weights(weights, tokens, temperature), rows,
                               config.seed, [m.max_epochs for m in members],
                               start_position=start_position, rows_before=rows_before)
    mixture.check_steps(self.mix, config.train.num_steps, self.global_batch, self.names,
                        end_position=self.position_of(config.train.num_steps))
    logging.info('Mixture drawn from position %d, %s: %s', start_position,
                 f'temperature {temperature:g}' if temperature else 'by weight',
                 ', '.join(f'{n} {p:.4f} ({t:,} train tokens)'
                           for n, p, t in zip(self.names, self.shares, tokens)))
    self.order = functools.partial(self.mix, shuffle=pipeline.stream_to_source)
    pad = data.tokenizer.specials.pad
    # Each source's last row is its only one with padding.
    self._seq_len = config.data.seq_len
    self._last_row_padding = np.array(
        [int((s.read(np.array([len(s) - 1]))[0] == pad).sum()) for s in sources], np.int64)
    self._last_rows = self.mix.offsets + self.mix.rows - 1
    self._position = self.position_of(start_step)
    earlier = [series.get(f'tokens_seen/{n}', {}).get(start_step) for n in self.names]
    if start_step == 0:
      self._tokens = np.zeros(len(members), np.int64)
    elif all(t is not None for t in earlier):
      self._tokens = np.asarray(earlier, np.int64)
    else:  # Not logged at the step this run resumes from: counted again.
      before = np.zeros(len(members), np.int64) if tokens_before is None else tokens_before
      self._tokens = np.asarray(before, np.int64) + self.tokens_between(start_position,
                                                                         self._position)

  def tokens_between(self, first: int, last: int) -> np.ndarray:
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

  def handover(self, position: int, same_rows: bool = True) -> dict[str, Any]:
    """The keywords of the MixtureRun that takes over at stream `position` (a phase boundary,
    at or after the last step this one reported): where it starts, the rows and tokens each
    source gave before it. same_rows: the next phase reads the same data dir, so each
    source's stream goes on (no row drawn twice within an epoch across the change); False
    (other rows, e.g. another row length): its streams start anew."""
    if position < self._position:
      raise ValueError(f'hand-over at position {position}, before {self._position}, where this '
                       'mixture last counted its tokens')
    tokens = self._tokens + self.tokens_between(self._position, position)
    rows = self.mix.rows_drawn(position) if same_rows else None
    return {'start_position': position, 'rows_before': rows, 'tokens_before': tokens}

  def figures(self, step: int) -> dict[str, Any]:
    """tokens_seen/NAME, epochs_seen/NAME and share/NAME of every source after `step` steps
    (share/NAME: of the rows since the previous call; left out when there are none)."""
    position = self.position_of(step)
    before = self.mix.rows_drawn(self._position)
    self._tokens += self.tokens_between(self._position, position)
    self._position = position
    rows = self.mix.rows_drawn(position)
    interval = rows - before
    out: dict[str, Any] = {}
    for k, name in enumerate(self.names):
      out[f'tokens_seen/{name}'] = int(self._tokens[k])
      out[f'epochs_seen/{name}'] = float(rows[k] / self.mix.rows[k])
      if interval.sum() > 0:
        out[f'share/{name}'] = float(interval[k] / interval.sum())
    return out
