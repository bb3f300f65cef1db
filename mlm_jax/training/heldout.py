"""Held-out evaluation: the validation split with fixed masks, through the eval step."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepared
from mlm_jax.runtime import sharding
from mlm_jax.training import objective


# The figures of each source of a mixture that evaluation reports beside the total.
PER_SOURCE = ('loss', 'mlm_accuracy', 'mask_accuracy', 'context_ratio')


def evaluate(eval_step: Any, state: Any, data: prepared.PreparedData, masker: masking.Masker,
             eval_config: ml_collections.ConfigDict, sentence_pair: str, mesh) -> dict[str, Any]:
  """Loss and accuracy on the validation split (config.eval: batch, masks, limit).

  Overall and per kind of masked slot, each next to the hit rate of always
  answering the train split's most frequent normal token (the eval step's
  baseline token); see step.slot_metrics. A mixture's sources are evaluated
  one by one (config.eval.max_batches each), their figures reported as
  NAME/mask_accuracy ... beside those of all of them together.
  """
  parts = list(range(data.num_parts)) if data.num_parts > 1 else [None]
  sources = [data.source('validation', p) for p in parts]
  # One batch size for all sources: the eval step compiles once.
  global_batch = pipeline.eval_batch_size(max(map(len, sources)), eval_config.batch_size,
                                          mesh.size)
  sums = [_sums(eval_step, state, source, masker, eval_config, sentence_pair, mesh,
                global_batch) for source in sources]
  result = _figures({k: sum(s[k] for s in sums) for k in sums[0]}, data)
  if len(parts) > 1:
    for name, part_sums in zip(data.part_names, sums):
      figures = _figures(part_sums, data)
      result |= {f'{k}/{name}': figures[k] for k in PER_SOURCE if k in figures}
  return result


def evaluate_with_ema(eval_step: Any, state: Any, data: prepared.PreparedData,
                      masker: masking.Masker, eval_config: ml_collections.ConfigDict,
                      sentence_pair: str, mesh) -> dict[str, Any]:
  """`evaluate`'s figures of the live weights, and where the state keeps an average of them
  (config.train.ema_decay > 0) the same figures of the average, prefixed `ema_`, on the
  same batches and masks: the two are compared like for like."""
  result = evaluate(eval_step, state, data, masker, eval_config, sentence_pair, mesh)
  if getattr(state, 'ema_params', None) is None:
    return result
  # The average in the params' place: same tree and shardings, so the step does not recompile.
  averaged = evaluate(eval_step, state.replace(params=state.ema_params), data, masker,
                      eval_config, sentence_pair, mesh)
  return result | {f'ema_{k}': v for k, v in averaged.items() if k != 'baseline_token'}


def _sums(eval_step: Any, state: Any, source: Any, masker: masking.Masker,
          eval_config: ml_collections.ConfigDict, sentence_pair: str, mesh,
          global_batch: int) -> dict[str, float]:
  """The eval step's sums over a validation split."""
  totals: dict[str, float] = {}
  for host_batch in pipeline.eval_batches(
      source, masker, global_batch=global_batch,
      mask_seed=eval_config.mask_seed, max_batches=eval_config.max_batches,
      process_index=jax.process_index(), process_count=jax.process_count(),
      sentence_pair=sentence_pair):
    sums = jax.device_get(eval_step(state, sharding.to_global(host_batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  return totals


def _figures(totals: dict[str, float], data: prepared.PreparedData) -> dict[str, Any]:
  denom = max(totals['weight_sum'], 1.0)
  result: dict[str, Any] = {
      'loss': totals['loss_sum'] / denom, 'mlm_accuracy': totals['correct_sum'] / denom,
      'num_masked': totals['weight_sum'],
      'baseline_token': data.tokenizer.id_to_piece(data.most_frequent_token()),
      **objective.slot_metrics(totals)}
  if 'pair_weight_sum' in totals:
    rows = max(totals['pair_weight_sum'], 1.0)
    result['sentence_pair_loss'] = totals['pair_loss_sum'] / rows
    result['sentence_pair_accuracy'] = totals['pair_correct_sum'] / rows
  return result
