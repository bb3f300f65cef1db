"""Attention from a mask description: every kernel against dense masked attention, which
kernel each call gets and why, and packed documents kept apart."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from mlm_jax.config import saved
from mlm_jax import model as model_lib
from mlm_jax.errors import ConfigError
from mlm_jax.data import masking
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.model import attention
from mlm_jax.model import config as model_config_lib
from tests.conftest import model_config

B, T, N, H = 3, 300, 2, 8
SPECIALS = tok_lib.Specials(pad=0, unk=1, cls=2, sep=3, mask=4,
                            tokens=('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'))


def _inputs(seed: int, t: int = T, doc_rate: float = 0.02):
  """q, k, v [B, t, N, H]; rows of lengths t, 0.57t and 5; documents of ~1/doc_rate tokens."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, t, N, H)) * 2, jnp.float32) for _ in range(3))
  valid = np.arange(t)[None] < np.array([t, int(0.57 * t), 5])[:, None]
  docs = np.where(valid, np.cumsum(rng.random((B, t)) < doc_rate, axis=1) + 1, 0)
  # Original positions of kept tokens (as after DropToken): increasing, gaps of 1-2.
  positions = np.cumsum(rng.integers(1, 3, (B, t)), axis=1) - 1
  return (q, k, v), jnp.asarray(valid), jnp.asarray(docs, jnp.int32), jnp.asarray(positions)


def _dense(mask, rows=None):
  return lambda q, k, v: model_lib.softmax_attention(q, k, v, mask.allowed(rows))


def _assert_same_function(f, ref, qkv, valid, atol=2e-5):
  """Values at real queries and gradients (of a random projection) of f and ref agree.

  Each compiled whole (jit): run op by op, every primitive would be a compile of its own.
  """
  g = jnp.asarray(np.random.default_rng(9).normal(size=qkv[0].shape), jnp.float32)
  weight = g * valid[:, :, None, None]
  np.testing.assert_allclose(np.where(valid[:, :, None, None], jax.jit(f)(*qkv), 0),
                             np.where(valid[:, :, None, None], jax.jit(ref)(*qkv), 0), atol=atol)
  got = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * weight), argnums=(0, 1, 2)))(*qkv)
  want = jax.jit(jax.grad(lambda *x: jnp.sum(ref(*x) * weight), argnums=(0, 1, 2)))(*qkv)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=atol * 5)


@pytest.mark.parametrize('documents', [False, True])
@pytest.mark.parametrize('moved', [False, True])
@pytest.mark.parametrize('window', [7, 20])
def test_banded_kernel_is_dense_local_attention(window, moved, documents):
  qkv, valid, docs, positions = _inputs(0)
  mask = attention.Mask(valid, positions if moved else None, docs if documents else None, window)
  _assert_same_function(lambda *x: attention.banded_attention(*x, mask), _dense(mask), qkv, valid)


@pytest.mark.parametrize('window', [None, 20])
@pytest.mark.parametrize('documents', [False, True])
def test_chunked_kernel_is_dense_attention_for_all_rows_and_chosen_rows(window, documents):
  qkv, valid, docs, positions = _inputs(1)
  mask = attention.Mask(valid, positions if window else None, docs if documents else None, window)
  _assert_same_function(lambda *x: attention.chunked_attention(*x, mask, None, chunk=64),
                        _dense(mask), qkv, valid)
  rng = np.random.default_rng(2)
  rows = jnp.asarray(np.stack([np.sort(rng.choice(T, 37, replace=False)) for _ in range(B)]))
  q = jnp.take_along_axis(qkv[0], rows[:, :, None, None], axis=1)
  _assert_same_function(lambda *x: attention.chunked_attention(*x, mask, rows, chunk=16),
                        _dense(mask, rows), (q,) + qkv[1:], jnp.ones(rows.shape, bool))


