"""Weight averaging (the EMA kept in training, `average` of checkpoints) and StableAdamW."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax.config import fields
from mlm_jax.training import optimizer


def _train_section(**overrides) -> ml_collections.ConfigDict:
  from configs import base
  train = base.get_config().train
  train.update({'learning_rate': 0.1, 'warmup_steps': 0, 'num_steps': 100, 'schedule': 'wsd',
                'decay_fraction': 0.01, 'weight_decay': 0.1, 'grad_clip_norm': 0.0,
                'adam_eps': 1e-6, 'optimizer': 'stable_adamw', **overrides})
  return train


def _stable_adamw_reference(params, grads_seq, train):
  """StableAdamW written out in numpy, tensor by tensor (Wortsman et al., 2023)."""
  b1, b2, eps, lr, wd = (train.adam_b1, train.adam_b2, train.adam_eps, train.learning_rate,
                         train.weight_decay)
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, grads in enumerate(grads_seq, start=1):
    for k in p:
      g = np.array(grads[k], np.float64)
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
      rms = np.sqrt(np.mean(g * g / np.maximum(v_hat, eps * eps)))
      step_lr = lr / max(1.0, rms)
      decay = wd * p[k] if k == 'kernel' else 0.0  # Biases are not decayed.
      p[k] = p[k] - step_lr * (m_hat / (np.sqrt(v_hat) + eps) + decay)
  return p


def test_stable_adamw_matches_the_formula():
  rng = np.random.default_rng(0)
  params = {'kernel': rng.normal(size=(4, 3)).astype(np.float32),
            'bias': rng.normal(size=(3,)).astype(np.float32)}
  # A calm start, then a gradient far larger than Adam's estimate: the clip must act.
  grads_seq = [{k: (rng.normal(size=x.shape) * s).astype(np.float32) for k, x in params.items()}
               for s in (1.0, 1.0, 50.0, 1.0)]
  train = _train_section()
  tx = optimizer.make_optimizer(train)
  p, state = jax.tree_util.tree_map(jnp.asarray, params), tx.init(params)
  for grads in grads_seq:
    updates, state = tx.update(jax.tree_util.tree_map(jnp.asarray, grads), state, p)
    p = jax.tree_util.tree_map(lambda a, u: a + u, p, updates)
  expected = _stable_adamw_reference(params, grads_seq, train)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), expected[k], rtol=2e-5, atol=2e-6)
  # The clip changed something (else the test would not tell StableAdamW from AdamW).
  plain = optimizer.make_optimizer(_train_section(optimizer='adamw'))
  q, plain_state = jax.tree_util.tree_map(jnp.asarray, params), plain.init(params)
  for grads in grads_seq:
    updates, plain_state = plain.update(jax.tree_util.tree_map(jnp.asarray, grads),
                                        plain_state, q)
    q = jax.tree_util.tree_map(lambda a, u: a + u, q, updates)
  assert not np.allclose(np.asarray(q['kernel']), expected['kernel'], rtol=1e-3)


def test_bad_optimizer_and_ema_decay_are_one_line_errors():
  from configs import base
  from mlm_jax.config import train_checks
  from mlm_jax.errors import ConfigError
  for field, value, words in (('optimizer', 'lion', "'adamw' or 'stable_adamw'"),
                              ('ema_decay', 1.0, 'must be in [0, 1)')):
    train = base.get_config().train
    train[field] = value
    with pytest.raises(ConfigError, match=None) as error:
      train_checks.check_train(train)
    assert words in str(error.value) and '\n' not in str(error.value)


@pytest.fixture(scope='module')
def ema_run(prepared, tmp_path_factory):
  """A micro run of 8 steps keeping an EMA (decay 0.5), checkpoints at 4 and 8."""
  from tests.conftest import run_training
  config, _ = prepared
  config = config.copy_and_resolve_references()
  config.train.ema_decay = 0.5
  workdir = str(tmp_path_factory.mktemp('ema_run'))
  run_training(config, workdir)
  return config, workdir


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_ema_is_evaluated_checkpointed_and_exported(ema_run, tmp_path):
  from mlm_jax.training import checkpoint
  from mlm_jax.training import workdir as workdir_lib
  _, workdir = ema_run
  evals = [r for r in _metrics(workdir) if 'eval_loss' in r]
  assert [r['step'] for r in evals] == [4, 8]
  for record in evals:  # The average is evaluated beside the live weights, and differs.
    assert np.isfinite(record['eval_ema_loss']) and record['eval_ema_loss'] != record['eval_loss']
    assert 'eval_ema_mlm_accuracy' in record
  with open(os.path.join(workdir, 'summary.json')) as f:
    summary = json.load(f)
  assert summary['eval_ema_loss'] == evals[-1]['eval_ema_loss']
  assert summary['eval_ema_mask_accuracy'] == evals[-1]['eval_ema_mask_accuracy']
  directory = workdir_lib.checkpoint_dir(workdir)
  _, params, _ = checkpoint.restore_params(directory, 8)
  _, ema, _ = checkpoint.restore_params(directory, 8, 'ema_params')
  _, ema4, _ = checkpoint.restore_params(directory, 4, 'ema_params')
  assert jax.tree_util.tree_structure(ema) == jax.tree_util.tree_structure(params)
  changed = jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda a, b, c: not np.array_equal(a, b) and not np.array_equal(a, c), ema, params, ema4))
  assert all(changed)  # The average moved, and lags the weights.
  run = workdir_lib.export_hf(workdir, str(tmp_path / 'hf'), ema=True)
  assert run.step == 8
  transformers = pytest.importorskip('transformers')
  model, info = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / 'hf'),
                                                                  output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys']
  rows = run.tokenizer.vocab_size
  (embedding,) = [x for path, x in jax.tree_util.tree_flatten_with_path(ema)[0]
                  if "['token']['embedding']" in jax.tree_util.keystr(path)]
  exported = model.get_input_embeddings().weight.detach().numpy()
  np.testing.assert_array_equal(exported[:rows], embedding[:rows])  # The average, not params.
  ema_run_loaded = workdir_lib.load(workdir, ema=True)
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      np.array_equal, ema_run_loaded.params, ema)))


@pytest.mark.slow
def test_ema_survives_a_resume_bit_for_bit(ema_run, tmp_path):
  """The state a resumed run starts from holds exactly the average that was saved."""
  from mlm_jax.config import run_plan
  from mlm_jax.training import build as build_lib
  from mlm_jax.training import checkpoint
  from mlm_jax.runtime import sharding
  from mlm_jax.training import workdir as workdir_lib
  config, workdir = ema_run
  run = workdir_lib.load(workdir)
  resolved = run_plan.resolve(config, jax.device_count(), ()).config
  built = build_lib.build(resolved, run.model_cfg.vocab_size, sharding.make_mesh(1))
  checkpointer = checkpoint.Checkpointer(workdir_lib.checkpoint_dir(workdir), resolved.train)
  try:
    state, step = checkpointer.restore_latest(built.abstract_state, fields.shape_record(run.model_cfg))
  finally:
    checkpointer.close()
  _, saved, _ = checkpoint.restore_params(workdir_lib.checkpoint_dir(workdir), step, 'ema_params')
  assert step == 8
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda a, b: np.array_equal(np.asarray(a), b), state.ema_params, saved)))


@pytest.mark.slow
def test_average_of_two_checkpoints_is_their_mean_and_continues(ema_run, prepared, tmp_path):
  from mlm_jax.training import average
  from mlm_jax.training import checkpoint
  from mlm_jax.training import workdir as workdir_lib
  from tests.conftest import run_training
  config, workdir = ema_run
  out = str(tmp_path / 'averaged')
  result = average.average_checkpoints(workdir, [4, 8], out)
  assert result.step == 8 and [s for _, s in result.sources] == [4, 8]
  directory = workdir_lib.checkpoint_dir(workdir)
  (_, p4, _), (_, p8, _) = (checkpoint.restore_params(directory, s) for s in (4, 8))
  mean = workdir_lib.load(out).params
  for a, b, m in zip(*(jax.tree_util.tree_leaves(t) for t in (p4, p8, mean))):
    assert m.dtype == np.float32
    np.testing.assert_array_equal(m, (a.astype(np.float32) + b.astype(np.float32))
                                  / np.float32(2))
  # It exports as a run does, and a new run continues from it.
  assert workdir_lib.export_hf(out, str(tmp_path / 'hf')).step == 8
  follow = config.copy_and_resolve_references()
  follow.train.num_steps, follow.train.eval_every, follow.train.ema_decay = 2, 1000, 0.0
  follow.init.workdir = out
  follow.data.data_dir = str(tmp_path / 'data')  # Prepared with the averaged run's tokenizer.
  run_training(follow, str(tmp_path / 'continued'))
  losses = [r['loss'] for r in _metrics(str(tmp_path / 'continued')) if 'loss' in r]
  first_run = [r['loss'] for r in _metrics(workdir) if 'loss' in r]
  assert losses and losses[0] < first_run[0]  # It starts from trained weights, not afresh.
  with pytest.raises(average.ConfigError, match='already holds a run'):
    average.average_checkpoints(workdir, [4, 8], out)


@pytest.mark.slow
def test_runs_of_different_shapes_are_refused(ema_run, tmp_path):
  import shutil

  from mlm_jax.training import average
  from mlm_jax.training import checkpoint
  from mlm_jax.training import workdir as workdir_lib
  _, workdir = ema_run
  other = tmp_path / 'other'
  other.mkdir()
  for name in ('tokenizer.model', 'tokenizer'):
    src = os.path.join(workdir, name)
    if os.path.isdir(src):
      shutil.copytree(src, other / name)
    elif os.path.exists(src):
      shutil.copy(src, other / name)
  with open(os.path.join(workdir, 'config.json')) as f:
    saved = json.load(f)
  saved['model']['num_heads'] = 4   # Same arrays, another model: not one shape.
  (other / 'config.json').write_text(json.dumps(saved))
  run = workdir_lib.load(workdir)
  checkpoint.save_weights(workdir_lib.checkpoint_dir(str(other)), 8, run.params,
                          fields.shape_record(run.model_cfg) | {'num_heads': 4})
  with pytest.raises(average.ConfigError, match='another shape') as error:
    average.average_runs([workdir, str(other)], str(tmp_path / 'out'))
  assert 'num_heads: 2 vs 4' in str(error.value) and '\n' not in str(error.value)
  assert not (tmp_path / 'out').exists()
