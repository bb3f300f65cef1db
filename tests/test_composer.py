"""Composer training checkpoints of FlexBERT: interop/composer.py and training/composer_init.py.

Each test writes a checkpoint in Composer's layout ({'state': {'model', 'optimizers',
'timestamp', 'integrations', ...}, 'rng': ...}) of a small ModernBertForMaskedLM under
FlexBERT's names, with StableAdamW's state as ModernBERT's optimizer (optimi's) keeps it.
"""

import collections
import datetime
import fractions
import random

import jax
import numpy as np
import optax
import pytest

from tests.conftest import model_config
from tests.test_modern import T
from tests.test_modern import V
from tests.test_modern import _batch
from tests.test_modern import _hf_logits
from tests.test_modern import _hf_model
from tests.test_modern import _max_diff_at_real_tokens
from tests.test_modern import _transformers

# The FlexBertConfig of test_modern's model (ModernBERT's yaml settings, a small shape).
FLEX_CONFIG = {
    'model_type': 'bert', 'vocab_size': V, 'hidden_size': 64, 'num_hidden_layers': 3,
    'num_attention_heads': 4, 'intermediate_size': 96, 'max_position_embeddings': T,
    'bert_layer': 'prenorm', 'mlp_layer': 'glu', 'attention_layer': 'rope',
    'embedding_layer': 'sans_pos', 'normalization': 'layernorm',
    'norm_kwargs': {'eps': 1e-5, 'bias': False}, 'embed_norm': True, 'final_norm': True,
    'skip_first_prenorm': True, 'head_pred_act': 'gelu', 'hidden_act': 'gelu',
    'sliding_window': 8, 'global_attn_every_n_layers': 2, 'rotary_emb_base': 1000.0,
    'local_attn_rotary_emb_base': 50.0, 'init_std': 0.02, 'padding': 'unpadded',
    'compile_model': True, 'allow_embedding_resizing': True,
}
STEP, LR, MAX_LR, WD = 7, 3e-4, 8e-4, 1e-5
BETAS, EPS = (0.9, 0.98), 1e-6


def _flex(hf_name: str) -> str:
  """ModernBertForMaskedLM's name -> FlexBertForMaskedLM's under Composer's 'model.'."""
  if hf_name.startswith('model.layers.'):
    return 'model.bert.encoder.layers.' + hf_name[len('model.layers.'):]
  if hf_name.startswith('model.'):
    return 'model.bert.' + hf_name[len('model.'):]
  return 'model.' + hf_name


def _write(path, hf_model, layout: str = 'names', seed: int = 0, **state_extra):
  """A Composer checkpoint of `hf_model` after STEP steps of ModernBERT's StableAdamW; returns
  {HF name: (exp_avg, exp_avg_sq)} of the moments written (bias-corrected, as optimi's)."""
  import torch
  weights = hf_model.state_dict()
  model = collections.OrderedDict((_flex(k), v) for k, v in weights.items())
  assert model['model.decoder.weight'].data_ptr() == (
      model['model.bert.embeddings.tok_embeddings.weight'].data_ptr())  # Tied, stored once.
  names = [k for k in weights if k != 'decoder.weight']
  undecayed = [_flex(k) for k in names if weights[k].ndim <= 1 or k.endswith('.bias')]
  decayed = [_flex(k) for k in names if _flex(k) not in undecayed]
  rng = np.random.default_rng(seed)
  moments, per_param = {}, {}
  for k in names:
    m = torch.tensor(rng.normal(0, 0.01, weights[k].shape), dtype=torch.float32)
    v = torch.tensor(rng.uniform(0.5e-2, 2e-2, weights[k].shape), dtype=torch.float32)
    moments[k] = (m.numpy(), v.numpy())
    per_param[_flex(k)] = {'exp_avg': m, 'exp_avg_sq': v, 'eps_sq': torch.tensor(EPS ** 2),
                           'kahan_comp': None}
  group = {'lr': LR, 'beta1': BETAS[0], 'beta2': BETAS[1], 'eps': EPS, 'decouple_lr': True,
           'max_lr': MAX_LR, 'kahan_sum': False, 'foreach': True, 'gradient_release': False,
           'setup': True, 'step': torch.tensor(STEP, dtype=torch.int32)}
  groups = [dict(group, weight_decay=0.0, params=undecayed),
            dict(group, weight_decay=WD, params=decayed)]
  if layout == 'indices':  # Optimizer.state_dict(): a run without a process group.
    index = {n: i for i, n in enumerate(undecayed + decayed)}
    per_param = {index[n]: s for n, s in per_param.items()}
    groups = [dict(g, params=[index[n] for n in g['params']]) for g in groups]
  wct = datetime.timedelta(seconds=93.5)
  state = {
      'model': model,
      'optimizers': {'StableAdamW': {'state': per_param, 'param_groups': groups}},
      'schedulers': {'LambdaLR': {'base_lrs': [MAX_LR, MAX_LR], 'last_epoch': STEP,
                                  '_last_lr': [LR, LR], 'lr_lambdas': [None, None]}},
      'algorithms': [], 'callbacks': {'SpeedMonitor': {'total_eval_wct': 0.0}},
      'timestamp': {'Timestamp': {'iteration': 0, 'epoch': 0, 'batch': STEP, 'sample': 8 * STEP,
                                  'token': 8 * T * STEP, 'epoch_in_iteration': 0,
                                  'token_in_iteration': 8 * T * STEP, 'batch_in_epoch': STEP,
                                  'sample_in_epoch': 8 * STEP, 'token_in_epoch': 8 * T * STEP,
                                  'total_wct': wct, 'iteration_wct': wct, 'epoch_wct': wct,
                                  'batch_wct': datetime.timedelta(seconds=0.4)}},
      'rank_zero_seed': 17,
      'train_metrics': {'LanguageCrossEntropy': {'state_dict': collections.OrderedDict(
          sum_loss=torch.tensor(3.2), total_items=torch.tensor(64)), '_computed': None}},
      'eval_metrics': {}, 'run_name': 'flexbert-test', 'dataset_state': {'train': None},
      'integrations': {'huggingface': {'model': {'config': {
          'file_extension': '.json', 'content': FLEX_CONFIG,
          'class': 'src.bert_layers.model.FlexBertForMaskedLM'}}, 'tokenizer': {}}},
      'metadata': {'torch_version': torch.__version__, 'device': 'gpu', 'world_size': 8,
                   'precision': 'amp_bf16', 'device_train_microbatch_size': 8},
      **state_extra,
  }
  rng_state = [{'rank': 0, 'python': random.getstate(), 'numpy': np.random.get_state(),
                'torch': torch.get_rng_state()}]
  torch.save({'state': state, 'rng': rng_state}, path)
  return moments