def test_dense_masks_follow_the_description():
  valid = jnp.asarray([[1, 1, 1, 1, 1, 0]], bool)
  docs = jnp.asarray([[1, 1, 2, 2, 2, 0]])
  near = attention.Mask(valid, window=1).allowed()
  apart = attention.Mask(valid, documents=docs).allowed()
  both = attention.Mask(valid, documents=docs, window=1).allowed()
  assert near[0, 0].tolist() == [True, True, False, False, False, False]
  assert apart[0, 1].tolist() == [True, True, False, False, False, False]
  assert both[0, 2].tolist() == [False, False, True, True, False, False]
  # DropToken's positions: distances in the original row, not in index.
  moved = attention.Mask(valid, jnp.asarray([[0, 1, 5, 6, 7, 8]]), window=1).allowed()
  assert moved[0, 1].tolist() == [True, True, False, False, False, False]
  # Queries at chosen rows see what those rows see.
  rows = jnp.asarray([[2, 0]])
  np.testing.assert_array_equal(attention.Mask(valid, documents=docs, window=1).allowed(rows),
                                both[:, [2, 0]])
  assert attention.Mask(valid).allowed() is valid   # No [Q, T] mask where lengths say it all.


def test_library_kernel_agrees_and_padding_rows_stay_finite():
  qkv, valid, docs, _ = _inputs(3, t=40, doc_rate=0.1)
  valid = valid.at[2].set(False)   # An all-padding row, as eval's padding rows.
  mask = attention.Mask(valid, documents=jnp.where(valid, docs, 0), window=6)
  lib = lambda q, k, v: attention.jax_xla_attention(q, k, v, mask.allowed())
  for f in (lib, lambda *x: attention.banded_attention(*x, mask), _dense(mask)):
    assert np.isfinite(np.asarray(jax.jit(f)(*qkv))).all()
  _assert_same_function(lib, _dense(mask), qkv, valid)


@pytest.mark.slow
@pytest.mark.parametrize('window, t', [(None, 256), (32, 200)])
def test_splash_kernel_is_dense_attention_with_segments(window, t):
  # Pallas's interpreter runs the TPU kernel on the CPU: same function. 200 tokens run padded
  # to 256, two tiles.
  qkv, valid, docs, _ = _inputs(4, t=t)
  for documents in (None, docs):
    mask = attention.Mask(valid, None, documents, window)
    _assert_same_function(lambda *x: attention.splash_attention(*x, mask, interpret=True),
                          _dense(mask), qkv, valid, atol=1e-4)


def _cfg(**fields):
  base = dict(num_layers=4, hidden_size=32, num_heads=4, intermediate_size=48, variant='modern',
              max_position_embeddings=512, dropout_rate=0.0, attention_dropout_rate=0.0,
              local_attention=16, global_attn_every_n_layers=3)
  return model_config(**(base | fields), vocab_size=60, padded_vocab_size=128)


def _choose(cfg, local=False, q_len=1024, kv_len=1024, rows=False, contiguous=True,
            documents=False, dropout=False):
  return attention.choose(cfg, local=local, q_len=q_len, kv_len=kv_len, rows=rows,
                          contiguous=contiguous, documents=documents, dropout=dropout)


