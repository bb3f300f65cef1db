"""Variant 'modern' (ModernBERT): Hugging Face's numbers both ways, the shared step, BERT intact.

The Hugging Face comparisons need the interop extra (torch, transformers,
safetensors, tokenizers) and are skipped without it; the rest runs on its own.
"""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from configs import base
from configs import modern_base
from configs import modern_large
from configs import tiny
from mlm_jax.config import checks
from mlm_jax import model as model_lib
from mlm_jax.errors import ConfigError
from mlm_jax.data import sp_tokenizer
from mlm_jax.model import config as config_lib
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from tests.conftest import model_config

SPECIALS = sp_tokenizer.SPECIALS  # Ids 0-4: the layout of the tokenizers trained here.
V, T = 300, 32  # A vocabulary that is not a multiple of 128: the model has padding rows.
LENGTHS = (32, 9, 20, 27)  # Real tokens per row; [PAD] after.


def _cfg(**fields):
  """3 layers: 0 and 2 global, 1 local with a window of 4 tokens each side (< T)."""
  shape = dict(vocab_size=V, padded_vocab_size=384, num_layers=3, hidden_size=64, num_heads=4,
               intermediate_size=96, max_position_embeddings=T, variant='modern',
               global_attn_every_n_layers=2, local_attention=8, global_rope_theta=1000.0,
               local_rope_theta=50.0, layer_norm_eps=1e-5, dropout_rate=0.0,
               attention_dropout_rate=0.0)
  return model_config(**(shape | fields))


def _batch(seed: int = 0, p: int = T) -> dict[str, np.ndarray]:
  """Rows of LENGTHS real tokens; p = T gathers every position (the encoder's whole output)."""
  rng = np.random.default_rng(seed)
  mask = (np.arange(T)[None] < np.array(LENGTHS)[:, None]).astype(np.int32)
  ids = np.where(mask > 0, rng.integers(5, V, mask.shape), SPECIALS.pad).astype(np.int32)
  if p == T:
    positions = np.tile(np.arange(T, dtype=np.int32), (len(LENGTHS), 1))
  else:
    positions = np.stack([np.sort(rng.choice(np.arange(1, n), p, replace=False)) for n in LENGTHS])
  return {'input_ids': ids, 'attention_mask': mask, 'segment_ids': np.zeros_like(ids),
          'masked_positions': positions.astype(np.int32),
          'masked_ids': rng.integers(5, V, positions.shape).astype(np.int32),
          'masked_weights': np.ones(positions.shape, np.float32),
          'masked_kinds': np.ones(positions.shape, np.int32)}


def _logits(cfg, params, batch) -> np.ndarray:
  """Our logits [B, P, V] over the real vocabulary."""
  out = model_lib.mlm_model(cfg).apply({'params': params}, batch, deterministic=True)
  return np.asarray(out)[..., :cfg.vocab_size]


def _random_params(cfg, seed: int = 0):
  """Initialised params with every leaf perturbed, so that no tensor is trivially 0 or 1."""
  params = nn.unbox(model_lib.mlm_model(cfg).init(jax.random.key(seed), _batch())['params'])
  leaves, tree = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_unflatten(
      tree, [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32) for x in leaves])


# ------------------------------------------------------------------ configs


def test_configs_check_and_have_the_published_shapes():
  for module, shape in ((modern_base, (22, 768, 12, 1152)), (modern_large, (28, 1024, 16, 2624))):
    config = module.get_config()
    config_lib.check_config(config.model)
    m = config.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size) == shape
    assert (m.variant, m.local_attention, m.global_attn_every_n_layers) == ('modern', 128, 3)
    assert (m.global_rope_theta, m.local_rope_theta, m.max_position_embeddings) == (
        160_000.0, 10_000.0, 8192)
    assert (m.dropout_rate, m.attention_dropout_rate, m.layer_norm_eps) == (0.0, 0.0, 1e-5)
    assert config.tokenizer.vocab_size == 50368
  checks.validate(tiny.get_config(), num_devices=1, check_paths=False)
  assert base.get_config().model.variant == 'bert'