def _logits(cfg, params, batch) -> np.ndarray:
  """Our logits [B, P, V] over the real vocabulary (one compiled program)."""
  from mlm_jax import model as model_lib
  apply = jax.jit(lambda p, b: model_lib.mlm_model(cfg).apply({'params': p}, b,
                                                              deterministic=True))
  return np.asarray(apply(params, batch))[..., :cfg.vocab_size]


def _model_cfg(fields: dict):
  shape = {k: v for k, v in fields.items() if k != 'vocab_size'}
  return model_config(vocab_size=fields['vocab_size'], padded_vocab_size=384,
                      dropout_rate=0.0, attention_dropout_rate=0.0, **shape)


def test_a_composer_checkpoint_gives_the_source_models_logits(tmp_path):
  from mlm_jax.interop import composer
  hf_model = _hf_model(_transformers())
  _write(tmp_path / 'ep0-ba7-rank0.pt', hf_model)
  ckpt = composer.load(str(tmp_path / 'ep0-ba7-rank0.pt'))
  assert ckpt.step == STEP and ckpt.optimizer_step == STEP and ckpt.learning_rate == LR
  assert ckpt.hyper == {'beta1': BETAS[0], 'beta2': BETAS[1], 'eps': EPS, 'weight_decay': WD,
                        'max_lr': MAX_LR}
  assert ckpt.model_fields == {
      'variant': 'modern', 'vocab_size': V, 'num_layers': 3, 'hidden_size': 64, 'num_heads': 4,
      'intermediate_size': 96, 'max_position_embeddings': T, 'layer_norm_eps': 1e-5,
      'initializer_range': 0.02, 'global_attn_every_n_layers': 2, 'local_attention': 8,
      'global_rope_theta': 1000.0, 'local_rope_theta': 50.0}
  cfg = _model_cfg(ckpt.model_fields)
  batch = _batch(7)
  ours, theirs = _logits(cfg, ckpt.params(cfg), batch), _hf_logits(hf_model, batch)
  diff = _max_diff_at_real_tokens(ours, theirs, batch)
  print(f'Composer -> ours: max |ours - HF| = {diff:.2e} (logit scale {np.abs(theirs).max():.1f})')
  assert diff <= 1e-5


def _optimi_step(p, g, m, v, decayed: bool):
  """One step of ModernBERT's StableAdamW (src/optimizer.py, optimi) in float64, from STEP."""
  def debias_beta(beta, step):
    return (beta ** step - beta) / (beta ** step - 1)
  t = STEP + 1
  b1_comp, b2_hat = 1 - debias_beta(BETAS[0], t), debias_beta(BETAS[1], t)
  m = m + b1_comp * (g - m)
  v = b2_hat * v + (1 - b2_hat) * g * g
  rms = np.sqrt(np.mean(g * g / np.maximum(v, EPS ** 2)))
  lr = LR / max(1.0, rms)
  if decayed:
    p = p * (1 + (-lr / MAX_LR) * WD)
  return p - lr * m / (np.sqrt(v) + EPS), rms


