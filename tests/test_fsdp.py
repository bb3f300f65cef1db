"""Sharded train state: fsdp splits parameters and Adam moments, changes no loss,
and a checkpoint resumes on a mesh of another shape (and another device count);
activations keep the batch's split by the logical 'batch' rule, on the mesh only."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax import model as model_lib
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib
from tests.conftest import REPO
from tests.conftest import model_config
from tests.conftest import run_training
from tests.conftest import write_config_file
from tests.conftest import xla_flags


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r['loss'] for r in map(json.loads, f) if 'loss' in r}


@pytest.mark.slow
def test_fsdp_splits_every_matrix_and_both_adam_moments():
  cfg = model_config(vocab_size=100, padded_vocab_size=128, num_layers=2,
                              hidden_size=32, num_heads=4, intermediate_size=64,
                              max_position_embeddings=16)
  ids = jnp.zeros((1, 16), jnp.int32)
  example = {'input_ids': ids, 'attention_mask': ids + 1, 'segment_ids': ids,
             'masked_positions': ids[:, :3], 'masked_ids': ids[:, :3],
             'masked_weights': jnp.zeros((1, 3))}
  train = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=1, num_steps=10, grad_clip_norm=1.0, adam_b1=0.9,
      adam_b2=0.999, adam_eps=1e-6, weight_decay=0.01, schedule='linear'))
  mesh = sharding.make_mesh(fsdp=4)
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 4}
  state, _ = state_lib.create_sharded_state(model_lib.BertForMLM(cfg), optimizer.make_optimizer(train),
                                           jax.random.key(0), example, mesh)
  p = state.params['encoder']
  shard = lambda x: x.addressable_shards[0].data.shape
  assert shard(p['embeddings']['token']['embedding']) == (128, 8)      # [V, d/4]
  assert shard(p['layer_0']['attention']['query']['kernel']) == (8, 4, 8)  # [d/4, N, H]
  assert shard(p['layer_0']['attention']['out']['kernel']) == (4, 8, 8)    # [N, H, d/4]
  assert shard(p['layer_1']['intermediate']['kernel']) == (8, 64)          # [d/4, d_ff]
  assert shard(p['layer_1']['output']['kernel']) == (64, 8)                # [d_ff, d/4]
  adam = state.opt_state[1][0]
  for moment in (adam.mu, adam.nu):
    assert shard(moment['encoder']['layer_1']['output']['kernel']) == (64, 8)
  # The whole state on a device is about a quarter (a few small vectors stay whole).
  leaves = jax.tree_util.tree_leaves(state)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
  total = sum(x.nbytes for x in leaves)
  assert per_device < 0.3 * total


def _micro_model_config():
  """configs/bert_tiny.py at a size that lowers in a second: 2 layers, d=32, T=16, B=16, fsdp=4."""
  from configs import bert_tiny
  config = bert_tiny.get_config()
  m = config.model
  m.num_layers, m.hidden_size, m.num_heads, m.intermediate_size = 2, 32, 2, 64
  m.max_position_embeddings = config.data.seq_len = 16
  config.masking.max_predictions, config.train.batch_size, config.mesh.fsdp = 3, 16, 4
  return config


def test_train_step_keeps_every_activation_split_over_the_batch_axes_with_fsdp():
  # The model names its activations' batch axis ('batch'); LOGICAL_RULES puts
  # it on (data, fsdp). Without the constraint XLA may gather the activations
  # rather than the weights split on fsdp; it only holds when the step is
  # traced on the mesh, which the builder does.
  config = _micro_model_config()
  mesh = sharding.make_mesh(fsdp=4)
  built = build_lib.build(config, 100, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sh)
           for k, x in state_lib.batch_spec(16, 16, 3).items()}
  rng = jax.ShapeDtypeStruct(built.dropout_rng.shape, built.dropout_rng.dtype,
                             sharding=sharding.replicated(mesh))
  lowered = built.train_step.lower(built.abstract_state, batch, rng)
  constraints = re.findall(r'sharding_constraint %\S+ <@mesh, \[([^\]]*)\]> : tensor<(\d+)x',
                           lowered.as_text())
  # Every block's input, q/k/v, MLP and output, and the head's input, forward
  # and in the gradient: all on the batch axis (B = 16), split over both mesh axes.
  assert len(constraints) >= 10 * config.model.num_layers
  assert {spec.split('}')[0] + '}' for spec, _ in constraints} == {'{"data", "fsdp"}'}
  assert {rows for _, rows in constraints} == {'16'}


def test_a_model_outside_any_mesh_runs_unconstrained_with_the_same_outputs():
  # Tests, interop and analysis apply the model on one device, with no mesh:
  # the constraints are then nothing, and on the mesh they change where the
  # rows live, not the values.
  cfg = model_config(vocab_size=100, padded_vocab_size=128, num_layers=2, hidden_size=32,
                     num_heads=2, intermediate_size=64, max_position_embeddings=16)
  model = model_lib.mlm_model(cfg)
  rng = np.random.default_rng(0)
  batch = {'input_ids': rng.integers(5, 100, (16, 16)).astype(np.int32),
           'segment_ids': np.zeros((16, 16), np.int32),
           'attention_mask': np.ones((16, 16), np.int32),
           'masked_positions': np.tile(np.arange(1, 4, dtype=np.int32), (16, 1))}
  params = jax.jit(model.init)(jax.random.key(0), batch)
  apply = jax.jit(model.apply)
  assert 'sharding_constraint' not in apply.lower(params, batch).as_text()
  alone = apply(params, batch)                                       # [B, P, V], one device
  mesh = sharding.make_mesh(fsdp=4)
  on_mesh = jax.jit(sharding.traced_on(model.apply, mesh))
  assert 'sharding_constraint' in on_mesh.lower(params, sharding.to_global(batch, mesh)).as_text()
  np.testing.assert_allclose(np.asarray(on_mesh(params, sharding.to_global(batch, mesh))),
                             np.asarray(alone), rtol=1e-5, atol=1e-5)


def test_splash_attention_on_the_mesh_runs_per_device_on_its_rows():
  # The TPU kernel takes its mesh from the context the step is traced in: on
  # the mesh it runs under shard_map over the batch's axes (each device its
  # rows), alone on one device; the same function either way (Pallas's
  # interpreter runs it here).
  from mlm_jax.model import attention
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(8, 128, 2, 16)), jnp.float32) for _ in range(3))
  mask = attention.Mask(jnp.asarray(np.arange(128)[None] < rng.integers(60, 129, (8, 1))))
  splash = lambda q, k, v: attention.splash_attention(q, k, v, mask, interpret=True)
  alone = jax.jit(splash)
  assert 'manual_computation' not in alone.lower(q, k, v).as_text()
  mesh = sharding.make_mesh(fsdp=4)
  on_mesh = jax.jit(sharding.traced_on(splash, mesh))
  q, k, v = (jax.device_put(x, sharding.batch_sharding(mesh)) for x in (q, k, v))
  assert 'manual_axes={"data", "fsdp"}' in on_mesh.lower(q, k, v).as_text()
  np.testing.assert_array_equal(np.asarray(on_mesh(q, k, v)), np.asarray(alone(q, k, v)))


@pytest.mark.slow
def test_fsdp4_same_losses_as_fsdp1_then_resumes_on_4_devices_with_fsdp2(prepared, tmp_path):
  config, _ = prepared
  config = config.copy_and_resolve_references()
  config.model.dropout_rate = 0.0  # Compare sums of the same numbers, summed in another order.
  config.model.attention_dropout_rate = 0.0
  config.train.num_steps = 4
  config.train.log_every = 1
  plain = run_training(config, str(tmp_path / 'fsdp1'))
  config.mesh.fsdp = 4
  sharded = run_training(config, str(tmp_path / 'fsdp4'))
  assert plain['mesh'] == {'data': 8, 'fsdp': 1} and sharded['mesh'] == {'data': 2, 'fsdp': 4}
  assert sharded['state_bytes'] == plain['state_bytes']
  assert sharded['state_bytes_per_device'] < 0.3 * plain['state_bytes_per_device']
  l1, l4 = _losses(tmp_path / 'fsdp1'), _losses(tmp_path / 'fsdp4')
  assert list(l4) == [1, 2, 3, 4]
  np.testing.assert_allclose(list(l4.values()), list(l1.values()), rtol=1e-5)

  # Resume both runs to step 6 in another process with 4 devices and fsdp=2
  # (the fsdp=4 checkpoint) and with fsdp=1 (the plain one): same losses.
  for name, fsdp in (('fsdp4', 2), ('fsdp1', 1)):
    config_file = write_config_file(
        tmp_path / f'{name}.py', config.data.corpus, config.data.data_dir,
        other={'mesh.fsdp': fsdp, 'model.dropout_rate': 0.0, 'model.attention_dropout_rate': 0.0},
        num_steps=6, log_every=1, checkpoint_every=2)
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               JAX_PLATFORMS='cpu')
    out = subprocess.run([sys.executable, '-m', 'mlm_jax.train', f'--config={config_file}',
                          f'--workdir={tmp_path / name}'], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'Resumed from' in out.stderr
  l1, l4 = _losses(tmp_path / 'fsdp1'), _losses(tmp_path / 'fsdp4')
  assert list(l4) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(list(l4.values()), list(l1.values()), rtol=1e-5)
  summary = json.load(open(tmp_path / 'fsdp4' / 'summary.json'))
  assert summary['mesh'] == {'data': 2, 'fsdp': 2} and summary['start_step'] == 4