@pytest.mark.parametrize('fields, message', [
    ({'variant': 'gpt2'}, r"use 'bert', 'roberta' or 'modern'"),
    ({'scan_layers': True}, 'scan_layers=True'),
    ({'local_attention': 7}, 'positive even'),
    ({'global_attn_every_n_layers': 0}, 'at least 1'),
    ({'hidden_size': 96, 'num_heads': 32}, 'head size must be even'),  # Head size 3.
])
def test_invalid_modern_fields_are_named(fields, message):
  model = tiny.get_config().model
  model.update(fields)
  with pytest.raises(ConfigError, match=message):
    config_lib.check_config(model)


# ------------------------------------------------------------------ model


@pytest.mark.slow
def test_bert_parameter_tree_is_unchanged():
  cfg = model_config(vocab_size=V, padded_vocab_size=384, num_layers=1, hidden_size=64,
                     num_heads=4, intermediate_size=96, max_position_embeddings=T)
  assert type(model_lib.mlm_model(cfg)) is model_lib.BertForMLM
  params = nn.unbox(model_lib.mlm_model(cfg).init(jax.random.key(0), _batch())['params'])
  shapes = {'/'.join(k.key for k in path): x.shape
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  dense = lambda name, shape_in, shape_out: {f'{name}/kernel': (*shape_in, *shape_out),
                                             f'{name}/bias': shape_out}
  norm = lambda name: {f'{name}/scale': (64,), f'{name}/bias': (64,)}
  layer = 'encoder/layer_0'
  assert shapes == {
      'encoder/embeddings/token/embedding': (384, 64),
      'encoder/embeddings/position/embedding': (T, 64),
      'encoder/embeddings/segment/embedding': (2, 64),
      **norm('encoder/embeddings/layer_norm'),
      **{k: v for name in ('query', 'key', 'value')
         for k, v in dense(f'{layer}/attention/{name}', (64,), (4, 16)).items()},
      **dense(f'{layer}/attention/out', (4, 16), (64,)),
      **norm(f'{layer}/attention_layer_norm'),
      **dense(f'{layer}/intermediate', (64,), (96,)),
      **dense(f'{layer}/output', (96,), (64,)),
      **norm(f'{layer}/output_layer_norm'),
      **dense('mlm_head/transform', (64,), (64,)),
      **norm('mlm_head/layer_norm'),
      'mlm_head/output_bias': (384,),
  }


def test_modern_parameters_have_no_biases_and_fsdp_splits_every_matrix():
  # Shapes and axis names only: eval_shape computes no parameter.
  boxed = jax.eval_shape(model_lib.mlm_model(_cfg()).init, jax.random.key(0), _batch())['params']
  axes = jax.tree_util.tree_map(lambda x: x.names, boxed,
                                is_leaf=lambda x: isinstance(x, nn.Partitioned))
  names = jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))
  paths = {'/'.join(k.key for k in path): axes for path, axes in names}
  assert [p for p in paths if p.endswith('bias')] == ['mlm_head/output_bias']
  assert 'encoder/layer_0/attention_norm/scale' not in paths  # As Hugging Face's Identity.
  assert 'encoder/layer_1/attention_norm/scale' in paths
  matrices = {p: axes for p, axes in paths.items() if p.endswith(('kernel', 'embedding'))}
  assert len(matrices) == 1 + 3 * 4 + 1
  assert all('embed' in axes for axes in matrices.values()), matrices  # The axis fsdp splits.


