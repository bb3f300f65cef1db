"""Evaluation scores of fine-tuned predictions (host numpy, on the whole eval file).

  classify, pair   accuracy; with two labels also Matthews' correlation (MCC)
  regress          mean squared error, Pearson's r, Spearman's rho
  tag              accuracy over words; F1 over entities when the tags are
                   IOB2/BIO ('O', 'B-X', 'I-X', as CoNLL's conlleval counts
                   them), else the macro F1 over tags
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def classification(predicted: np.ndarray, gold: np.ndarray, num_labels: int) -> dict[str, float]:
  """predicted, gold [N] label indices -> accuracy (and mcc for two labels)."""
  out = {'accuracy': float(np.mean(predicted == gold))}
  if num_labels == 2:
    out['mcc'] = matthews_corrcoef(predicted, gold)
  return out


def matthews_corrcoef(predicted: np.ndarray, gold: np.ndarray) -> float:
  """MCC of binary predictions; 0 when a marginal is empty (as scikit-learn defines it)."""
  p, g = predicted.astype(bool), gold.astype(bool)
  tp, tn = float(np.sum(p & g)), float(np.sum(~p & ~g))
  fp, fn = float(np.sum(p & ~g)), float(np.sum(~p & g))
  denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  return float((tp * tn - fp * fn) / denom) if denom else 0.0


def regression(predicted: np.ndarray, gold: np.ndarray) -> dict[str, float]:
  """predicted, gold [N] -> mse, pearson, spearman (correlations 0 when either is constant)."""
  out = {'mse': float(np.mean((predicted - gold) ** 2)), 'pearson': 0.0, 'spearman': 0.0}
  if np.ptp(predicted) > 0 and np.ptp(gold) > 0:
    from scipy import stats  # pylint: disable=import-outside-toplevel  # Only regression pays.
    out['pearson'] = float(stats.pearsonr(predicted, gold).statistic)
    out['spearman'] = float(stats.spearmanr(predicted, gold).statistic)
  return out


def is_bio(tags: Sequence[Any]) -> bool:
  """Whether a tag set is IOB2: 'O' and 'B-'/'I-' prefixed types."""
  return all(isinstance(t, str) and (t == 'O' or t[:2] in ('B-', 'I-')) for t in tags)


def entities(tags: Sequence[str]) -> set[tuple[int, int, str]]:
  """(start, end, type) spans of one sentence's IOB2 tags; an I- after another type starts one."""
  spans, start, kind = set(), None, None
  for i, tag in enumerate([*tags, 'O']):
    inside = tag.startswith('I-') and kind == tag[2:]
    if start is not None and not inside:
      spans.add((start, i, kind))
      start, kind = None, None
    if tag != 'O' and not inside:
      start, kind = i, tag[2:]
  return spans


def tagging(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str]],
            labels: Sequence[Any]) -> dict[str, float]:
  """Each sentence's predicted and gold tags (the words kept) -> accuracy and f1."""
  flat_p = [t for s in predicted for t in s]
  flat_g = [t for s in gold for t in s]
  out = {'accuracy': float(np.mean([a == b for a, b in zip(flat_p, flat_g)]))}
  if is_bio(labels):
    found = sum(len(entities(p)) for p in predicted)
    true = sum(len(entities(g)) for g in gold)
    hit = sum(len(entities(p) & entities(g)) for p, g in zip(predicted, gold))
    out['f1'] = 2 * hit / (found + true) if found + true else 0.0
  else:
    out['f1'] = macro_f1(flat_p, flat_g, labels)
  return out


def macro_f1(predicted: Sequence[Any], gold: Sequence[Any], labels: Sequence[Any]) -> float:
  """Mean over the labels that occur (in either) of each label's F1."""
  scores = []
  for label in labels:
    tp = sum(p == label and g == label for p, g in zip(predicted, gold))
    n = sum(p == label for p in predicted) + sum(g == label for g in gold)
    if n:
      scores.append(2 * tp / n)
  return float(np.mean(scores)) if scores else 0.0


def describe(step: int, result: dict[str, float]) -> str:
  """The line printed at an evaluation: 'step 40: eval accuracy 0.9375, mcc 0.8750'."""
  names = [k for k in ('accuracy', 'f1', 'mcc', 'mse', 'pearson', 'spearman', 'loss')
           if k in result]
  first, *rest = names
  parts = [f'eval {first} {result[first]:.4f}', *(f'{k} {result[k]:.4f}' for k in rest)]
  return f'step {step}: ' + ', '.join(parts)
