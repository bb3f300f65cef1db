"""Held-out evaluation: the validation split with fixed masks, through the eval step."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from mlm_jax.config_check import require
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.runtime import sharding
from mlm_jax.training import objective


def evaluate(eval_step: Any, state: Any, data: prepare.PreparedData, masker: masking.Masker,
             eval_config: ml_collections.ConfigDict, sentence_pair: str, mesh) -> dict[str, Any]:
  """Loss and accuracy on the validation split (config.eval: batch, masks, limit).

  Overall and per kind of masked slot, each next to the hit rate of always
  answering the train split's most frequent normal token (the eval step's
  baseline token); see step.slot_metrics.
  """
  totals: dict[str, float] = {}
  source = data.source('validation')
  global_batch = pipeline.eval_batch_size(len(source), eval_config.batch_size, mesh.size)
  for host_batch in pipeline.eval_batches(
      source, masker, global_batch=global_batch,
      mask_seed=eval_config.mask_seed, max_batches=eval_config.max_batches,
      process_index=jax.process_index(), process_count=jax.process_count(),
      sentence_pair=sentence_pair):
    sums = jax.device_get(eval_step(state, sharding.to_global(host_batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
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


def check_config(eval_config: ml_collections.ConfigDict) -> None:
  """ConfigError for an invalid config.eval."""
  require(eval_config.batch_size > 0,
          f'config.eval.batch_size={eval_config.batch_size} must be positive.')
  require(eval_config.max_batches >= 0, 'config.eval.max_batches must be >= 0 (0: whole split).')