@pytest.mark.slow
def test_kernels_and_remat_give_the_same_logits():
  # At real tokens: a padding query sees no key, and what a kernel makes of
  # it (read by no real token) differs from kernel to kernel.
  params, batch = _random_params(_cfg()), _batch(1)
  real = batch['attention_mask'][..., None] > 0
  ours = _logits(_cfg(), params, batch)   # 'auto': the local layer banded ('blocked').
  for options in (dict(attention='jax_xla'), dict(attention='dense'), dict(remat='full'),
                  dict(remat='dots')):
    np.testing.assert_allclose(np.where(real, _logits(_cfg(**options), params, batch), 0),
                               np.where(real, ours, 0), atol=1e-5, err_msg=str(options))


@pytest.mark.slow
def test_modern_trains_through_the_shared_step_on_an_fsdp_mesh():
  config = tiny.get_config()
  config.data.seq_len, config.masking.max_predictions = T, 5
  m = config.model
  m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size = 3, 64, 4, 96
  m.max_position_embeddings, m.local_attention = T, 8
  # Dropout and DropToken on, to run every random path of the variant.
  m.dropout_rate, m.attention_dropout_rate, m.drop_token_rate = 0.1, 0.1, 0.1
  config.train.batch_size, config.train.warmup_steps, config.mesh.fsdp = 8, 1, 2
  mesh = sharding.make_mesh(fsdp=2)
  built = build_lib.build(config, V, mesh)
  assert built.model_cfg.variant == 'modern'
  state = built.init_state()
  wi = state.params['encoder']['layer_1']['mlp']['wi']['kernel']
  assert wi.addressable_shards[0].data.shape == (32, 192)  # [d / fsdp, 2 d_ff]
  batch = {k: v for k, v in _batch(2, p=5).items()}
  batch = {k: np.concatenate([v, v]) for k, v in batch.items()}  # 8 rows: one per device.
  losses = []
  for _ in range(6):
    state, metrics = built.train_step(state, sharding.to_global(batch, mesh), built.dropout_rng)
    losses.append(float(metrics['loss']))
  assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5, losses


def test_model_flops_count_the_geglu_mlp_and_the_local_windows():
  from flax import traverse_util
  from mlm_jax.model import flops
  cfg = _cfg()  # 3 blocks; block 1 attends locally to |i - j| <= 4: 9 keys of T.
  params = nn.unbox(model_lib.mlm_model(cfg).init(jax.random.key(0), _batch())['params'])
  block_weights = sum(x.size for path, x in traverse_util.flatten_dict(params['encoder']).items()
                      if path[-1] == 'kernel')
  assert block_weights == 3 * (4 * 64 * 64 + 3 * 64 * 96)  # q, k, v, out; GeGLU in (2F) and out.
  # The last block (global) computes its keys and values for every row, the
  # rest (q, out, GeGLU; 2·64·64 + 3·64·96 weights) for the 5 masked slots.
  last_rows = 2 * 64 * 64 + 3 * 64 * 96
  expected = (6 * (block_weights - last_rows * (1 - 5 / T)) + 12 * 64 * (T + 9 + T * 5 / T)
              + 6 * (64 * 64 + 64 * 384) * 5 / T)
  assert flops.model_flops_per_token(cfg, T, 5) == pytest.approx(expected, rel=1e-12)
  assert flops.model_flops_per_token(cfg, T, 5, last_block_rows=T) == pytest.approx(
      6 * block_weights + 12 * 64 * (T + 9 + T) + 6 * (64 * 64 + 64 * 384) * 5 / T, rel=1e-12)
  # BERT's count is unchanged: every block sees all T keys, two MLP matrices.
  bert = model_config(num_layers=3, hidden_size=64, num_heads=4, intermediate_size=96)
  assert flops.model_flops_per_token(bert, T, 5) == flops.flops_per_token(
      num_layers=3, hidden_size=64, intermediate_size=96, seq_len=T, vocab_size=384,
      max_predictions=5)


