"""Model, loss and train step: properties a user relies on."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from mlm_jax import model as model_lib
from mlm_jax.runtime import platform_ops
from mlm_jax.runtime import sharding
from mlm_jax.training import objective
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib
from mlm_jax.training import step as step_lib
from tests.conftest import model_config

B, T, P, V = 16, 32, 6, 300


def _cfg(**overrides):
  fields = dict(vocab_size=V, padded_vocab_size=384, num_layers=2, hidden_size=32,
                num_heads=4, intermediate_size=48, max_position_embeddings=T,
                dropout_rate=0.1, attention_dropout_rate=0.1)
  fields.update(overrides)
  return model_config(**fields)


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, V, (B, T)).astype(np.int32)
  lengths = rng.integers(T // 2, T + 1, B)
  attention = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
  ids = np.where(attention > 0, ids, 0)
  positions = np.stack([np.sort(rng.choice(np.arange(1, n), P, replace=False)) for n in lengths])
  weights = np.ones((B, P), np.float32)
  weights[:, -2:] = 0  # Two padding slots per row.
  positions = np.where(weights > 0, positions, 0)
  return {'input_ids': ids, 'attention_mask': attention, 'segment_ids': np.zeros_like(ids),
          'masked_positions': positions.astype(np.int32),
          'masked_ids': np.where(weights > 0, rng.integers(5, V, (B, P)), 0).astype(np.int32),
          'masked_weights': weights,
          'masked_kinds': (weights > 0).astype(np.int32)}  # All [MASK] slots.


def _train_config(**overrides):
  c = ConfigDict(dict(learning_rate=1e-3, warmup_steps=2, num_steps=10, weight_decay=0.01,
                      adam_b1=0.9, adam_b2=0.999, adam_eps=1e-6, grad_clip_norm=1.0,
                      schedule='linear', decay_fraction=0.2, decay_shape='linear'))
  c.update(overrides)
  return c


def _state(cfg, batch):
  # The platform's forms of dense, dropout and GELU, as the builder gives them.
  model = model_lib.BertForMLM(cfg, platform_ops.for_platform(cfg.platform))
  tx = optimizer.make_optimizer(_train_config())
  return state_lib.create_state(model, tx, jax.random.key(0), batch)


@jax.jit   # Compiled once per shape, as a step runs: op by op it takes twice as long.
def _loss_and_grads(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({'params': params}, batch, deterministic=True)
    t = objective.mlm_loss_terms(logits, batch['masked_ids'], batch['masked_weights'])
    return t['loss_sum'] / t['weight_sum']
  return jax.value_and_grad(loss_fn)(state.params)


def test_logits_only_at_masked_slots_and_padded_vocab_never_predicted():
  batch = _batch()
  state = _state(_cfg(), batch)
  logits = state.apply_fn({'params': state.params}, batch)
  assert logits.shape == (B, P, 384)
  assert np.all(np.asarray(jnp.argmax(logits, -1)) < V)
  assert np.all(np.asarray(logits[..., V:]) < -1e8)


@pytest.mark.slow
def test_padding_slots_change_neither_loss_nor_gradients():
  batch = _batch()
  state = _state(_cfg(), batch)
  loss, grads = _loss_and_grads(state, batch)
  other = dict(batch)
  pad = batch['masked_weights'] == 0
  other['masked_positions'] = np.where(pad, 7, batch['masked_positions']).astype(np.int32)
  other['masked_ids'] = np.where(pad, 123, batch['masked_ids']).astype(np.int32)
  loss2, grads2 = _loss_and_grads(state, other)
  assert float(loss) == pytest.approx(float(loss2), rel=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_padding_keys_are_not_attended_to():
  batch = _batch()
  state = _state(_cfg(), batch)
  logits = state.apply_fn({'params': state.params}, batch)
  other = dict(batch)
  other['input_ids'] = np.where(batch['attention_mask'] > 0, batch['input_ids'], 77).astype(np.int32)
  logits2 = state.apply_fn({'params': state.params}, other)
  np.testing.assert_allclose(logits, logits2, rtol=1e-5, atol=1e-5)


def test_loss_is_divided_by_the_global_number_of_masked_tokens():
  logits = jax.random.normal(jax.random.key(1), (4, 3, 10))
  ids = jnp.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2]])
  w = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], jnp.float32)
  terms = objective.mlm_loss_terms(logits, ids, w)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids)
  assert float(terms['weight_sum']) == 6
  assert float(terms['loss_sum'] / terms['weight_sum']) == pytest.approx(
      float(jnp.sum(ce * w) / 6), rel=1e-6)


def _run_steps(devices, batches, cfg):
  mesh = sharding.make_mesh(devices=devices)
  state = _state(cfg, batches[0])
  repl = sharding.replicated(mesh)
  state = jax.device_put(state, repl)
  step = jax.jit(step_lib.make_train_step(optimizer.learning_rate_schedule(_train_config())),
                 in_shardings=(repl, sharding.batch_sharding(mesh), repl),
                 out_shardings=(repl, repl), donate_argnums=0)
  losses = []
  for batch in batches:
    state, metrics = step(state, sharding.to_global(batch, mesh), jax.random.key(5))
    losses.append(float(metrics['loss']))
  return losses, state


@pytest.mark.slow
def test_same_global_batch_same_loss_on_1_and_8_devices():
  assert jax.device_count() == 8
  batches = [_batch(s) for s in range(3)]
  cfg = _cfg(dropout_rate=0.0, attention_dropout_rate=0.0)
  losses1, state1 = _run_steps(jax.devices()[:1], batches, cfg)
  losses8, state8 = _run_steps(jax.devices(), batches, cfg)
  np.testing.assert_allclose(losses1, losses8, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(state1.params), jax.tree_util.tree_leaves(state8.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert losses8[-1] < losses8[0]


@pytest.mark.parametrize('variant', ['bert', 'modern'])
def test_every_matmul_of_the_backward_pass_contracts_one_axis(variant):
  # A Dense on [B, T, d] differentiated as is gives weight gradients that
  # contract B and T together; XLA:CPU then copies the output gradient
  # transposed and runs a slow matmul (the tiny step: 15% of its time).
  batch = _batch()
  state = _state(_cfg(variant=variant, intermediate_size=64), batch)
  jaxpr = jax.make_jaxpr(_loss_and_grads)(state, batch)

  def dots(eqns):
    for eqn in eqns:
      if eqn.primitive.name == 'dot_general':
        yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from dots(sub.eqns)

  found = list(dots(jaxpr.eqns))
  assert len(found) >= 3 * 6 * 2  # Forward and both gradients of each layer's six matmuls.
  for eqn in found:
    (lhs_contract, rhs_contract), _ = eqn.params['dimension_numbers']
    assert len(lhs_contract) == len(rhs_contract) == 1, eqn


def test_dropout_is_a_function_of_seed_and_step():
  # The step reports the loss of the parameters it was given, so with the
  # parameters and batch fixed only the dropout key, fold_in(rng, state.step),
  # can move it: a resumed run at step k draws what an uninterrupted one drew.
  batch = _batch(0)
  cfg = _cfg(num_layers=1)   # One block has both kinds of dropout, and compiles sooner.
  state = _state(cfg, batch)
  step = jax.jit(step_lib.make_train_step(optimizer.learning_rate_schedule(_train_config())))

  def loss(state, seed, at_step):
    return float(step(state.replace(step=at_step), batch, jax.random.key(seed))[1]['loss'])

  same = loss(state, 5, 3)
  # The same seed and step on a state initialised afresh, as a restarted run
  # builds it (its parameters only: a new model object would compile again).
  fresh = _state(cfg, batch)
  assert loss(state.replace(params=fresh.params, opt_state=fresh.opt_state), 5, 3) == same
  assert loss(state, 6, 3) != same     # Another seed.
  assert loss(state, 5, 4) != same     # Another step.
  assert loss(state, 6, 4) not in (same, loss(state, 6, 3), loss(state, 5, 4))


def test_weight_decay_skips_biases_and_layer_norm():
  state = _state(_cfg(), _batch())
  mask = optimizer.weight_decay_mask(state.params)
  flat = {'/'.join(k.key for k in path): v
          for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
  assert flat['encoder/embeddings/token/embedding']
  assert flat['encoder/layer_0/attention/query/kernel']
  assert not flat['encoder/layer_0/attention/query/bias']
  assert not flat['encoder/layer_0/output_layer_norm/scale']
  assert not flat['mlm_head/output_bias']


def test_schedule_warms_up_linearly_then_decays_to_zero():
  schedule = optimizer.learning_rate_schedule(_train_config(learning_rate=1.0, warmup_steps=4,
                                                           num_steps=12))
  values = [float(schedule(s)) for s in range(13)]
  np.testing.assert_allclose(values[:5], [0, 0.25, 0.5, 0.75, 1.0], atol=1e-6)
  np.testing.assert_allclose(values[4:], np.linspace(1, 0, 9), atol=1e-6)


@pytest.mark.parametrize('warmup,num_steps', [(4, 12), (0, 7), (30, 20), (10_000, 1_000_000)])
def test_linear_schedule_is_unchanged(warmup, num_steps):
  # BERT's schedule as it was before train.schedule existed, bit for bit.
  peak = 1e-4
  before = optax.join_schedules(
      [optax.linear_schedule(0.0, peak, max(warmup, 1)),
       optax.linear_schedule(peak, 0.0, max(num_steps - warmup, 1))], [warmup])
  now = optimizer.learning_rate_schedule(_train_config(learning_rate=peak, warmup_steps=warmup,
                                                      num_steps=num_steps))
  steps = np.unique(np.linspace(0, num_steps, 201).astype(np.int32))
  np.testing.assert_array_equal(jax.vmap(now)(steps), jax.vmap(before)(steps))


def _rates(steps, **train) -> np.ndarray:
  """The learning rate at each of `steps` for a peak of 1."""
  schedule = optimizer.learning_rate_schedule(_train_config(learning_rate=1.0, **train))
  return np.array([float(schedule(s)) for s in steps])


def test_wsd_schedule_warms_up_holds_the_peak_then_decays_to_zero():
  wsd = dict(warmup_steps=4, num_steps=20, schedule='wsd', decay_fraction=0.25)
  # Warm-up to step 4, the peak until the last 25% (5 steps) start at 15, 0 at 20.
  np.testing.assert_allclose(_rates([0, 2, 4, 10, 15, 17, 19, 20], **wsd),
                             [0, 0.5, 1, 1, 1, 0.6, 0.2, 0], atol=1e-6)
  np.testing.assert_allclose(_rates([4, 10, 15, 16, 19, 20], **wsd, decay_shape='1-sqrt'),
                             [1, 1, 1, 1 - np.sqrt(0.2), 1 - np.sqrt(0.8), 0], atol=1e-6)
  # Decaying over the whole run is BERT's schedule.
  np.testing.assert_allclose(_rates(range(21), **(wsd | {'decay_fraction': 1.0})),
                             _rates(range(21), warmup_steps=4, num_steps=20), atol=1e-6)
  # A trial run shorter than the warm-up only warms up.
  assert _rates([19], **(wsd | {'warmup_steps': 40}))[0] == pytest.approx(19 / 40)


def test_one_cycle_schedule_peaks_at_the_end_of_warm_up():
  # int(13 / 23 * 23) is 12: optax given pct_start=13/23 would peak a step early.
  values = _rates(range(24), warmup_steps=13, num_steps=23, schedule='one_cycle')
  assert values.argmax() == 13 and values[13] == pytest.approx(1.0)
  assert np.all(np.diff(values[:14]) > 0) and np.all(np.diff(values[13:]) < 0)
  # Cosine from 1/25 up to 1, then down to 1/(25 * 1e4); halfway down at 18.
  final = 1 / 25 / 1e4
  np.testing.assert_allclose(values[[0, 18, 22, 23]],
                             [1 / 25, (1 + final) / 2,
                              final + (1 - final) * (1 + np.cos(0.9 * np.pi)) / 2, final],
                             rtol=1e-5)


def test_mlm_head_embedding_is_tied_to_the_input_embedding():
  batch = _batch()
  # Token V - 1 only as an output: its row can reach the logits through the head alone.
  batch['input_ids'] = np.where(batch['input_ids'] == V - 1, 5, batch['input_ids']).astype(np.int32)
  state = _state(_cfg(dropout_rate=0.0, attention_dropout_rate=0.0), batch)
  names = {'/'.join(k.key for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
  assert not any('decoder' in n or ('mlm_head' in n and 'embedding' in n) for n in names)
  # Scaling that row of the input embedding moves that token's logits and no other.
  params = jax.tree_util.tree_map(lambda x: x, state.params)
  emb = params['encoder']['embeddings']['token']['embedding']
  params['encoder']['embeddings']['token']['embedding'] = emb.at[V - 1].set(emb[V - 1] * 50)
  a = state.apply_fn({'params': state.params}, batch)
  b = state.apply_fn({'params': params}, batch)
  assert not np.allclose(a[..., V - 1], b[..., V - 1])
  np.testing.assert_allclose(a[..., :V - 1], b[..., :V - 1], rtol=1e-6, atol=1e-6)


def test_split_rows_keeps_each_devices_rows():
  x = np.arange(16)
  parts = np.asarray(step_lib.split_rows({'x': jnp.asarray(x)}, 4)['x'])
  np.testing.assert_array_equal(parts[1], [1, 5, 9, 13])
  # With 4 devices of 4 rows each, part j has exactly one row from each device.
  for part in parts:
    np.testing.assert_array_equal(part // 4, [0, 1, 2, 3])


@pytest.mark.slow
def test_concurrent_chains_give_the_same_update():
  # Chains split a batch into parts computed side by side and summed: the
  # same loss, gradient norm and parameters as one chain (no dropout), here
  # inside each of 2 accumulated micro-batches (4 chains: parts of 2 rows).
  accum = 2
  batch = _batch(3)
  batch['masked_weights'][::3, 1:] = 0   # Parts get different masked-token counts.
  cfg = _cfg(dropout_rate=0.0, attention_dropout_rate=0.0)
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  repl = sharding.replicated(mesh)
  results = []
  for chains in (1, 4):
    state = jax.device_put(_state(cfg, batch), repl)
    step = jax.jit(step_lib.make_train_step(optimizer.learning_rate_schedule(_train_config()),
                                            accum, chains=chains),
                   in_shardings=(repl, sharding.batch_sharding(mesh), repl),
                   out_shardings=(repl, repl))
    for _ in range(2):
      state, metrics = step(state, sharding.to_global(batch, mesh), jax.random.key(5))
    results.append((float(metrics['loss']), float(metrics['grad_norm']),
                    float(metrics['num_masked']), state.params))
  loss1, norm1, masked1, params1 = results[0]
  for loss, norm, masked, params in results[1:]:
    assert loss == pytest.approx(loss1, rel=1e-5)
    assert norm == pytest.approx(norm1, rel=1e-4)
    assert masked == masked1
    for a, b in zip(jax.tree_util.tree_leaves(params1), jax.tree_util.tree_leaves(params)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_grad_accumulation_matches_one_big_batch():
  batch = {k: np.concatenate([a, b]) for (k, a), b in zip(_batch(0).items(), _batch(1).values())}
  # Micro-batches get different masked-token counts, so a mean of micro-batch
  # means would differ from the global mean.
  batch['masked_weights'][::4, 1:] = 0
  cfg = _cfg(dropout_rate=0.0, attention_dropout_rate=0.0)
  mesh = sharding.make_mesh()
  repl = sharding.replicated(mesh)
  results = []
  for k in (1, 4):
    state = jax.device_put(_state(cfg, batch), repl)
    step = jax.jit(step_lib.make_train_step(optimizer.learning_rate_schedule(_train_config()), k),
                   in_shardings=(repl, sharding.batch_sharding(mesh), repl),
                   out_shardings=(repl, repl))
    state = step(state, sharding.to_global(batch, mesh), jax.random.key(5))[0]
    state, metrics = step(state, sharding.to_global(batch, mesh), jax.random.key(5))
    results.append((float(metrics['loss']), float(metrics['grad_norm']), state.params))
  (loss1, norm1, params1), (loss4, norm4, params4) = results
  assert loss1 == pytest.approx(loss4, rel=1e-5)
  assert norm1 == pytest.approx(norm4, rel=1e-4)
  for a, b in zip(jax.tree_util.tree_leaves(params1), jax.tree_util.tree_leaves(params4)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _full_then_gathered(module, batch, deterministic=True):
  """The reference for pretrain: every row of the encoder's output, then the masked slots."""
  inputs, positions = batch, None
  if module.cfg.drop_token_rate > 0 and not deterministic:
    inputs = model_lib.drop_tokens(batch, module.cfg.drop_token_rate,
                                        module.make_rng('dropout'))
    positions = inputs['positions']
  sequence = module.encoder(
      model_lib.EncoderInputs.of(inputs, positions=positions, row_positions=positions),
      deterministic)
  out = {'mlm_logits': module.mlm_logits(sequence, inputs['masked_positions'])}
  if module.cfg.sentence_pair_head:
    out['sentence_pair_logits'] = module.sentence_pair(sequence, True)
  return out