def test_auto_picks_per_platform_and_says_why_it_hands_a_call_on():
  gpu = _cfg(platform='gpu', dtype=jnp.bfloat16)
  tpu = _cfg(platform='tpu', dtype=jnp.bfloat16)
  cpu = _cfg(platform='cpu')
  assert _choose(gpu) == ('cudnn', '') and _choose(gpu, rows=True, q_len=20)[0] == 'cudnn'
  # Local layers and documents: the flash kernel (tests/test_flash_attention.py).
  assert _choose(gpu, local=True) == ('flash', '')
  kernel, why = _choose(gpu, documents=True)
  assert kernel == 'flash' and 'not document ids' in why
  assert _choose(tpu) == ('splash', '') and _choose(tpu, local=True, documents=True)[0] == 'splash'
  # Short global rows without documents (BERT's) stay with XLA's fused attention.
  assert _choose(tpu, q_len=512, kv_len=512) == ('jax_xla', '')
  assert _choose(tpu, q_len=512, kv_len=512, documents=True) == ('splash', '')
  kernel, why = _choose(tpu, local=True, contiguous=False)
  assert kernel == 'blocked' and 'DropToken' in why
  kernel, why = _choose(tpu, rows=True, q_len=154)
  assert kernel == 'dense' and 'masked slots' in why
  # Long rows of any length: splash pads them to whole tiles (Ettin's 7,999 tokens); shorter
  # ones would pay too much padding.
  assert _choose(tpu, q_len=7999, kv_len=7999) == ('splash', '')
  assert _choose(tpu, local=True, q_len=7999, kv_len=7999, documents=True) == ('splash', '')
  kernel, why = _choose(tpu, local=True, q_len=1000, kv_len=1000)
  assert kernel == 'blocked' and 'do not divide into splash blocks of 128' in why
  assert _choose(cpu, local=True) == ('blocked', '')
  # On CPUs global layers run ours over a dense mask on short rows, in query chunks on long ones.
  kernel, why = _choose(cpu, q_len=128, kv_len=128)
  assert kernel == 'dense' and 'small' in why
  assert _choose(cpu, q_len=4096, kv_len=4096) == ('blocked', '')
  kernel, why = _choose(cpu, local=True, q_len=24, kv_len=24)
  assert kernel == 'dense' and 'covers most' in why
  # Attention dropout: only ours and the banded kernel apply it.
  drop = _cfg(platform='gpu', dtype=jnp.bfloat16, attention_dropout_rate=0.1)
  assert _choose(drop, dropout=True) == ('dense', '')
  assert _choose(drop, local=True, dropout=True) == ('blocked', '')
  assert _choose(_cfg(attention='blocked'), q_len=4096, kv_len=4096) == ('blocked', '')


def test_a_kernel_the_platform_lacks_is_refused_by_name():
  with pytest.raises(ConfigError, match="runs on tpu only"):
    attention.check_platform(_cfg(attention='splash', platform='gpu'))
  with pytest.raises(ConfigError, match='16-bit'):
    attention.check_platform(_cfg(attention='cudnn', platform='gpu'))
  attention.check_platform(_cfg(attention='cudnn', platform='gpu', dtype=jnp.bfloat16))


def test_the_plan_names_every_kind_of_call():
  cfg = _cfg(platform='tpu', dtype=jnp.bfloat16, num_layers=22, document_mask=True)
  line = attention.describe(cfg, 1024, 154)
  assert line.startswith('documents apart')
  assert 'global layers 0, 3, ..., 18 (7): splash (Pallas splash attention' in line
  assert 'local layers 1, 2, ..., 20 (14): splash (Pallas splash attention' in line
  assert 'last block (layer 21, global) at its 154 output rows: dense (ours' in line


@pytest.mark.parametrize('old, new', [('xla', 'dense'), ('dot_product', 'jax_xla')])
def test_a_run_saved_with_an_old_kernel_name_reads_as_the_new_one(old, new):
  run = base.get_config().to_dict()
  run['model'] |= {'attention': old, 'attention_dropout_rate': 0.0, 'variant': 'modern'}
  run['resolved'] = {'vocab_size': 60, 'padded_vocab_size': 128}
  config = saved.read(run, 'run/config.json')
  read = lambda model: model_lib.ModelConfig.from_config(model, 60, 128, jnp.bfloat16,
                                                         platform='tpu')
  cfg = read(config.model)
  today = config.model.copy_and_resolve_references()
  today.attention = new
  assert cfg.attention == new
  assert attention.plan(cfg, 1024, 154) == attention.plan(read(today), 1024, 154)
  # Given today (a config file, --config.model.attention), the old name is refused by its new one.
  with pytest.raises(ConfigError, match=f"now called '{new}'.*--config.model.attention={new}"):
    model_config_lib.check_config(config.model)