@pytest.mark.slow
def test_modern_learns_what_only_context_gives():
  """Rows of pairs (a, f(a)), f a fixed random bijection of K equally frequent symbols.

  At a slot that shows [MASK] only the token beside it tells the answer:
  copying the input gives nothing there and every symbol is as frequent as
  another. A few hundred CPU steps take the accuracy at [MASK] slots from the
  most frequent symbol's ~1/K to most of the way to the ceiling (a pair with
  both halves masked cannot be solved).
  """
  from ml_collections import ConfigDict
  from mlm_jax.data import masking
  from mlm_jax.training import objective
  from mlm_jax.training import optimizer
  from mlm_jax.training import state as state_lib
  from mlm_jax.training import step as step_lib
  k, t, b, steps = 16, 32, 32, 300
  first = max(SPECIALS.ids) + 1
  f = np.random.default_rng(0).permutation(k)
  rng = np.random.default_rng(1)

  def rows(n):
    a = rng.integers(0, k, (n, (t - 2) // 2))
    pairs = np.stack([a, f[a]], axis=-1).reshape(n, -1) + first
    cls, sep = np.full((n, 1), SPECIALS.cls), np.full((n, 1), SPECIALS.sep)
    return np.concatenate([cls, pairs, sep], axis=1).astype(np.int32)

  masking_config = ConfigDict(dict(max_predictions=6, select_rate=0.15, mask_prob=0.8,
                                   random_prob=0.1, random_source='unigram', mode='token',
                                   span_p=0.2, span_max_length=10))
  counts = np.zeros(first + k)
  counts[first:] = 1
  masker = masking.make_masker_for_ids(masking_config, first + k, counts, SPECIALS)

  def batch(step, seed=0):
    ids = rows(b)
    out = masker(ids, seed=seed, step=step, rows=np.arange(b))
    return {**out, 'attention_mask': np.ones_like(ids), 'segment_ids': np.zeros_like(ids)}

  cfg = model_config(vocab_size=first + k, padded_vocab_size=128, variant='modern',
                     num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
                     max_position_embeddings=t, global_attn_every_n_layers=2,
                     local_attention=8, layer_norm_eps=1e-5, dropout_rate=0.0,
                     attention_dropout_rate=0.0)
  train = ConfigDict(dict(learning_rate=3e-3, warmup_steps=30, num_steps=steps,
                          weight_decay=0.01, adam_b1=0.9, adam_b2=0.98, adam_eps=1e-6,
                          grad_clip_norm=1.0, schedule='linear', decay_fraction=0.2,
                          decay_shape='linear'))
  state = state_lib.create_state(model_lib.mlm_model(cfg), optimizer.make_optimizer(train),
                                jax.random.key(0), batch(0))
  train_step = jax.jit(step_lib.make_train_step(optimizer.learning_rate_schedule(train),
                                                baseline_token=first))
  for s in range(steps):
    state, _ = train_step(state, batch(s), jax.random.key(1))
  eval_step = jax.jit(step_lib.make_eval_step(baseline_token=first))
  sums = {}
  for s in range(8):
    for name, v in jax.device_get(eval_step(state, batch(s, seed=99))).items():
      sums[name] = sums.get(name, 0.0) + float(v)
  got = objective.slot_metrics(sums)
  assert got['mask_baseline_accuracy'] < 0.15, got
  assert got['mask_accuracy'] > 0.6 and got['context_ratio'] > 5, got


# ------------------------------------------------------- Hugging Face parity


def _transformers():
  for module in ('torch', 'safetensors', 'tokenizers'):
    pytest.importorskip(module)
  return pytest.importorskip('transformers')


def _hf_logits(hf_model, batch) -> np.ndarray:
  """Hugging Face's logits [B, T, V] gathered at batch['masked_positions']."""
  import torch
  with torch.no_grad():
    logits = hf_model(input_ids=torch.tensor(batch['input_ids'], dtype=torch.long),
                      attention_mask=torch.tensor(batch['attention_mask'])).logits.numpy()
  return np.take_along_axis(logits, batch['masked_positions'][..., None], axis=1)


def _max_diff_at_real_tokens(ours, theirs, batch) -> float:
  """Padding positions are left out: their outputs are never read (and a local
  layer may leave a padding query with no key at all)."""
  real = np.take_along_axis(batch['attention_mask'], batch['masked_positions'], axis=1) > 0
  return float(np.abs(ours - theirs)[real].max())


def _hf_model(transformers, seed: int = 0):
  """A ModernBertForMaskedLM of _cfg()'s shape, every tensor random (norms around 1)."""
  import torch
  torch.manual_seed(seed)
  c = _cfg()
  config = transformers.ModernBertConfig(
      vocab_size=V, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
      max_position_embeddings=T, local_attention=c.local_attention,
      global_attn_every_n_layers=c.global_attn_every_n_layers,
      global_rope_theta=c.global_rope_theta, local_rope_theta=c.local_rope_theta,
      pad_token_id=SPECIALS.pad, bos_token_id=SPECIALS.cls, cls_token_id=SPECIALS.cls,
      eos_token_id=SPECIALS.sep, sep_token_id=SPECIALS.sep, attn_implementation='eager')
  model = transformers.ModernBertForMaskedLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.randn_like(p) * 0.1 + (1.0 if 'norm' in name else 0.0))
  return model


@pytest.mark.slow
def test_fresh_parameters_are_drawn_as_hugging_face_draws_them():
  """Every tensor of a fresh model: HF's distribution (truncated normal, std by role; norms 1)."""
  _transformers()  # Skips without the interop extra.
  from mlm_jax.interop import layout
  from mlm_jax.interop import modernbert
  from mlm_jax.interop import torch_mlm
  from ml_collections import ConfigDict
  cfg = _cfg(hidden_size=128, intermediate_size=192, padded_vocab_size=V)
  config = ConfigDict({'seed': 0, 'train': dict(learning_rate=1e-3, adam_b1=0.9, adam_b2=0.98,
                                                 adam_eps=1e-6, weight_decay=0.01,
                                                 grad_clip_norm=1.0)})
  theirs = {n: p.detach().numpy() for n, p in
            torch_mlm.TorchMLM(config, cfg).eager_model.state_dict().items()}
  ours = nn.unbox(model_lib.mlm_model(cfg).init(jax.random.key(0), _batch())['params'])
  for tensor in modernbert.layout(cfg):
    a, b = np.asarray(layout.get_path(ours, tensor.path)), theirs[tensor.hf_name]
    assert a.size == b.size, tensor.hf_name
    # Truncated at two standard deviations in both: the same bound, the same spread.
    a, b = a.astype(np.float64), b.astype(np.float64)
    assert np.abs(a).max() == pytest.approx(np.abs(b).max(), rel=0.02, abs=1e-6), tensor.hf_name
    assert a.std() == pytest.approx(b.std(), rel=0.05, abs=1e-6), tensor.hf_name
    assert a.mean() == pytest.approx(b.mean(), abs=0.1 * max(b.std(), 1e-3)), tensor.hf_name


def test_imported_hf_model_gives_hf_logits(tmp_path):
  from mlm_jax.interop import hf
  hf_model = _hf_model(_transformers())
  hf_model.save_pretrained(tmp_path)
  cfg = hf.load_hf_config(str(tmp_path), base.get_config().model)
  assert cfg == _cfg()
  params = hf.load_hf_params(str(tmp_path), cfg)
  batch = _batch(3)
  ours, theirs = _logits(cfg, params, batch), _hf_logits(hf_model, batch)
  diff = _max_diff_at_real_tokens(ours, theirs, batch)
  print(f'HF -> ours: max |ours - HF| = {diff:.2e} (logit scale {np.abs(theirs).max():.1f})')
  assert diff <= 1e-5
  # The window matters: without it the local layer computes something else.
  wide = _logits(_cfg(local_attention=2 * T), params, batch)
  assert _max_diff_at_real_tokens(wide, theirs, batch) > 1e-2
  # ModernBertModel weights (no head) keep the head they are given.
  hf_model.model.save_pretrained(tmp_path / 'base_model')
  encoder_only = hf.load_hf_params(str(tmp_path / 'base_model'), cfg, fallback_params=params)
  for a, b in zip(jax.tree_util.tree_leaves(encoder_only), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="holds a 'modernbert' model"):
    hf.load_hf_params(str(tmp_path), model_config())


@pytest.mark.parametrize('attn_implementation', ['eager', 'sdpa'])
def test_export_loads_as_modernbert_with_our_logits_and_round_trips(attn_implementation, tmp_path):
  from mlm_jax.interop import hf
  transformers = _transformers()
  cfg, params = _cfg(), _random_params(_cfg(), seed=4)
  hf.save_model(str(tmp_path), params, cfg, SPECIALS)
  hf_model, info = transformers.AutoModelForMaskedLM.from_pretrained(
      tmp_path, attn_implementation=attn_implementation, output_loading_info=True)
  assert type(hf_model).__name__ == 'ModernBertForMaskedLM'
  assert not (info['missing_keys'] or info['unexpected_keys'] or info['mismatched_keys'])
  assert hf_model.config.layer_types == ['full_attention', 'sliding_attention', 'full_attention']
  assert hf_model.config.sliding_window == 4
  batch = _batch(5)
  ours, theirs = _logits(cfg, params, batch), _hf_logits(hf_model.eval(), batch)
  diff = _max_diff_at_real_tokens(ours, theirs, batch)
  print(f'ours -> HF ({attn_implementation}): max |ours - HF| = {diff:.2e} '
        f'(logit scale {np.abs(theirs).max():.1f})')
  assert diff <= 1e-5
  assert hf.load_hf_config(str(tmp_path), base.get_config().model) == cfg
  loaded = hf.load_hf_params(str(tmp_path), cfg)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree_util.tree_leaves(loaded)):
    rows = cfg.vocab_size if x.shape[0] == cfg.padded_vocab_size else x.shape[0]
    np.testing.assert_array_equal(y[:rows], x[:rows], err_msg=jax.tree_util.keystr(path))
    assert not y[rows:].any()  # Vocabulary padding comes back as zeros.


