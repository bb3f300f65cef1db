"""The Pallas flash kernel ('flash', NVIDIA GPUs) in Pallas's interpreter: the same function as
dense masked attention for every mask a model describes, its band of tiles, and 'auto' choosing
it on GPUs wherever cuDNN's fused call cannot take the mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax import model as model_lib
from mlm_jax.errors import ConfigError
from mlm_jax.model import attention
from mlm_jax.model.attention import flash
from mlm_jax.runtime import sharding
from tests.test_attention import B
from tests.test_attention import _assert_same_function
from tests.test_attention import _assert_trains_as_the_dense_model
from tests.test_attention import _cfg
from tests.test_attention import _choose
from tests.test_attention import _dense
from tests.test_attention import _inputs
from tests.test_attention import _modern_batch


# On a machine with an NVIDIA GPU the kernels run compiled, elsewhere in the interpreter.
INTERPRET = jax.default_backend() != 'gpu'


def _flash(mask, rows=None):
  return lambda q, k, v: attention.flash_attention(q, k, v, mask, rows, interpret=INTERPRET)


@pytest.mark.parametrize('window, moved, documents', [
    (20, True, True),     # The quick loop's: a local layer after DropToken, documents apart.
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        (None, False, False), (None, False, True), (20, False, False), (20, False, True),
        (20, True, False)))])
def test_flash_kernel_is_dense_attention(window, moved, documents):
  # Rows of 300 tokens (not whole tiles of 64), of 300, 171 and 5 real tokens, heads of 8
  # (padded to Triton's 16): values and gradients as dense masked attention's.
  qkv, valid, docs, positions = _inputs(4)
  mask = attention.Mask(valid, positions if moved else None, docs if documents else None, window)
  _assert_same_function(_flash(mask), _dense(mask), qkv, valid)


@pytest.mark.slow
@pytest.mark.parametrize('window', [None, 20])
def test_flash_kernel_at_chosen_rows_is_dense_attention(window):
  # The last block's queries: the masked slots' rows (37, not whole tiles; real tokens, the
  # unused slots' row 0 repeated), documents apart.
  qkv, valid, docs, positions = _inputs(5)
  mask = attention.Mask(valid, positions if window else None, docs, window)
  rng = np.random.default_rng(6)
  rows = jnp.asarray(np.sort(rng.integers(0, np.sum(valid, axis=1)[:, None], (B, 37)), axis=1))
  q = jnp.take_along_axis(qkv[0], rows[:, :, None, None], axis=1)
  _assert_same_function(_flash(mask, rows), _dense(mask, rows), (q,) + qkv[1:],
                        jnp.ones(rows.shape, bool))


@pytest.mark.slow
def test_flash_kernel_in_bfloat16_is_dense_attention_to_bfloat16_precision():
  qkv, valid, docs, _ = _inputs(7, t=256)
  mask = attention.Mask(valid, documents=docs, window=32)
  low = tuple(x.astype(jnp.bfloat16) for x in qkv)
  got = np.asarray(_flash(mask)(*low).astype(jnp.float32))
  want = np.asarray(_dense(mask)(*(x.astype(jnp.float32) for x in low)))
  real = np.asarray(valid)[:, :, None, None]
  # The probabilities meet v in bfloat16, as in every flash kernel: a few bfloat16 steps.
  error = np.abs(np.where(real, got - want, 0)).max()
  assert error < 2 * 2.0**-8 * np.abs(want).max()


def test_a_local_query_tile_reads_only_the_key_tiles_of_its_band():
  # Values past position 192 are NaN. With a window of 20 each side, query tiles 0 and 1
  # (positions 0-127) reach key tiles 0-2 only, so their outputs stay finite; had they read
  # every tile, 0·NaN would have spread. Tile 2 reaches tile 3: NaN.
  qkv, _, _, _ = _inputs(8, t=512)
  q, k, v = qkv
  v = v.at[:, 192:].set(jnp.nan)
  mask = attention.Mask(jnp.ones((B, 512), bool), window=20)
  out = np.asarray(_flash(mask)(q, k, v))
  assert np.isfinite(out[:, :128]).all()
  assert np.isnan(out[:, 128:192]).any()
  # The FLOP count's keys per query: 3 tiles of 64 for the first and last tiles, 4 between.
  assert attention.flash_keys(512, 512, 20, rows=False) == (2 * 2 + 6 * 3) * 64 / 8
  assert attention.flash_keys(300, 300, 20, rows=True) == 320
  assert attention.flash_keys(300, 300, None, rows=False) == 320


def test_a_query_tile_skips_the_key_tiles_of_other_documents_and_of_padding():
  # Documents of 128 tokens, then 128 of padding: values of documents 3 and 4 are NaN, so the
  # first two documents' outputs stay finite only if their tiles never read those.
  qkv, _, _, _ = _inputs(10, t=640)
  q, k, v = qkv
  v = v.at[:, 256:512].set(jnp.nan)
  valid = jnp.broadcast_to(jnp.arange(640) < 512, (B, 640))
  docs = jnp.where(valid, 1 + jnp.arange(640) // 128, 0)
  out = np.asarray(_flash(attention.Mask(valid, documents=docs))(q, k, v))
  assert np.isfinite(out[:, :256]).all() and np.isnan(out[:, 256:512]).all()
  # The spans: query tiles 0-1 (document 1) read key tiles 0-1, tiles 8-9 (padding) 8-9;
  # with a window of 20, tile 2 reads tiles 1-3 of its document's 2-3.
  first, end, _, _ = flash.tile_spans(docs, docs, None)
  assert first[0].tolist() == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]
  assert end[0].tolist() == [2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
  first, end, _, _ = flash.tile_spans(docs, docs, 20)
  assert (first[0, 2], end[0, 2]) == (2, 4)


@pytest.mark.slow
def test_ids_that_do_not_increase_along_a_row_still_give_dense_attention():
  # Spans are taken from the first to the last tile that can meet: a superset for any ids.
  qkv, valid, _, _ = _inputs(11, t=256)
  ids = np.random.default_rng(12).permutation(np.repeat(np.arange(1, 5), 64))
  docs = jnp.where(valid, jnp.asarray(ids)[None], 0)
  for window in (None, 30):
    mask = attention.Mask(valid, documents=docs, window=window)
    _assert_same_function(_flash(mask), _dense(mask), qkv, valid)


@pytest.mark.slow
def test_on_a_mesh_each_device_runs_the_kernel_on_its_own_rows():
  # 8 rows over an 8-device (data 4, fsdp 2) mesh: the same values as on one device, and no
  # device gathers the others' rows (a custom call XLA cannot split would need them all).
  rng = np.random.default_rng(9)
  q, k, v = (jnp.asarray(rng.normal(size=(8, 128, 2, 8)), jnp.float32) for _ in range(3))
  valid = jnp.asarray(np.arange(128)[None] < rng.integers(5, 129, (8, 1)))
  docs = jnp.asarray(np.where(valid, 1 + np.arange(128)[None] // rng.integers(9, 60, (8, 1)), 0))
  mesh = sharding.make_mesh(fsdp=2)
  split = sharding.batch_sharding(mesh)

  def run(q, k, v, valid, docs):
    return attention.flash_attention(q, k, v, attention.Mask(valid, documents=docs, window=20),
                                     interpret=INTERPRET)
  step = jax.jit(sharding.traced_on(run, mesh))
  args = [jax.device_put(x, split) for x in (q, k, v, valid, docs)]
  np.testing.assert_allclose(step(*args), run(q, k, v, valid, docs), atol=1e-6)
  assert 'all-gather' not in step.lower(*args).compile().as_text()


def test_kernel_names_carry_the_band():
  assert flash.kernel_name('fwd', 64, band=True) == 'mlm_flash_fwd_w64'
  assert flash.kernel_name('dq', 64, band=False) == 'mlm_flash_dq'


def test_auto_on_gpus_runs_local_layers_and_documents_on_the_flash_kernel():
  gpu = _cfg(platform='gpu', dtype=jnp.bfloat16)
  assert _choose(gpu, local=True) == ('flash', '')
  assert _choose(gpu, local=True, contiguous=False, documents=True) == ('flash', '')
  assert _choose(gpu, local=True, rows=True, q_len=20) == ('flash', '')
  assert _choose(gpu) == ('cudnn', '')
  kernel, why = _choose(gpu, documents=True)
  assert kernel == 'flash' and 'not document ids' in why
  kernel, why = _choose(gpu, rows=True, q_len=21)
  assert kernel == 'flash' and 'even lengths' in why
  # Asked for by name; heads over 256 go to XLA, saying why.
  assert _choose(_cfg(attention='flash', platform='gpu', dtype=jnp.bfloat16)) == ('flash', '')
  kernel, why = _choose(_cfg(platform='gpu', dtype=jnp.bfloat16, hidden_size=1024, num_heads=2),
                        local=True)
  assert kernel == 'blocked' and 'heads of up to 256, not 512' in why
  # In 32-bit, and with attention dropout, 'auto' keeps XLA's kernels.
  assert _choose(_cfg(platform='gpu'), local=True) == ('blocked', '')
  drop = _cfg(platform='gpu', dtype=jnp.bfloat16, attention_dropout_rate=0.1)
  assert _choose(drop, local=True, dropout=True) == ('blocked', '')
  line = attention.describe(_cfg(platform='gpu', dtype=jnp.bfloat16, num_layers=22,
                                 document_mask=True), 1024, 160)
  assert 'global layers 0, 3, ..., 18 (7): flash (Pallas flash attention' in line
  assert 'local layers 1, 2, ..., 20 (14): flash (Pallas flash attention' in line
  assert 'last block (layer 21, global) at its 160 output rows: flash' in line


def test_flash_runs_on_gpus_and_in_the_interpreter_on_cpus_only():
  attention.check_platform(_cfg(attention='flash', platform='gpu', dtype=jnp.bfloat16))
  attention.check_platform(_cfg(attention='flash', platform='cpu'))
  with pytest.raises(ConfigError, match='runs on gpu only'):
    attention.check_platform(_cfg(attention='flash', platform='tpu'))


@pytest.mark.slow
def test_a_modernbert_on_the_flash_kernel_trains_as_the_dense_one():
  # Every layer on the kernel (local ones banded, global ones and the last block at the
  # masked slots with documents apart), after DropToken moved the tokens: the loss and every
  # gradient as the dense model's.
  batch = _modern_batch(160)
  fields = dict(drop_token_rate=0.3, document_mask=True, restart_positions=True)
  dense, fused = (model_lib.mlm_model(_cfg(attention=a, **fields)) for a in ('dense', 'flash'))
  assert {c.kernel for c in attention.plan(fused.cfg, 160, 12)} == {'flash'}
  _assert_trains_as_the_dense_model(fused, dense, batch)


@pytest.mark.slow
def test_documents_apart_compile_to_the_flash_kernel_in_every_layer_for_an_h100(tmp_path):
  from tests.test_preflight import _LONG
  from tests.test_preflight import _preflight
  from tests.test_preflight import _require_compilers
  _require_compilers('h100')
  code, output, r = _preflight(*_LONG, '--config.model.document_mask=True', '--target=h100',
                               tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  assert [c['kernel'] for c in r['attention']['plan']] == ['flash', 'flash', 'flash']
  # Forward, dK/dV and dQ of the 4 layers (the last block's at the masked slots).
  assert r['attention']['fused_calls'] == {'flash': {'expected': 12, 'compiled': 12}}
  assert 'flash calls in the train step: 12 (planned 12)' in output
