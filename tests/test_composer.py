"""Composer training checkpoints of FlexBERT: interop/composer.py, training/composer_init.py and
config.init.composer (run_plan's resolve, the loop's start).

Each test writes a checkpoint in Composer's layout ({'state': {'model', 'optimizers',
'timestamp', 'integrations', ...}, 'rng': ...}) of a small ModernBertForMaskedLM under
FlexBERT's names, with StableAdamW's state as ModernBERT's optimizer (optimi's) keeps it.
A run from it takes its tokenizer from a ModernBERT-layout directory (init.hf_dir) whose
model is another (2 layers, 320 rows): only its tokenizer files are read.
"""

import collections
import datetime
import fractions
import json
import os
import random

import jax
import numpy as np
import optax
import pytest

from mlm_jax.errors import ConfigError
from tests.conftest import as_modern
from tests.conftest import micro_config
from tests.conftest import model_config
from tests.conftest import run_training
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


# ------------------------------------------------------- config.init.composer


@pytest.fixture(scope='module')
def source(tmp_path_factory):
  """(the source ModernBertForMaskedLM, its Composer checkpoint, the moments written)."""
  hf_model = _hf_model(_transformers(), seed=4)
  path = tmp_path_factory.mktemp('composer') / 'ep0-ba7-rank0.pt'
  return hf_model, str(path), _write(path, hf_model, seed=5)


@pytest.fixture(scope='module')
def tokenizer_dir(tmp_path_factory) -> str:
  """A ModernBERT-layout directory whose tokenizer's V ids fit the checkpoint's table."""
  from tests import published
  return published.make_modernbert(str(tmp_path_factory.mktemp('tokenizer')),
                                   published.sample_texts(200), vocab_size=V)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp('data') / 'flex')


def _config(corpus_glob: str, data_dir: str, path: str, tokenizer_dir: str):
  """A micro run from the checkpoint at `path`, StableAdamW as the file's, 3 steps after it."""
  config = as_modern(micro_config(corpus_glob, data_dir))
  config.init.composer, config.init.hf_dir = path, tokenizer_dir
  config.train.update({'optimizer': 'stable_adamw', 'learning_rate': LR, 'num_steps': STEP + 3,
                       'adam_b1': BETAS[0], 'adam_b2': BETAS[1], 'adam_eps': EPS,
                       'weight_decay': WD / LR, 'grad_clip_norm': 0.0, 'warmup_steps': 0,
                       'concurrent_chains': 1})
  return config


def _refused(config, match: str, overrides=()) -> str:
  from mlm_jax.config import run_plan
  with pytest.raises(ConfigError, match=match) as raised:
    run_plan.resolve(config, 8, overrides)
  assert '\n' not in str(raised.value), str(raised.value)
  return str(raised.value)


def test_the_model_comes_from_the_file_and_only_the_tokenizer_from_hf_dir(
    source, tokenizer_dir, corpus_glob, data_dir, tmp_path):
  from mlm_jax.config import run_plan
  _, path, _ = source
  config = _config(corpus_glob, data_dir, path, tokenizer_dir)
  resolved = run_plan.resolve(config, 8).config
  model = resolved.model
  assert (model.variant, model.vocab_size, model.num_layers, model.hidden_size, model.num_heads,
          model.intermediate_size, model.max_position_embeddings) == ('modern', V, 3, 64, 4, 96, T)
  assert (model.local_attention, model.global_attn_every_n_layers, model.global_rope_theta,
          model.local_rope_theta) == (8, 2, 1000.0, 50.0)
  assert resolved.tokenizer.model_file == os.path.join(tokenizer_dir, 'tokenizer.json')
  # The tokenizer file named instead of a directory: the same run.
  config.init.hf_dir, config.tokenizer.model_file = '', resolved.tokenizer.model_file
  assert run_plan.resolve(config, 8).config.model.to_dict() == model.to_dict()
  # What the file decides is not overridden; what it suggests is.
  config.model.num_layers, config.model.global_rope_theta = 2, 160_000.0
  _refused(config, r'config.model.num_layers=2 contradicts the checkpoint in .*ep0-ba7',
           ['model.num_layers'])
  assert run_plan.resolve(config, 8, ['model.global_rope_theta']).config.model.global_rope_theta \
      == 160_000.0
  config = _config(corpus_glob, data_dir, path, tokenizer_dir)
  config.init.workdir = str(tmp_path)
  _refused(config, 'config.init.composer=.* and config.init.workdir=.* are both set')
  config = _config(corpus_glob, data_dir, path, '')
  _refused(config, r'holds no tokenizer: .*--config.init.hf_dir=answerdotai/ModernBERT-base .*'
           'tokenizer.json as --config.tokenizer.model_file')
  config = _config(corpus_glob, data_dir, str(tmp_path / 'no' / 'ep0-ba7-rank0.pt'),
                   tokenizer_dir)
  _refused(config, 'ep0-ba7-rank0.pt.: no such file, nor a bucket URL')
  # The run goes on from the file's step: its steps must reach past it.
  config = _config(corpus_glob, data_dir, path, tokenizer_dir)
  config.train.num_steps = STEP
  _refused(config, rf"stands at step {STEP}, .*num_steps={STEP} \(it counts the file's steps")