@pytest.fixture(scope='module')
def exported_run(tmp_path_factory, request):
  """A micro run of variant 'modern' (a local layer with a window < T), trained (conftest's
  shared run) and exported."""
  from mlm_jax.training import workdir as workdir_lib
  _transformers()
  workdir = request.getfixturevalue('modern_micro_run')   # Trained only where transformers is.
  out = str(tmp_path_factory.mktemp('modern_export'))
  return workdir_lib.export_hf(workdir, out), out


@pytest.mark.slow
def test_fill_mask_pipeline_loads_the_export_and_agrees_with_ours(exported_run):
  from mlm_jax.analysis import fill_mask
  transformers = _transformers()
  run, out = exported_run
  with open(os.path.join(out, 'config.json')) as f:
    assert json.load(f)['architectures'] == ['ModernBertForMaskedLM']
  model = transformers.AutoModelForMaskedLM.from_pretrained(out, attn_implementation='eager')
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert 'token_type_ids' not in tokenizer('a test')  # ModernBERT takes none.
  pipe = transformers.pipeline('fill-mask', model=model, tokenizer=tokenizer)
  text = 'The function returns a [MASK] of strings, and the [MASK] is sorted by the key.'
  theirs = pipe(text, top_k=5)
  ours = fill_mask.predict(run, [text], top_k=5)[0]
  assert len(theirs) == len(ours) == 2
  for their_mask, our_mask in zip(theirs, ours):
    assert [run.tokenizer.id_to_piece(r['token']) for r in their_mask] == [p for p, _ in our_mask]
    np.testing.assert_allclose([r['score'] for r in their_mask], [q for _, q in our_mask],
                               atol=1e-6)
