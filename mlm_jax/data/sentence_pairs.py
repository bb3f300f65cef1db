"""Sentence pairs for NSP (BERT) or SOP (ALBERT), cut from packed rows before masking.

Sentence pairs (NSP/SOP, optional): a packed row [CLS] content [SEP] is cut at
a hashed point into A and B and rebuilt as [CLS] A [SEP] B [SEP] [PAD]...
(content that no longer fits is dropped from the end), with segment ids 0 on
[CLS] A [SEP] and 1 on B [SEP] and labels in Hugging Face's convention:

  nsp  0: B is the true continuation; 1: B is random text, read from another
       row of the split chosen by the hash (so every process agrees);
  sop  0: A then B; 1: swapped, [CLS] B [SEP] A [SEP].

The cut, the label and the random row are functions of (seed, step, global
row index), like the masks.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from mlm_jax.data import masking
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import one_of
from mlm_jax.errors import require

# config.sentence_pair.task: 'none' leaves rows as packed (RoBERTa).
TASKS = ('none', 'nsp', 'sop')
# Hash streams of the sentence-pair draws (masking uses streams below 100).
_PAIR_CUT, _PAIR_LABEL, _PAIR_OTHER = 101, 102, 103
# [CLS] A [SEP] B [SEP] with at least one token in each segment.
MIN_SEQ_LEN = 5


def build(input_ids: np.ndarray, *, task: str, specials: tok_lib.Specials, seed: int,
          step: int | np.ndarray, rows: np.ndarray, read_other=None,
          own_indices: np.ndarray | None = None,
          num_source_rows: int = 0) -> dict[str, np.ndarray]:
  """Packed rows [b, T] of a tokenizer with `specials` -> sentence-pair rows and their labels.

  Returns input_ids [b, T], segment_ids [b, T], sentence_pair_labels [b] int32
  and sentence_pair_weights [b] float32: 0 on rows with fewer than 2 content
  tokens (eval padding rows, a very short last row of a split), which are left
  as they were.
  For 'nsp', `read_other(indices [b]) -> [b, T]` reads the random rows, chosen
  uniformly among the `num_source_rows` rows of the split other than
  `own_indices` (the rows' own indices there).
  """
  one_of('sentence_pair', 'task', task, TASKS[1:])
  b, t = input_ids.shape
  pad = specials.pad
  content = (input_ids != pad).sum(axis=1) - 2     # [b] tokens between [CLS] and [SEP]
  m = np.clip(np.minimum(content, t - 3), 0, None)             # [b] content kept in the pair
  ok = m >= 2

  def draw(stream: int) -> np.ndarray:
    return masking.uniform(seed, step, rows, 1, stream)[:, 0]

  cut = np.where(ok, 1 + np.floor(draw(_PAIR_CUT) * (m - 1)).astype(np.int64), m)  # len(A)
  label = ok & (draw(_PAIR_LABEL) >= 0.5)
  swapped = label if task == 'sop' else np.zeros(b, bool)
  first = np.where(swapped, m - cut, cut)[:, None]           # [b, 1] tokens of the first segment
  m, cut = m[:, None], cut[:, None]
  pos = np.arange(t)[None, :]
  in_first = (pos >= 1) & (pos <= first)
  in_second = (pos >= first + 2) & (pos <= m + 1)
  is_sep = (pos == first + 1) | (pos == m + 2)
  # Column of the packed row that each position copies.
  col = np.where(in_first, np.where(swapped[:, None], cut + pos, pos),
                 np.where(swapped[:, None], pos - m + cut - 1, pos - 1))
  row_idx = np.arange(b)[:, None]
  tokens = input_ids[row_idx, np.clip(col, 0, t - 1)]
  if task == 'nsp' and label.any():
    if read_other is None or own_indices is None or num_source_rows < 2:
      raise ValueError("sentence_pair.task='nsp' needs read_other, own_indices and a split "
                       'of at least 2 rows')
    offset = 1 + np.floor(draw(_PAIR_OTHER) * (num_source_rows - 1)).astype(np.int64)
    other = read_other(np.where(label, (np.asarray(own_indices) + offset) % num_source_rows, -1))
    other_content = np.maximum((other != pad).sum(axis=1) - 2, 1)[:, None]
    # B' starts where B would have, wrapping around a short random row.
    other_tokens = other[row_idx, 1 + (pos - 2) % other_content]
    tokens = np.where(label[:, None] & in_second, other_tokens, tokens)
  paired = np.where(in_first | in_second, tokens,
                    np.where(pos == 0, specials.cls, np.where(is_sep, specials.sep, pad)))
  segments = ((pos >= first + 2) & (pos <= m + 2)).astype(np.int32)
  keep = ~ok[:, None]
  return {
      'input_ids': np.where(keep, input_ids, paired).astype(np.int32),       # [b, T]
      'segment_ids': np.where(keep, 0, segments).astype(np.int32),          # [b, T]
      'sentence_pair_labels': label.astype(np.int32),                       # [b]
      'sentence_pair_weights': ok.astype(np.float32),                       # [b]
  }


def check_config(sp: ml_collections.ConfigDict, seq_len: int) -> None:
  """ConfigError for an invalid config.sentence_pair (rows of length seq_len must hold a pair)."""
  one_of('sentence_pair', 'task', sp.task, TASKS)
  require(sp.loss_weight >= 0, f'config.sentence_pair.loss_weight={sp.loss_weight} must be >= 0.')
  require(sp.task == 'none' or seq_len >= MIN_SEQ_LEN,
          f'config.sentence_pair.task={sp.task!r} needs config.data.seq_len >= {MIN_SEQ_LEN} '
          '([CLS] A [SEP] B [SEP]); raise it.')