def test_a_broken_or_unsafe_file_is_one_line_through_the_config(source, tokenizer_dir,
                                                                corpus_glob, data_dir, tmp_path):
  hf_model, path, _ = source
  _write(tmp_path / 'evil.pt', hf_model, callbacks={'Custom': fractions.Fraction(1, 3)})
  with open(path, 'rb') as f:
    data = f.read()
  (tmp_path / 'cut.pt').write_bytes(data[:len(data) // 3])
  for name, words in (('evil.pt', 'holds fractions.Fraction, which loading would construct'),
                      ('cut.pt', 'is truncated or corrupt')):
    message = _refused(_config(corpus_glob, data_dir, str(tmp_path / name), tokenizer_dir),
                       words)
    assert message.startswith('config.init.composer=') and name in message, message


def test_a_hub_file_is_read_from_the_cache_offline_and_pinned(source, tokenizer_dir,
                                                              corpus_glob, data_dir, tmp_path,
                                                              monkeypatch):
  """org/name[@revision]/path through the Hugging Face cache, recorded at its commit; not
  cached while offline: one line naming the download."""
  import shutil
  from mlm_jax.config import run_plan
  from mlm_jax.interop import composer
  from tests.test_continue import _offline_cache
  from tests.test_continue import as_hub_cache
  _offline_cache(monkeypatch, str(tmp_path / 'hf'))
  os.makedirs(tmp_path / 'repo' / 'pre-decay')
  shutil.copy(source[1], tmp_path / 'repo' / 'pre-decay' / 'ep0-ba7-rank0.pt')
  revision = as_hub_cache(str(tmp_path / 'hf'), 'example-org/flex-checkpoints',
                          str(tmp_path / 'repo'))
  model_revision = as_hub_cache(str(tmp_path / 'hf'), 'example-org/modernbert-mini',
                                tokenizer_dir, revision='e5f6a7b8' * 5)
  name = 'example-org/flex-checkpoints/pre-decay/ep0-ba7-rank0.pt'
  pinned = f'example-org/flex-checkpoints@{revision}/pre-decay/ep0-ba7-rank0.pt'
  for given in (name, pinned):
    resolved = run_plan.resolve(_config(corpus_glob, data_dir, given,
                                        'example-org/modernbert-mini'), 8).config
    assert resolved.init.composer == pinned and resolved.model.num_layers == 3
    # The model's id supplies the tokenizer, recorded at its commit too.
    assert resolved.init.hf_dir == f'example-org/modernbert-mini@{model_revision}'
    assert resolved.tokenizer.model_file.startswith(str(tmp_path / 'hf' / 'hub'))
  local = composer.local_file(name, 'config.init.composer').local_path
  assert local.startswith(str(tmp_path / 'hf' / 'hub')) and os.path.isfile(local)
  assert composer.local_file(source[1], 'config.init.composer').local_path == source[1]
  _refused(_config(corpus_glob, data_dir, 'example-org/absent@v1/ep0-ba7-rank0.pt',
                   tokenizer_dir),
           r'not in the Hugging Face cache .*`hf download example-org/absent ep0-ba7-rank0.pt '
           r'--revision v1`')


def test_a_bucket_url_is_copied_into_the_cache_once(source, tmp_path, monkeypatch):
  """gs://... through data/paths.py (here a stand-in for the bucket), into CACHE/remote/."""
  from mlm_jax.data import paths
  from mlm_jax.interop import composer
  _, path, _ = source
  opened = []

  def open_binary(url: str):
    opened.append(url)
    return open(path, 'rb')
  monkeypatch.setenv('MLM_JAX_CACHE', str(tmp_path / 'cache'))
  monkeypatch.setattr(paths, 'size', lambda url: os.path.getsize(path))
  monkeypatch.setattr(paths, 'open_binary', open_binary)
  url = 'gs://bucket/run/ep0-ba7-rank0.pt'
  local = [composer.local_file(url, 'config.init.composer').local_path for _ in range(2)]
  assert opened == [url] and local[0] == local[1]
  assert local[0].startswith(str(tmp_path / 'cache' / 'remote'))
  with open(local[0], 'rb') as a, open(path, 'rb') as b:
    assert a.read() == b.read()
  assert composer.read(url, 'config.init.composer').step == STEP


def _adam_state(opt_state) -> optax.ScaleByAdamState:
  (adam,) = [s for s in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
  return adam


def test_a_run_starts_at_the_files_weights_moments_and_step(source, tokenizer_dir, corpus_glob,
                                                            data_dir, tmp_path, caplog):
  """The state the loop trains from: the source model's logits, the file's moments on their
  parameters (converted to optax's terms), its step in the state and the schedule's count."""
  from mlm_jax.config import run_plan
  from mlm_jax.training import checkpoint
  from mlm_jax.training import loop
  hf_model, path, moments = source
  workdir = str(tmp_path / 'run')
  run = run_plan.resolve(_config(corpus_glob, data_dir, path, tokenizer_dir),
                         jax.device_count(), (), workdir)
  phase = run.plan.phases[0]
  data, _, _, built = loop._build(run.config, run.plan, phase)  # pylint: disable=protected-access
  checkpointer = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), run.config.train)
  try:
    with caplog.at_level('INFO'):
      state, start, restored = loop._resume(  # pylint: disable=protected-access
          built, checkpointer, run.config, data, run.plan, phase)
  finally:
    checkpointer.close()
  assert (start, int(state.step), restored) == (STEP, STEP, False)
  # One line says what was carried; the config's linear schedule over 10 steps is at 3/10 of
  # its peak there, the file's run at its own last rate.
  (line,) = [r.getMessage() for r in caplog.records if 'Composer checkpoint' in r.getMessage()]
  assert line.endswith(f"at step {STEP}: its weights; StableAdamW's moments at its step {STEP}; "
                       f"learning rate at step {STEP}: the file's last {LR:.3g}, the config's "
                       f'schedule {LR * 0.3:.3g}'), line
  assert not [r for r in caplog.records if 'continue under' in r.getMessage()]  # Its betas.
  batch = _batch(7)
  ours, theirs = _logits(built.model_cfg, state.params, batch), _hf_logits(hf_model, batch)
  diff = _max_diff_at_real_tokens(ours, theirs, batch)
  print(f'Composer -> run start: max |ours - HF| = {diff:.2e}')
  assert diff <= 1e-5
  adam = _adam_state(state.opt_state)
  assert int(adam.count) == STEP
  m, v = moments['model.layers.1.attn.Wqkv.weight']
  qkv = adam.mu['encoder']['layer_1']['attention']['qkv']['kernel'], adam.nu['encoder'][
      'layer_1']['attention']['qkv']['kernel']  # [d, 3, N, H] here, [3*N*H, d] there.
  for ours, theirs, beta in zip(qkv, (m, v), BETAS):
    np.testing.assert_allclose(np.asarray(ours), (theirs * (1 - beta ** STEP)).T.reshape(
        64, 3, 4, 16), rtol=1e-6)
  m, _ = moments['model.embeddings.tok_embeddings.weight']
  table = np.asarray(adam.mu['encoder']['embeddings']['token']['embedding'])
  np.testing.assert_allclose(table[:V], m * (1 - BETAS[0] ** STEP), rtol=1e-6)
  assert not table[V:].any()  # Padding rows: no moments.
  counts = [s.count for s in jax.tree_util.tree_leaves(
      state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
            if isinstance(s, optax.ScaleByScheduleState)]
  assert counts and all(int(c) == STEP for c in counts)


@pytest.mark.slow
def test_a_decay_phase_goes_on_from_the_files_step(source, tokenizer_dir, corpus_glob, data_dir,
                                                   tmp_path):
  """config.phases whose decay starts at the file's step (the phase before it: the steps the
  file holds): the run trains only the decay, from its peak, and a second start resumes."""
  from mlm_jax.training import checkpoint
  from mlm_jax.training import metrics
  _, path, _ = source
  config = _config(corpus_glob, data_dir, path, tokenizer_dir)
  config.train.update({'log_every': 1, 'eval_every': 2, 'checkpoint_every': 2})
  config.phases = (
      dict(name='published', steps=STEP, overrides=dict(train=dict(schedule='constant'))),
      dict(name='decay', steps=2, overrides=dict(train=dict(
          schedule='decay', decay_shape='1-sqrt', final_lr_ratio=0.001))))
  workdir = str(tmp_path / 'run')
  summary = run_training(config, workdir)
  rates = metrics.read_metrics(workdir)['learning_rate']
  assert sorted(rates) == [STEP + 1, STEP + 2]
  assert rates[STEP + 1] == pytest.approx(LR)  # The decay's peak at its first step,
  assert rates[STEP + 2] == pytest.approx(LR * (0.001 + 0.999 * (1 - np.sqrt(0.5))))  # then 1-sqrt.
  assert checkpoint.latest_step(os.path.join(workdir, 'checkpoints')) == STEP + 2
  assert summary['step'] == STEP + 2
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['init']['composer'] == path
