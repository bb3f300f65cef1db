"""Sharded train state: fsdp splits parameters and Adam moments, changes no loss,
and a checkpoint resumes on a mesh of another shape (and another device count)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mlm_jax import model as model_lib
from mlm_jax.runtime import sharding
from mlm_jax.training import optimizer
from mlm_jax.training import state as state_lib
from tests.conftest import REPO
from tests.conftest import model_config
from tests.conftest import run_training
from tests.conftest import write_config_file


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
    env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
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