@pytest.mark.slow
@pytest.mark.parametrize('variant,pair,scan,drop', [
    ('bert', False, False, 0.0), ('bert', True, False, 0.0), ('bert', False, True, 0.0),
    ('modern', False, False, 0.0), ('modern', True, False, 0.0), ('modern', False, False, 0.3)])
def test_last_block_at_the_masked_slots_gives_the_full_encoders_loss_and_gradients(
    variant, pair, scan, drop):
  # pretrain runs the last block on the masked slots (and [CLS]) only. Its
  # outputs, loss and every gradient are those of the full encoder's output
  # gathered at the slots. ModernBERT with 3 layers: the last one is local;
  # with DropToken its rows are re-indexed and its positions traced.
  cfg = _cfg(variant=variant, num_layers=3, sentence_pair_head=pair, scan_layers=scan,
             global_attn_every_n_layers=2, local_attention=8, dropout_rate=0.0,
             attention_dropout_rate=0.0, drop_token_rate=drop)
  batch = _batch()
  model = model_lib.mlm_model(cfg)
  assert type(model).__name__ == ('ModernBertForMLM' if variant == 'modern' else 'BertForMLM')
  state = state_lib.create_state(model, optimizer.make_optimizer(_train_config()),
                                jax.random.key(0), batch)

  def loss(params, method):
    out = state.apply_fn({'params': params}, batch, deterministic=not drop,
                         rngs={'dropout': jax.random.key(3)}, method=method)
    t = objective.mlm_loss_terms(out['mlm_logits'], batch['masked_ids'], batch['masked_weights'])
    return t['loss_sum'] / t['weight_sum'] + jnp.sum(out.get('sentence_pair_logits', 0.0)), out

  loss_and_grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (loss_rows, out_rows), grads_rows = loss_and_grads(state.params, 'pretrain')
  (loss_full, out_full), grads_full = loss_and_grads(state.params, _full_then_gathered)
  assert sorted(out_rows) == sorted(out_full) == (
      ['mlm_logits', 'sentence_pair_logits'] if pair else ['mlm_logits'])
  for name in out_rows:
    np.testing.assert_allclose(out_rows[name], out_full[name], rtol=1e-5, atol=1e-5)
  assert float(loss_rows) == pytest.approx(float(loss_full), rel=1e-6)
  flat_rows = jax.tree_util.tree_leaves_with_path(grads_rows)
  flat_full = dict(jax.tree_util.tree_leaves_with_path(grads_full))
  for path, g in flat_rows:
    np.testing.assert_allclose(g, flat_full[path], rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  # And it computes less (the scanned encoder runs its last block in full): the programs above,
  # lowered again from the traces they were compiled from.
  flops = lambda method: loss_and_grads.lower(state.params, method).cost_analysis()['flops']
  assert (flops('pretrain') == flops(_full_then_gathered)) if scan else (
      flops('pretrain') < 0.9 * flops(_full_then_gathered))


@pytest.mark.slow
def test_a_growing_batch_step_trains_only_the_micro_batches_it_fills():
  # A batch warm-up fills j of the k micro-batches (rows r with r mod k < j) and pads the rest:
  # the one compiled step gives the update of the j micro-batches' rows alone, and a full batch
  # the update of the scanned step.
  cfg = _cfg(dropout_rate=0.0, attention_dropout_rate=0.0)
  schedule = optimizer.learning_rate_schedule(_train_config())
  full = _batch(4)
  k = 4
  growing = jax.jit(step_lib.make_train_step(schedule, k, growing_batch=True))
  scanned = jax.jit(step_lib.make_train_step(schedule, k))
  plain = jax.jit(step_lib.make_train_step(schedule, 1))
  key = jax.random.key(5)

  def run(step, batch):
    state, metrics = step(_state(cfg, full), batch, key)
    return state.params, metrics

  for j in (1, 3):
    real = np.arange(B) % k < j
    padded = {name: np.where(real.reshape((B,) + (1,) * (x.ndim - 1)), x, 0)
              for name, x in full.items()}
    alone = {name: x[real] for name, x in full.items()}
    params, metrics = run(growing, padded)
    want_params, want = run(plain, alone)
    assert float(metrics['num_masked']) == float(want['num_masked']) == 4 * int(real.sum())
    assert float(metrics['loss']) == pytest.approx(float(want['loss']), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  params, metrics = run(growing, full)
  want_params, want = run(scanned, full)
  assert float(metrics['loss']) == pytest.approx(float(want['loss']), rel=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