@pytest.mark.parametrize('layout', ['names', 'indices'])
def test_stable_adamw_continues_where_the_checkpoint_left_it(layout, tmp_path):
  """The moments land on their parameters, converted to optax's terms: one update of ours from
  the continued state equals the source optimizer's next step, tensor by tensor."""
  from configs import base
  from mlm_jax.interop import composer
  from mlm_jax.interop import hf
  from mlm_jax.training import composer_init
  from mlm_jax.training import optimizer
  from mlm_jax.training import state as state_lib
  hf_model = _hf_model(_transformers(), seed=1)
  moments = _write(tmp_path / 'c.pt', hf_model, layout, seed=2)
  ckpt = composer.load(str(tmp_path / 'c.pt'))
  cfg = _model_cfg(ckpt.model_fields)
  train = base.get_config().train
  train.update({'optimizer': 'stable_adamw', 'learning_rate': LR, 'warmup_steps': 0,
                'schedule': 'constant', 'num_steps': 100, 'weight_decay': WD / MAX_LR,
                'adam_b1': BETAS[0], 'adam_b2': BETAS[1], 'adam_eps': EPS,
                'grad_clip_norm': 0.0})
  tx = optimizer.make_optimizer(train)
  fresh = jax.tree_util.tree_map(jax.numpy.zeros_like, ckpt.params(cfg))
  state = composer_init.initial_state(
      state_lib.TrainState.create(apply_fn=None, params=fresh, tx=tx), ckpt, cfg)
  assert int(state.step) == STEP
  # A moment read where it belongs: layer 1's fused qkv, [3*N*H, d] there, [d, 3, N, H] here.
  (adam,) = [s for s in jax.tree_util.tree_leaves(
      state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
  qkv = moments['model.layers.1.attn.Wqkv.weight'][0]
  mu = adam.mu['encoder']['layer_1']['attention']['qkv']['kernel']
  np.testing.assert_allclose(np.asarray(mu), (qkv * (1 - BETAS[0] ** STEP)).T.reshape(64, 3, 4, 16),
                             rtol=1e-6)
  assert int(adam.count) == STEP
  # One step: the same gradients in both layouts, small beside the moments (so no tensor's
  # update is clipped: our RMS over the vocabulary's tensors also counts their padding rows).
  rng = np.random.default_rng(3)
  weights = {k: v.detach().numpy().astype(np.float64) for k, v in hf_model.state_dict().items()
             if k != 'decoder.weight'}
  grads = {k: rng.normal(0, 0.01, w.shape) for k, w in weights.items()}
  updates, _ = jax.jit(tx.update)(  # One compiled program, not one per operation.
      hf.from_hf_state_dict({k: g.astype(np.float32) for k, g in grads.items()}, cfg),
      state.opt_state, state.params)
  ours = hf.to_hf_state_dict(optax.apply_updates(state.params, updates), cfg)
  for name, w in weights.items():
    m, v = (x.astype(np.float64) for x in moments[name])
    decayed = w.ndim > 1
    want, rms = _optimi_step(w, grads[name], m, v, decayed)
    assert rms < 1.0, name
    np.testing.assert_allclose(ours[name], want, rtol=2e-5, atol=1e-7, err_msg=name)


def test_disallowed_truncated_and_foreign_files_are_one_line(tmp_path):
  from mlm_jax.interop import composer
  import torch
  hf_model = _hf_model(_transformers())
  # A type whose loading would run code named in the file: refused before anything is built.
  _write(tmp_path / 'evil.pt', hf_model, callbacks={'Custom': fractions.Fraction(1, 3)})
  _write(tmp_path / 'good.pt', hf_model)
  data = (tmp_path / 'good.pt').read_bytes()
  (tmp_path / 'cut.pt').write_bytes(data[:len(data) // 2])
  torch.save(hf_model.state_dict(), tmp_path / 'weights.pt')
  for name, words in (('evil.pt', 'holds fractions.Fraction, which loading would construct'),
                      ('cut.pt', 'is truncated or corrupt'),
                      ('weights.pt', 'is not a Composer checkpoint')):
    with pytest.raises(ValueError, match=None) as raised:
      composer.load(str(tmp_path / name))
    message = str(raised.value)
    assert words in message and '\n' not in message and name in message, message
  with pytest.raises(FileNotFoundError):
    composer.load(str(tmp_path / 'missing.pt'))