def _packed_batch(docs_tokens, t, rng):
  """One row [CLS] d1 [SEP] d2 [SEP] ... [PAD]... of ids drawn from `rng`."""
  ids = [2]
  for n in docs_tokens:
    ids += list(rng.integers(5, 60, n)) + [3]
  ids += [0] * (t - len(ids))
  return np.asarray([ids], np.int32)


@pytest.mark.parametrize('variant', ['modern', 'bert'])
def test_a_document_packed_with_others_is_as_if_alone(variant):
  rng = np.random.default_rng(5)
  t = 64
  packed = _packed_batch([9, 14, 20], t, rng)                   # [CLS] A [SEP] B [SEP] C [SEP]
  b_start, b_len = 11, 15                                       # B and its [SEP]
  alone = np.zeros((1, t), np.int32)
  alone[0, :b_len] = packed[0, b_start:b_start + b_len]
  cfg = _cfg(variant=variant, document_mask=True, restart_positions=True, local_attention=8,
             type_vocab_size=2)
  model = model_lib.mlm_model(cfg)
  outputs = []
  for ids in (packed, alone):
    batch = {'input_ids': ids, 'segment_ids': np.zeros_like(ids),
             'attention_mask': (ids != 0).astype(np.int32),
             'document_ids': masking.document_ids(ids, SPECIALS)}
    params = model.init(jax.random.key(0), batch | {'masked_positions': np.zeros((1, 2), np.int32)},
                        method=model.all_layers)
    outputs.append(model.apply(params, batch, method=model.all_layers))
  np.testing.assert_allclose(outputs[0][:, 0, b_start:b_start + b_len], outputs[1][:, 0, :b_len],
                             atol=2e-5)
  # Without the document mask, the neighbours change B.
  cfg = _cfg(variant=variant, restart_positions=True, local_attention=8, type_vocab_size=2)
  model = model_lib.mlm_model(cfg)
  batch = {'input_ids': packed, 'segment_ids': np.zeros_like(packed),
           'attention_mask': (packed != 0).astype(np.int32),
           'document_ids': masking.document_ids(packed, SPECIALS)}
  mixed = model.apply(params, batch, method=model.all_layers)
  assert not np.allclose(mixed[-1, 0, b_start:b_start + b_len], outputs[1][-1, 0, :b_len],
                         atol=1e-3)


def test_positions_restart_at_each_document():
  docs = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(model_lib.document_positions(docs),
                                [[0, 1, 2, 0, 1, 0, 0, 1], np.arange(8)])


