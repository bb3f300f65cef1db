"""The pretraining objective: loss, accuracy and baseline sums of a batch, and their ratios.

Every function returns sums; the caller divides. Under `jax.jit` with the
batch sharded over the mesh, `jnp.sum` is already global, so the train step
divides `sum(w * CE)` by the global number of masked tokens |M| =
sum(masked_weights), never a mean of per-device means.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from mlm_jax.data import masking
from mlm_jax.runtime import platform_ops

Array = jax.Array
Batch = dict[str, Array]
# The index of the largest value over the last axis (platform_ops.Ops.argmax).
Argmax = Callable[[Array], Array]
# baseline_token when no most frequent token is known (a benchmark, synthetic
# data): no id equals it, so the baseline sums stay 0.
NO_BASELINE = -1


def mlm_loss_terms(logits: Array, masked_ids: Array, weights: Array, kinds: Array | None = None,
                   baseline_token: int = NO_BASELINE,
                   argmax: Argmax = platform_ops.DEFAULT.argmax) -> dict[str, Array]:
  """logits [B, P, V], masked_ids, weights, kinds [B, P] -> sums (caller divides).

  Besides the loss, accuracy and weight of all masked slots, the same sums per
  kind of slot (what the input showed there: masking.SLOT_KINDS), and how
  often always answering `baseline_token` (the most frequent token) would be
  right, overall and per kind. Accuracy at [MASK] slots against that rate is
  what the model learned from context (see `slot_metrics`). Without `kinds`,
  the first three sums only. NO_BASELINE (no id): the baseline sums are 0.
  `argmax` is the platform's form of jnp.argmax(x, axis=-1) (the same result).
  """
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), masked_ids)
  correct = (argmax(logits) == masked_ids).astype(jnp.float32)
  terms = {
      'loss_sum': jnp.sum(ce * weights),
      'correct_sum': jnp.sum(correct * weights),
      'weight_sum': jnp.sum(weights),
  }
  if kinds is None:
    return terms
  hit = (masked_ids == baseline_token).astype(jnp.float32)
  terms['baseline_sum'] = jnp.sum(hit * weights)
  for i, kind in enumerate(masking.SLOT_KINDS, start=1):
    w = weights * (kinds == i)
    terms |= {f'{kind}_loss_sum': jnp.sum(ce * w), f'{kind}_correct_sum': jnp.sum(correct * w),
              f'{kind}_weight_sum': jnp.sum(w), f'{kind}_baseline_sum': jnp.sum(hit * w)}
  return terms


def slot_metrics(sums: dict[str, float]) -> dict[str, float]:
  """Sums of mlm_loss_terms (over a log interval or an evaluation) -> ratios by kind of slot.

  baseline_accuracy: how often always answering the most frequent token is
  right, over all masked slots; per kind (mask, random, kept) its loss,
  accuracy and baseline_accuracy; and context_ratio = accuracy at [MASK]
  slots / the most frequent token's rate there, what the model learned from
  context. A kind with no slot gets no entries.
  """
  def ratio(a: float, b: float) -> float:
    return float(a) / max(float(b), 1.0)

  out = {'baseline_accuracy': ratio(sums['baseline_sum'], sums['weight_sum'])}
  for kind in masking.SLOT_KINDS:
    w = sums[f'{kind}_weight_sum']
    if w > 0:
      out |= {f'{kind}_loss': ratio(sums[f'{kind}_loss_sum'], w),
              f'{kind}_accuracy': ratio(sums[f'{kind}_correct_sum'], w),
              f'{kind}_baseline_accuracy': ratio(sums[f'{kind}_baseline_sum'], w)}
  if out.get('mask_baseline_accuracy'):
    out['context_ratio'] = out['mask_accuracy'] / out['mask_baseline_accuracy']
  return out


def pair_loss_terms(logits: Array, labels: Array, weights: Array) -> dict[str, Array]:
  """Sentence-pair logits [B, 2], labels [B], weights [B] (0: no pair) -> sums (caller divides)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return {'pair_loss_sum': jnp.sum(ce * weights), 'pair_correct_sum': jnp.sum(correct * weights),
          'pair_weight_sum': jnp.sum(weights)}


def loss_terms(outputs: dict[str, Array], batch: Batch, baseline_token: int = NO_BASELINE,
               argmax: Argmax = platform_ops.DEFAULT.argmax) -> dict[str, Array]:
  """The model's pretraining outputs and their batch -> mlm_loss_terms (+ pair_loss_terms).

  outputs: 'mlm_logits' [B, P, V] and, with a sentence-pair head,
  'sentence_pair_logits' [B, 2]; batch as state.batch_spec describes it.
  """
  terms = mlm_loss_terms(outputs['mlm_logits'], batch['masked_ids'], batch['masked_weights'],
                         batch['masked_kinds'], baseline_token, argmax)
  if 'sentence_pair_logits' in outputs:
    terms |= pair_loss_terms(outputs['sentence_pair_logits'], batch['sentence_pair_labels'],
                             batch['sentence_pair_weights'])
  return terms
