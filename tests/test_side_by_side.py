"""side_by_side: both systems on the same rows and masks, scored the same way; bad input early.

Needs the interop extra (torch, transformers); skipped without it.
"""

import json
import os

import numpy as np
import pytest

from mlm_jax.analysis import side_by_side
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.errors import ConfigError
from tests.conftest import require

require('torch', 'transformers')


def _config(prepared, variant):
  config, _ = prepared
  config = config.copy_and_resolve_references()
  config.model.variant = variant
  config.model.dropout_rate = 0.0
  if variant == 'modern':
    config.model.intermediate_size = 48
    config.model.layer_norm_eps = 1e-5
    config.model.local_attention = 16
    config.model.global_attn_every_n_layers = 2
  config.train.num_steps = 6
  config.train.eval_every = 6
  config.train.checkpoint_every = 6
  return config


@pytest.mark.slow
@pytest.mark.parametrize('variant', ['bert', 'modern'])
def test_both_systems_train_and_score_the_same_masked_tokens(prepared, tmp_path, variant,
                                                              monkeypatch):
  config = _config(prepared, variant)
  result = side_by_side.run(config, str(tmp_path), seeds=[0])
  row = result['seeds'][0]
  assert result['hf_model'] == {'bert': 'BertForMaskedLM', 'modern': 'ModernBertForMaskedLM'}[
      variant]
  ours, hf = row['ours'], row['hf']
  # The same held-out masks: the most frequent token's hit rates are the same numbers.
  for k in ('baseline_accuracy', 'mask_baseline_accuracy'):
    assert hf[k] == pytest.approx(ours[k], abs=1e-12), k
  for r in (ours, hf):
    # Six steps from a fresh model on 600 ids: the loss is still near ln(600) and finite.
    assert 0 < r['loss'] < 8 and 0 <= r['mask_accuracy'] <= 1 and r['context_ratio'] >= 0
  table = side_by_side.table(result)
  assert 'HF ' + result['hf_model'] in table and 'mean ± sd' in table
  # Finished halves are kept: a second run trains nothing.
  monkeypatch.setattr(side_by_side, 'train_hf', lambda *a, **k: pytest.fail('HF retrained'))
  monkeypatch.setattr(side_by_side.loop, 'train_and_evaluate',
                      lambda *a, **k: pytest.fail('ours retrained'))
  again = side_by_side.run(config, str(tmp_path), seeds=[0])
  assert again['seeds'] == result['seeds']
  # Another config in the same workdir is refused, and what is there stays.
  kept = json.load(open(os.path.join(tmp_path, 'seed0', 'hf.json')))
  assert kept['config']['train']['num_steps'] == 6
  config.train.learning_rate *= 2
  with pytest.raises(ConfigError, match='another config'):
    side_by_side.run(config, str(tmp_path), seeds=[0])
  assert json.load(open(os.path.join(tmp_path, 'seed0', 'hf.json'))) == kept


class _Oracle:
  """A stand-in for the torch model: answers the target, or always the same token."""

  def __init__(self, answer=None):
    self.answer = answer

  def predict(self, batch):
    r, p = np.nonzero(batch['masked_weights'] > 0)
    pos = batch['masked_positions'][r, p]
    order = np.lexsort((pos, r))  # Row-major, as the torch side reads its labels.
    target = batch['masked_ids'][r, p][order]
    guess = target if self.answer is None else np.full_like(target, self.answer)
    return (r[order], pos[order]), guess, np.zeros(len(target))


def test_evaluation_scores_per_kind_of_slot(prepared):
  config, data = prepared
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  perfect = side_by_side.evaluate_hf(_Oracle(), data, masker, config.eval, 8)
  assert perfect['mlm_accuracy'] == 1.0
  assert perfect['mask_accuracy'] == perfect['random_accuracy'] == perfect['kept_accuracy'] == 1.0
  # Always answering the most frequent token scores exactly its hit rate, kind by kind.
  frequent = side_by_side.evaluate_hf(_Oracle(data.most_frequent_token()), data, masker,
                                      config.eval, 8)
  for kind in ('', 'mask_', 'random_', 'kept_'):
    accuracy = frequent[f'{kind}accuracy' if kind else 'mlm_accuracy']
    assert accuracy == pytest.approx(frequent[f'{kind}baseline_accuracy']), kind
  assert frequent['context_ratio'] == pytest.approx(1.0)
  # The kinds partition the masked slots: 80/10/10 of them, as the eval batches hold.
  source = data.source('validation')
  kinds = np.concatenate([b['masked_kinds'][b['masked_weights'] > 0] for b in pipeline.eval_batches(
      source, masker, global_batch=pipeline.eval_batch_size(len(source), config.eval.batch_size,
                                                            8),
      mask_seed=config.eval.mask_seed, max_batches=config.eval.max_batches)])
  assert set(np.unique(kinds)) <= {1, 2, 3} and (kinds == 1).mean() > 0.6


def test_bad_input_is_refused_before_anything_trains(prepared, tmp_path):
  config = _config(prepared, 'bert')
  for field, value, message in (('train.grad_accum_steps', 2, 'grad_accum_steps=1'),
                                ('sentence_pair.task', 'nsp', 'sentence_pair.task=none'),
                                ('init.hf_dir', '/x', 'hf_dir'),
                                ('model.document_mask', True, 'document_mask=False')):
    bad = config.copy_and_resolve_references()
    section, name = field.split('.')
    bad[section][name] = value
    with pytest.raises(ConfigError, match=message):
      side_by_side.run(bad, str(tmp_path / 'bad'), seeds=[0])
  with pytest.raises(ConfigError, match='repeats a seed'):
    side_by_side.run(config, str(tmp_path / 'bad'), seeds=[1, 1])
  assert not os.path.exists(tmp_path / 'bad')