def _modern_batch(t, seed=0, p=12):
  rng = np.random.default_rng(seed)
  lengths = np.array([t, t - 37, t // 3, t - 1])
  ids = np.where(np.arange(t)[None] < lengths[:, None], rng.integers(5, 60, (4, t)), 0)
  ids[:, 0] = 2
  ids[np.arange(4)[:, None], rng.integers(1, t // 3, (4, 5))] = 3    # Document ends.
  ids = ids.astype(np.int32)
  positions = np.stack([np.sort(rng.choice(np.arange(1, n), p, replace=False)) for n in lengths])
  return {'input_ids': ids, 'segment_ids': np.zeros_like(ids),
          'attention_mask': (ids != 0).astype(np.int32),
          'document_ids': masking.document_ids(ids, SPECIALS),
          'masked_positions': positions.astype(np.int32),
          'masked_ids': rng.integers(5, 60, (4, p)).astype(np.int32),
          'masked_weights': np.ones((4, p), np.float32)}


@pytest.mark.slow
@pytest.mark.parametrize('drop_token_rate, documents', [
    (0.0, False), (0.0, True), (0.3, False), (0.3, True)])
def test_blocked_model_trains_as_the_dense_one(drop_token_rate, documents):
  # Rows of 160 tokens, windows of 8 each side: the local layers run banded,
  # the last block (a global layer, at the masked slots) densely; DropToken
  # moves the tokens the windows measure.
  batch = _modern_batch(160)
  fields = dict(drop_token_rate=drop_token_rate, document_mask=documents,
                restart_positions=documents)
  dense, blocked = (model_lib.mlm_model(_cfg(attention=a, **fields)) for a in ('dense', 'blocked'))
  assert [c.kernel for c in attention.plan(blocked.cfg, 160, 12)][:2] == ['dense', 'blocked']
  _assert_trains_as_the_dense_model(blocked, dense, batch)


def _assert_trains_as_the_dense_model(model, dense, batch):
  """`model` and `dense` (the same parameters) give the same loss and gradients on `batch`."""
  params = nn.unbox(dense.init(jax.random.key(0), batch)['params'])

  def loss(model, params):
    logits = model.apply({'params': params}, batch, deterministic=False,
                         rngs={'dropout': jax.random.key(1)})
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7])
  # Compiled, as a step runs them: an op-by-op gradient of the model takes twice as long.
  want, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(dense, p)))(params)
  got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(model, p)))(params)
  assert float(got) == pytest.approx(float(want), rel=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4),
                         got_grads, want_grads)



@pytest.mark.slow
def test_the_tiny_modernbert_trains_on_rows_of_2048_tokens_within_a_few_gib(corpus_glob,
                                                                             tmp_path):
  """configs/tiny.py at T=2,048 with documents apart, as a command on one CPU device: the local
  layers run banded, the step trains, and the process stays within 4 GiB. It reads the session's
  small corpus: the step and its memory are what is tested, not the text."""
  import os
  import subprocess
  import sys

  from tests.conftest import REPO
  from tests.conftest import COMPILE_FLAGS
  env = dict(os.environ, XLA_FLAGS=COMPILE_FLAGS)   # One device: the rows of a laptop run.
  # The command, reporting its own peak resident memory as it exits (VmHWM: this
  # process's, from its exec on; ru_maxrss would count the forked test process).
  wrapper = ('import atexit, runpy, sys\n'
             'def peak():\n'
             '  line = [x for x in open("/proc/self/status") if x.startswith("VmHWM")][0]\n'
             '  print("peak resident memory:", int(line.split()[1]) * 1024, file=sys.stderr)\n'
             'atexit.register(peak)\n'
             'sys.argv[0] = "mlm_jax.train"\n'
             'runpy.run_module("mlm_jax.train", run_name="__main__", alter_sys=True)\n')
  command = [sys.executable, '-c', wrapper, '--config=configs/tiny.py',
             f'--workdir={tmp_path / "run"}', f'--config.data.data_dir={tmp_path / "data"}',
             f'--config.data.corpus={corpus_glob}',
             '--config.data.seq_len=2048', '--config.model.max_position_embeddings=2048',
             '--config.model.document_mask=True', '--config.train.batch_size=4',
             '--config.eval.batch_size=4', '--config.eval.max_batches=2',
             '--config.train.num_steps=2', '--config.train.warmup_steps=1',
             '--config.train.log_every=1', '--config.train.eval_every=2',
             '--config.train.checkpoint_every=2']
  log = tmp_path / 'log.txt'
  with open(log, 'w') as out:
    code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                          timeout=900, check=False).returncode
  text = log.read_text()
  assert code == 0, text[-3000:]
  assert 'local layers 1, 2: blocked (banded XLA)' in text
  peak = int(text.split('peak resident memory:')[1].split()[0])
  assert peak < 4 * 2**30, f'peak resident memory {peak / 2**30:.2f} GiB'
  import json
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    losses = [r['loss'] for r in map(json.loads, f) if 'loss' in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
