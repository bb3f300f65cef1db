"""Model options: scanned layers, remat, DropToken, sentence-pair head (attention: test_attention)."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax import model as model_lib
from mlm_jax.config import fields
from mlm_jax.interop import hf
from mlm_jax.training import checkpoint
from mlm_jax.training import objective
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib
from mlm_jax.training import step as step_lib
from tests.conftest import model_config
from tests.conftest import run_training

B, T, P = 4, 16, 3


def _cfg(**kw):
  base = dict(vocab_size=100, padded_vocab_size=128, num_layers=3, hidden_size=32, num_heads=4,
              intermediate_size=64, max_position_embeddings=T, dropout_rate=0.0,
              attention_dropout_rate=0.0)
  return model_config(**(base | kw))


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = np.ones((B, T), np.int32)
  mask[1, 11:] = 0
  mask[3, 6:] = 0
  ids = np.where(mask > 0, rng.integers(5, 100, (B, T)), 0).astype(np.int32)
  positions = np.stack([np.sort(rng.choice(np.arange(1, mask[r].sum()), P, replace=False))
                        for r in range(B)]).astype(np.int32)
  return {'input_ids': ids, 'attention_mask': mask, 'segment_ids': np.zeros_like(ids),
          'masked_positions': positions,
          'masked_ids': rng.integers(5, 100, (B, P)).astype(np.int32),
          'masked_weights': np.ones((B, P), np.float32),
          'masked_kinds': np.ones((B, P), np.int32),  # All [MASK] slots.
          'sentence_pair_labels': rng.integers(0, 2, B).astype(np.int32),
          'sentence_pair_weights': np.ones(B, np.float32)}


def _params(cfg, batch, seed=0):
  return nn.unbox(model_lib.BertForMLM(cfg).init(jax.random.key(seed), batch)['params'])


def _train_config(num_steps=5):
  return ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=1, num_steps=num_steps, grad_clip_norm=1.0, adam_b1=0.9,
      adam_b2=0.999, adam_eps=1e-6, weight_decay=0.01, schedule='linear'))


def _loss_and_grads(cfg, params, batch, rng=jax.random.key(1)):
  model = model_lib.BertForMLM(cfg)

  def loss(p):
    logits = model.apply({'params': p}, batch, deterministic=False, rngs={'dropout': rng})
    terms = objective.mlm_loss_terms(logits, batch['masked_ids'], batch['masked_weights'])
    return terms['loss_sum'] / terms['weight_sum']
  # Compiled, as a step runs it: op by op the gradient of the model takes longer.
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow
def test_scanned_layers_compute_the_same_model_as_separate_layers():
  cfg, batch = _cfg(), _batch()
  params = _params(cfg, batch)
  scan_cfg = _cfg(scan_layers=True)
  stacked = model_lib.stack_layers(params, cfg.num_layers)
  # The layout nn.scan itself creates.
  fresh = _params(scan_cfg, batch)
  assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(stacked)
  assert fresh['encoder']['layers']['block']['intermediate']['kernel'].shape == (3, 32, 64)
  np.testing.assert_allclose(
      model_lib.BertForMLM(scan_cfg).apply({'params': stacked}, batch),
      model_lib.BertForMLM(cfg).apply({'params': params}, batch), atol=1e-5)
  every = model_lib.BertForMLM(scan_cfg).apply({'params': stacked}, batch,
                                               method=model_lib.BertForMLM.all_layers)
  assert every.shape == (4, B, T, 32)
  np.testing.assert_allclose(every, model_lib.BertForMLM(cfg).apply(
      {'params': params}, batch, method=model_lib.BertForMLM.all_layers), atol=1e-5)
  back = model_lib.unstack_layers(stacked, cfg.num_layers)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b)
  # Export reads the scanned layout as the per-layer one.
  ours, theirs = hf.to_hf_state_dict(stacked, scan_cfg), hf.to_hf_state_dict(params, cfg)
  assert ours.keys() == theirs.keys()
  for k in ours:
    np.testing.assert_array_equal(ours[k], theirs[k])
  again = hf.to_hf_state_dict(hf.from_hf_state_dict(ours, scan_cfg), scan_cfg)
  for k in ours:
    np.testing.assert_array_equal(again[k], ours[k])


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['full', 'dots'])
@pytest.mark.parametrize('scan', [False, True])
def test_remat_changes_neither_loss_nor_gradients(remat, scan):
  batch = _batch()
  cfg = _cfg(scan_layers=scan, dropout_rate=0.1)  # Dropout masks must be replayed exactly.
  params = _params(cfg, batch)
  loss, grads = _loss_and_grads(cfg, params, batch)
  loss_r, grads_r = _loss_and_grads(_cfg(scan_layers=scan, dropout_rate=0.1, remat=remat),
                                    params, batch)
  assert float(loss) == pytest.approx(float(loss_r), rel=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_r)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_remat_keeps_deterministic_static_for_any_block_of_the_scaffolds_signature():
  # Every block's __call__ is (x, inputs, deterministic, rows), `inputs` the
  # encoder's own struct: remat then knows `deterministic` by position, so a
  # block with other inputs is rematerialised with the bool still a Python
  # value (traced, `if deterministic` would fail), and computes the same.
  import flax.struct

  from mlm_jax.model import encoder

  @flax.struct.dataclass
  class Inputs:
    scale: jax.Array

  class Block(nn.Module):
    cfg: model_lib.ModelConfig
    ops: object = None

    @nn.compact
    def __call__(self, x, inputs, deterministic, rows=None):
      y = jnp.tanh(nn.Dense(x.shape[-1])(x)) * inputs.scale
      return y if deterministic else nn.Dropout(0.5)(y, deterministic=False)

  class Stack(nn.Module):
    cfg: model_lib.ModelConfig

    @nn.compact
    def __call__(self, x, deterministic):
      return encoder.run_blocks(self.cfg, Block, x, deterministic,
                                lambda layer: Inputs(jnp.float32(2.0 + layer)))

  x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, 8)), jnp.float32)
  params = Stack(_cfg()).init(jax.random.key(0), x, True)
  for deterministic in (True, False):
    def loss(p, remat):
      y = Stack(_cfg(remat=remat)).apply(p, x, deterministic, rngs={'dropout': jax.random.key(1)})
      return jnp.sum(y ** 2)
    want, want_grads = jax.value_and_grad(loss)(params, 'none')
    for remat in ('full', 'dots'):
      got, got_grads = jax.value_and_grad(loss)(params, remat)
      assert float(got) == pytest.approx(float(want), rel=1e-6)
      jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                             got_grads, want_grads)


def test_drop_tokens_keeps_masked_tokens_cls_and_order_and_drops_padding_first():
  batch = {k: jnp.asarray(v) for k, v in _batch().items()}
  out = model_lib.drop_tokens(batch, 0.5, jax.random.key(0))
  keep = T - round(0.5 * (T - P))
  assert out['input_ids'].shape == (B, keep)
  positions = np.asarray(out['positions'])
  assert (np.diff(positions, axis=1) > 0).all() and (positions[:, 0] == 0).all()
  np.testing.assert_array_equal(
      np.take_along_axis(np.asarray(out['input_ids']), np.asarray(out['masked_positions']), 1),
      np.take_along_axis(np.asarray(batch['input_ids']), np.asarray(batch['masked_positions']), 1))
  np.testing.assert_array_equal(
      np.take_along_axis(positions, np.asarray(out['masked_positions']), 1),
      batch['masked_positions'])
  # Row 3 has 6 real tokens < keep: all of them stay, padding fills the rest.
  assert np.asarray(out['attention_mask'])[3].sum() == 6
  np.testing.assert_array_equal(positions[3, :6], np.arange(6))
  # Row 0 has no padding: keep tokens, every one real.
  assert np.asarray(out['attention_mask'])[0].sum() == keep


@pytest.mark.slow
def test_drop_token_training_steps_and_evaluation_sees_whole_rows():
  batch = _batch()
  cfg = _cfg(drop_token_rate=0.5)
  params = _params(cfg, batch)
  full = model_lib.BertForMLM(_cfg()).apply({'params': params}, batch)
  np.testing.assert_array_equal(model_lib.BertForMLM(cfg).apply({'params': params}, batch), full)
  loss, grads = _loss_and_grads(cfg, params, batch)
  assert np.isfinite(float(loss))
  assert float(loss) != pytest.approx(float(_loss_and_grads(_cfg(), params, batch)[0]), abs=1e-6)


@pytest.mark.slow
def test_sentence_pair_head_adds_its_loss_and_accumulates_like_one_batch():
  batch = _batch()
  batch = {k: np.concatenate([v, v[::-1]]) for k, v in batch.items()}  # 8 rows
  cfg = _cfg(sentence_pair_head=True)
  model = model_lib.BertForMLM(cfg)
  tx = optimizer.make_optimizer(_train_config())
  schedule = optimizer.learning_rate_schedule(_train_config())
  state = state_lib.create_state(model, tx, jax.random.key(0), batch)
  assert 'sentence_pair' in state.params
  _, one = jax.jit(step_lib.make_train_step(schedule, 1, 0.5))(state, batch, jax.random.key(1))
  _, four = jax.jit(step_lib.make_train_step(schedule, 4, 0.5))(state, batch, jax.random.key(1))
  for k in ('loss', 'sentence_pair_loss', 'sentence_pair_accuracy', 'grad_norm'):
    assert float(one[k]) == pytest.approx(float(four[k]), rel=1e-5), k
  outputs = model.apply({'params': state.params}, batch, method='pretrain')
  assert outputs['sentence_pair_logits'].shape == (8, 2)
  ce = -jax.nn.log_softmax(outputs['sentence_pair_logits'])[np.arange(8),
                                                             batch['sentence_pair_labels']]
  assert float(one['sentence_pair_loss']) == pytest.approx(float(jnp.mean(ce)), rel=1e-5)


def test_checkpoint_meta_knows_the_layout_options():
  record = fields.shape_record(_cfg())
  checkpoint.check_meta(record, record, 'same')
  with pytest.raises(checkpoint.CheckpointMismatchError, match='scan_layers'):
    checkpoint.check_meta(record, fields.shape_record(_cfg(scan_layers=True)), 'other')
  # A record without the options that change the parameter tree is refused,
  # naming each one, rather than read as some default layout.
  layout = ('scan_layers', 'sentence_pair_head', 'variant')
  older = {k: v for k, v in record.items() if k not in layout}
  with pytest.raises(checkpoint.CheckpointMismatchError) as refused:
    checkpoint.check_meta(older, record, 'old')
  assert all(f'{name}: checkpoint None' in str(refused.value) for name in layout)


@pytest.mark.slow
def test_training_with_sop_whole_word_masking_and_droptoken_logs_pair_metrics_and_input_wait(
    prepared, tmp_path):
  config, _ = prepared
  config = config.copy_and_resolve_references()
  config.sentence_pair.task = 'sop'
  config.masking.mode = 'whole_word'
  config.model.drop_token_rate = 0.25
  config.train.num_steps = 4
  summary = run_training(config, str(tmp_path / 'run'))
  assert summary['step'] == 4
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if 'loss' in r]
  assert all(0 <= r['sentence_pair_accuracy'] <= 1 and r['sentence_pair_loss'] > 0
             for r in train)
  assert all(0 <= r['input_wait_fraction'] <= 1 for r in train)
  evals = [r for r in records if 'eval_loss' in r]
  assert 0 <= evals[-1]['eval_sentence_pair_accuracy'] <= 1
  assert os.path.isdir(tmp_path / 'run' / 'checkpoints' / '4')
