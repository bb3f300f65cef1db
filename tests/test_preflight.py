"""The pre-flight: target names, compiles for TPU slices and H100s from this CPU, fit and advice.

The compiles need the aot extra (libtpu and XLA's CUDA compiler), which the
dev extra installs; without it these tests are skipped, except under CI,
where a missing compiler is a failure.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.perf import targets
from tests.conftest import REPO


def _require_compilers(*names: str) -> None:
  missing = []
  for name in names:
    try:
      targets.check_compiler(targets.parse(name))
    except targets.TargetError as e:
      missing.append(str(e))
  if missing:
    if os.environ.get('CI'):
      pytest.fail('; '.join(missing))
    pytest.skip('; '.join(missing))


def _preflight(*args: str, tmp_path, **env_vars: str) -> tuple[int, str, dict]:
  out = tmp_path / 'preflight.json'
  # Without the session's compilation cache: an executable compiled for a TPU or GPU target
  # cannot be loaded back on this CPU (each try is a warning and a compile again).
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE='false', **env_vars)
  proc = subprocess.run([sys.executable, '-m', 'mlm_jax.preflight', *args, f'--json_out={out}'],
                        cwd=REPO, capture_output=True, text=True, timeout=1500, env=env)
  report = json.loads(out.read_text()) if out.exists() else {}
  return proc.returncode, proc.stdout + proc.stderr, report


# ------------------------------------------------------------------- names


@pytest.mark.parametrize('name, devices, hosts, topology', [
    ('v4-8', 4, 1, 'v4:2x2x1'),
    ('v4-32', 16, 4, 'v4:2x2x4'),
    ('v4-128', 64, 16, 'v4:4x4x4'),
    ('v5p-128', 64, 16, 'v5p:4x4x4'),
    ('v5litepod-1', 1, 1, 'v5e:1x1'),
    ('v5litepod-8', 8, 1, 'v5e:2x4'),
    ('v5litepod-16', 16, 4, 'v5e:4x4'),
    ('v5litepod-32', 32, 8, 'v5e:4x8'),
    ('v5litepod-256', 256, 64, 'v5e:16x16'),
    ('v6e-8', 8, 1, 'v6e:2x4'),
    ('v6e-64', 64, 16, 'v6e:8x8'),
    ('h100', 1, 1, '1x1x1'),
    ('h100x8', 8, 1, '1x1x8'),
    ('h100x8x4', 32, 4, '4x1x8'),
    ('h100x4x2', 8, 2, '2x1x4'),
    ('A100x8', 8, 1, '1x1x8'),
])
def test_target_names(name, devices, hosts, topology):
  t = targets.parse(name)
  assert (t.num_devices, t.num_hosts, t.topology) == (devices, hosts, topology)


@pytest.mark.parametrize('name', ['v4-7', 'v4-4', 'v4-48', 'v5litepod-3', 'v5litepod-512',
                                  'v6e-2', 'h100x3', 'h100x8x0', 'tpu-8', 'b200x8', ''])
def test_unknown_or_impossible_target_is_one_line_listing_the_known(name):
  with pytest.raises(targets.TargetError) as e:
    targets.parse(name)
  message = str(e.value)
  assert '\n' not in message and 'Known targets' in message and 'v5litepod-N' in message


def test_compile_devices_match_the_slice():
  _require_compilers('v4-32', 'h100x8x4')
  v4 = targets.compile_devices(targets.parse('v4-32'))
  assert len(v4) == 16 and 'v4' in v4[0].device_kind.lower()
  assert len({d.process_index for d in v4}) == 4
  gpus = targets.compile_devices(targets.parse('h100x8x4'))
  assert len(gpus) == 32 and len({d.process_index for d in gpus}) == 4


def test_missing_compiler_names_the_extra(monkeypatch):
  monkeypatch.setattr(targets.importlib.util, 'find_spec', lambda name: None)
  monkeypatch.setattr(targets, '_has_module', lambda name: False)
  for name in ('v4-32', 'h100x8'):
    with pytest.raises(targets.TargetError, match=r"pip install -e '\.\[aot\]'"):
      targets.compile_devices(targets.parse(name))


# ------------------------------------------------------------- bad configs


@pytest.mark.slow
@pytest.mark.parametrize('override, field', [
    ('--config.train.batch_size=250', 'config.train.batch_size=250'),       # 16 devices
    ('--config.model.num_heads=7', 'config.model.num_heads=7'),
    ('--config.data.seq_len=1024', 'config.data.seq_len=1024'),             # table of 512
    ('--config.mesh.fsdp=3', 'config.mesh.fsdp=3'),
])
def test_bad_input_is_one_clear_line_before_any_compile(override, field, tmp_path):
  code, output, report = _preflight('--config=configs/base.py', '--target=v4-32', override,
                                    tmp_path=tmp_path)
  assert code == 2 and not report
  errors = [line for line in output.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and field in errors[0], output[-2000:]
  assert 'Compiling' not in output


# ---------------------------------------------------------------- compiles


@pytest.mark.slow
def test_base_compiles_and_fits_on_h100x8_with_cudnn_attention(tmp_path):
  _require_compilers('h100x8')
  # The shipped defaults, nothing overridden: attention must reach the fused kernel. (A TPU
  # slice's compiler takes minutes for this model on a 2-core host: the TPU compiles below
  # are of the tiny model, test_modern_at_length_compiles_to_splash_attention_on_a_tpu_slice.)
  code, output, r = _preflight('--config=configs/base.py', '--target=h100x8', tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  assert r['ok'] and r['train']['fits'] and r['eval']['fits']
  assert r['target']['num_devices'] == 8 and r['model']['dtype'] == 'bfloat16'
  assert r['model']['attention'] == 'auto'
  # Replicated state: 110M parameters x (param + 2 Adam moments) x 4 bytes on each GPU.
  assert 1.2e9 < r['train']['memory']['state'] < 1.4e9
  assert [c['kernel'] for c in r['attention']['plan']] == ['cudnn', 'cudnn']
  # 12 layers, forward and backward.
  assert r['attention']['fused_calls'] == {'cudnn': {'expected': 24, 'compiled': 24}}
  # Gradients (~200 tensors) are reduced in a few combined buckets, not one by one.
  assert 0 < r['train']['hlo']['collectives']['all-reduce']['count'] <= 16
  # XLA's FLOPs and flops.py's agree within 10% (XLA adds softmax, GELU, the optimizer...).
  assert abs(r['train']['flops'] / r['model_flops_per_device'] - 1) < 0.10
  assert r['estimate'] is None and 'OK: fits' in output  # The estimate is a TPU compiler's.


@pytest.mark.slow
def test_large_compiles_to_cudnn_attention_at_its_shipped_defaults(tmp_path):
  _require_compilers('h100')
  # Its width, heads and every other default; 4 of its 24 layers (the compile takes a minute
  # a few layers on this host; the attention plan is per layer).
  code, output, r = _preflight('--config=configs/large.py', '--target=h100',
                               '--config.model.num_layers=4', '--config.train.batch_size=8',
                               '--config.eval.batch_size=8', tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  assert r['model']['hidden_size'] == 1024 and r['model']['num_layers'] == 4
  assert r['attention']['fused_calls'] == {'cudnn': {'expected': 8, 'compiled': 8}}


_LONG = ('--config=configs/tiny.py', '--config.data.seq_len=1024',
         '--config.model.max_position_embeddings=1024', '--config.train.batch_size=16',
         '--config.eval.batch_size=16')


@pytest.mark.slow
def test_modern_at_length_compiles_to_splash_attention_on_a_tpu_slice(tmp_path):
  _require_compilers('v5p-8')
  # Documents apart: splash takes them as segment ids, in local and global layers.
  code, output, r = _preflight(*_LONG, '--config.model.document_mask=True', '--target=v5p-8',
                               tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  plan = {c['what']: c for c in r['attention']['plan']}
  assert plan['global layers 0']['kernel'] == plan['local layers 1, 2']['kernel'] == 'splash'
  # The last block's queries are the masked slots: no static mask follows them.
  assert 'masked slots' in plan['last block (layer 3, global) at its 160 output rows']['why']
  # Forward, dq and dkv kernels for each of the 3 splash layers.
  assert r['attention']['fused_calls'] == {'splash': {'expected': 9, 'compiled': 9}}
  assert 'splash attention at peak' in output and r['estimate']['splash_s'] > 0
  est = r['estimate']
  # The tiny model at T=1,024 on a v5p-8: 3.5% here (base on v4-32 was over 5%).
  assert est['label'].startswith('compiler estimate') and 0.01 < est['mfu'] < 1.0, est['mfu']
  assert 'compiler estimate, not measured' in output


@pytest.mark.slow
def test_modern_at_length_compiles_to_cudnn_and_flash_kernels_on_a_gpu(tmp_path):
  _require_compilers('h100')
  code, output, r = _preflight(*_LONG, '--target=h100', tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  assert [c['kernel'] for c in r['attention']['plan']] == ['cudnn', 'flash', 'cudnn']
  # cuDNN: forward and backward of 2 global layers; flash: forward, dK/dV, dQ of 2 local ones.
  assert r['attention']['fused_calls'] == {'cudnn': {'expected': 4, 'compiled': 4},
                                           'flash': {'expected': 6, 'compiled': 6}}
  # Local layers in O(T·w): the compiled matmuls (the flash kernels' band of tiles counted
  # from their names) are within a fifth of flops.py's count.
  assert abs(r['train']['flops'] / r['model_flops_per_device'] - 1) < 0.2


@pytest.mark.slow
def test_a_run_in_phases_is_compiled_phase_by_phase(tmp_path):
  # The tiny ModernBERT recipe cut short: T=128 with a growing batch, then T=256 twice.
  code, output, r = _preflight('--config=configs/recipes/modernbert.py:smoke', '--target=h100',
                               tmp_path=tmp_path)
  assert code == 0, output[-3000:]
  assert [p['phase'] for p in r['phases']] == ['pretrain', 'context', 'decay'] and r['ok']
  assert [p['model']['seq_len'] for p in r['phases']] == [128, 256, 256]
  assert "Phase 2/3 'context':" in output and '3 of 3 phases fit on h100.' in output
  # The decay phase changes the schedule and the masking rate of 'context': its eval step is
  # context's program, compiled once; its train step holds the new schedule.
  assert [(p['train']['reused'], p['eval']['reused']) for p in r['phases']] == [
      (False, False), (False, False), (False, True)]
  assert r['phases'][2]['eval']['memory'] == r['phases'][1]['eval']['memory']


def test_asking_for_cudnn_with_attention_dropout_is_refused(tmp_path):
  code, output, _ = _preflight('--config=configs/base.py', '--target=h100x8',
                               '--config.model.attention=cudnn',
                               '--config.model.attention_dropout_rate=0.1', tmp_path=tmp_path)
  assert code == 2 and "attention='cudnn'" in output


@pytest.mark.slow
def test_oversized_batch_is_refused_with_suggestions_that_fit(tmp_path):
  _require_compilers('h100')
  # Every suggestion compiled, however long the compiles take on this machine. JAX given 3%
  # of the H100's memory (2.4 GiB): the limit is a few thousand rows of 128, whose compiles
  # take seconds, not minutes; one of bert_tiny's layers halves each compile and keeps what the
  # search sees (memory in a + b * rows).
  args = ('--config=configs/bert_tiny.py', '--target=h100', '--config.train.batch_size=65536',
          '--config.model.num_layers=1', '--search_budget_s=inf')
  small = {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.03'}
  code, output, r = _preflight(*args, tmp_path=tmp_path, **small)
  assert r['usable_memory_note'].startswith('0.03 of'), r['usable_memory_note']
  assert code == 1 and not r['ok'] and not r['train']['fits'], output[-3000:]
  assert 'FAILED: the train step does not fit' in output
  # The search for the largest batch: converged in at most 5 compiles, on a batch that uses
  # most of the memory (the line through the compiles is straight there: at a few hundred MiB
  # the compiler still reuses buffers, and it bends).
  (search,) = [s for s in r['searches'] if s['step'] == 'train']
  assert search['compiles'] <= 5 and not search['stopped'], search
  fitting = [s for s in r['suggestions'] if s['fits']]
  (largest,) = [s for s in fitting if tuple(s['overrides']) == ('train.batch_size',)]
  assert largest['figures']['per_device_batch'] == search['largest_fitting'], search
  assert largest['figures']['used_fraction'] > 0.45, largest['figures']
  changes = {tuple(s['overrides']) for s in fitting}
  assert ('train.batch_size',) in changes and ('train.grad_accum_steps',) in changes, r['suggestions']
  # Every suggestion was compiled by the search (its figures are the compile's), and is printed
  # as the flags that apply it: the one that accumulates micro-batches among them.
  accumulate, = [s for s in fitting if 'train.grad_accum_steps' in s['overrides']]
  assert accumulate['figures']['used_fraction'] <= 0.9, accumulate['figures']
  flags = ' '.join(f'--config.{k}={v}' for k, v in accumulate['overrides'].items())
  assert 'fits: ' in output and flags in output, output[-3000:]


def test_the_tpu_compilers_refusal_is_read_as_memory():
  from mlm_jax.perf import preflight
  message = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
             'temporaries (132.62G) exceeds available HBM (15.75G).')
  assert preflight._refused_temporaries(message) == int(132.62 * 2**30)
  assert preflight._refused_temporaries('INTERNAL: something else') is None


@pytest.mark.slow
def test_fsdp_splits_the_state_over_the_devices():
  # A GPU node's compiler: the split is the mesh's, whatever the chip (a TPU slice's compiler
  # takes three times as long to say the same).
  _require_compilers('h100x8')
  from configs import bert_tiny
  from mlm_jax.perf import preflight
  config = bert_tiny.get_config()
  config.model.num_layers = 1  # The split is per parameter: one layer has every kind.
  check = preflight.Preflight(config, targets.parse('h100x8'))
  replicated = check.compile({'mesh.fsdp': 1, 'train.batch_size': 8192})
  sharded = check.compile({'mesh.fsdp': 8, 'train.batch_size': 8192})
  # Only the small vectors whose axes are not split (biases, LayerNorm) stay whole.
  ratio = sharded.memory['state'] / replicated.memory['state']
  assert 1 / 8 <= ratio < 1.15 / 8, ratio
  # Activations keep their batch split (1,024 rows per device): temporaries do not
  # grow with fsdp, as they did when XLA gathered the whole batch to each device.
  assert replicated.memory['temporaries'] > 2**20
  assert sharded.memory['temporaries'] < 1.5 * replicated.memory['temporaries']


# -------------------------------------------------------------- on the CPU


@pytest.mark.slow
def test_bf16_train_step_runs_on_cpu(prepared):
  """The accelerator dtype path, run here: bf16 compute, float32 state, loss going down."""
  from mlm_jax.data import masking
  from mlm_jax.data import pipeline as input_pipeline
  from mlm_jax.runtime import sharding
  from mlm_jax.training import build as build_lib
  config, data = prepared
  config = config.copy_and_resolve_references()
  config.model.dtype = 'bfloat16'
  config.model.dropout_rate = 0.0
  config.train.learning_rate = 3e-3
  mesh = sharding.make_mesh(1, jax.devices()[:1])
  built = build_lib.build(config, data.tokenizer.vocab_size, mesh)
  assert built.model_cfg.dtype == jnp.bfloat16
  state = built.init_state()
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.params))
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  batches = input_pipeline.train_batches(
      data.source('train'), masker, global_batch=config.train.batch_size, seed=0, start_step=0,
      process_index=0, process_count=1, prefetch=1, worker_count=0)
  batch = sharding.to_global(next(batches), mesh)
  batches.close()
  losses = []
  for _ in range(8):  # The same batch: the loss must fall.
    state, metrics = built.train_step(state, batch, built.dropout_rng)
    losses.append(float(metrics['loss']))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(state.params))


@pytest.mark.parametrize('t', [128, 512])
@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_attention_with_padding_matches_the_reference(t, dtype, tol):
  """Our XLA attention against softmax(q·kᵀ/√H + mask)·v in float64, rows padded at the end."""
  from mlm_jax import model as model_lib
  rng = np.random.default_rng(t)
  b, n, h = 3, 4, 32
  qkv = [jnp.asarray(rng.normal(size=(b, t, n, h)), dtype) for _ in range(3)]
  q, k, v = (np.asarray(x, np.float64) for x in qkv)  # The same (rounded) inputs.
  lengths = np.array([t, t // 2 + 3, 5])
  key_mask = np.arange(t)[None] < lengths[:, None]
  out = model_lib.softmax_attention(*qkv, jnp.asarray(key_mask))
  scores = np.einsum('bqnh,bknh->bnqk', q, k) / np.sqrt(h)
  scores = np.where(key_mask[:, None, None, :], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum('bnqk,bknh->bqnh', weights, v)
  np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, rtol=tol)


def test_sizing_table_is_written_from_its_json_and_names_the_cells_still_missing(tmp_path):
  from mlm_jax.perf import sizing  # pylint: disable=import-outside-toplevel
  gib = 2**30
  results = {
      'base-128@v4-32': {'cell': 'base-128@v4-32', 'model': 'base', 'seq_len': 128,
                         'target': 'v4-32', 'num_devices': 16, 'fits': True,
                         'per_device_batch': 352, 'global_batch': 5632, 'memory': 26 * gib,
                         'used_fraction': 26 / 32, 'attention': 'jax_xla',
                         'estimate': {'step_time_s': 0.25, 'tokens_per_sec': 2.9e6,
                                      'mfu': 0.41}},
      'large-512@h100': {'cell': 'large-512@h100', 'model': 'large', 'seq_len': 512,
                         'target': 'h100', 'num_devices': 1, 'fits': False}}
  json_path = tmp_path / 'sizing.json'
  json_path.write_text(json.dumps({'results': results, 'meta': {
      'date': '2026-11-24', 'versions': {'jax': '0.10.2'}}}))
  with pytest.raises(Exception, match='unknown cells'):
    sizing.run(str(tmp_path / 'sizing.md'), ['base-64@v4-32'])
  sizing.run(str(tmp_path / 'sizing.md'), [], compile_missing=False)   # Compiles nothing.
  table = (tmp_path / 'sizing.md').read_text()
  assert 'Made on 2026-11-24 with jax 0.10.2.' in table
  assert ('| base | 128 | v4-32 | 16 | 352 (5,632) | 26.0 GiB (81%) | jax_xla | 250 ms | '
          '2,900,000 | 41% |') in table
  assert '| large | 512 | h100 | 1 | does not fit at 1 row |' in table
  assert f'Not computed yet ({len(sizing.cells()) - 2} of {len(sizing.cells())} cells' in table
  assert 'base-512@v4-32' in table and 'base-128@v4-32,' not in table


# ------------------------------------------------- the largest batch that fits


def _fake_check(memory_of_rows, usable=16 * 2**30, budget=60.0, unit=1, seq_len=128):
  """A Preflight whose compiles are a memory model: bytes per device of `rows` rows."""
  from configs import bert_tiny
  from mlm_jax.perf import preflight
  config = bert_tiny.get_config()
  config.data.seq_len = seq_len
  config.train.grad_accum_steps = unit
  check = preflight.Preflight.__new__(preflight.Preflight)
  check.config, check.target = config, targets.parse('v5litepod-1')
  check.usable_memory, check.log = usable, lambda s: None
  check.search_budget_s, check._search_spent = budget, 0.0
  compiled = []

  def compile(overrides=None, step='train'):
    rows = (overrides or {})['train.batch_size' if step == 'train' else 'eval.batch_size']
    compiled.append(rows)
    total = int(memory_of_rows(rows))
    return preflight.StepFigures(
        step=step, global_batch=rows, per_device_batch=rows, grad_accum_steps=unit, fsdp=1,
        memory={'total': total, 'state': 2**30, 'program': 0}, usable_memory=usable,
        compile_s=0.0, flops=None, flops_source='', hlo={}, xla_cost={})

  check.compile = compile
  return check, compiled


@pytest.mark.parametrize('memory', [
    lambda rows: 3 * 2**30 + rows * 9 * 2**20,                     # linear
    lambda rows: 3 * 2**30 + rows ** 0.93 * 14 * 2**20,            # buffers reused: slower
    lambda rows: 3 * 2**30 + rows * 9 * 2**20 + (rows > 900) * 2**30,  # a step at 900 rows
])
def test_largest_batch_is_found_in_a_few_compiles_and_is_the_largest_that_fits(memory):
  check, compiled = _fake_check(memory)
  limit = 0.9 * check.usable_memory
  search = check.largest_batch({'train.batch_size': 131072})
  assert search.compiles == len(compiled) <= 4 and not search.stopped, compiled
  best = search.best.per_device_batch
  assert memory(best) <= limit
  # The largest multiple of 8 rows that fits, within the stated 5%.
  assert memory(int(best * 1.05 / 8 + 1) * 8) > limit or memory(best) > 0.95 * limit, compiled


def test_a_spent_search_budget_stops_after_the_first_prediction_with_its_bounds():
  from mlm_jax.perf import preflight
  # Memory that grows faster at large batches than the small compiles say.
  check, compiled = _fake_check(lambda rows: 3 * 2**30 + rows ** 1.1 * 8 * 2**20, budget=0.0)
  check._search_spent = 1.0
  search = check.largest_batch({'train.batch_size': 131072},
                               refused=check.compile({'train.batch_size': 131072}))
  assert compiled[:3] == [131072, 16, 32] and search.compiles == 3
  best = compiled[3]       # The line through 32 rows and the refused 8192 is conservative.
  assert search.best.per_device_batch == best and search.too_big == 131072
  assert best < search.predicted < 131072 and 'search_budget_s' in search.stopped
  line = preflight._search_line(search.as_dict())
  assert ('3 compiles' in line and f'{best} rows per device fit (compiled)' in line
          and f'predicts {search.predicted} (not compiled)' in line
          and '131072 do not fit' in line), line


def test_the_search_keeps_micro_batches_whole():
  check, compiled = _fake_check(lambda rows: 2**30 + rows // 4 * 40 * 2**20, unit=4)
  search = check.largest_batch({'train.batch_size': 4096, 'train.grad_accum_steps': 4})
  assert compiled[:2] == [64, 128] and all(rows % 4 == 0 for rows in compiled)
  assert search.best.per_device_batch % 4 == 0


def test_suggestions_left_uncompiled_by_the_budget_say_so():
  from mlm_jax.perf import preflight
  check, compiled = _fake_check(lambda rows: 3 * 2**30 + rows * 9 * 2**20, budget=0.0)
  check._search_spent = 1.0
  first = check.compile({'train.batch_size': 131072})
  search, changes = check.suggestions(first)
  # The refused step, the two small ones and the prediction, which fits: the search is done.
  assert len(compiled) == 4 and not search.stopped
  (what, largest), (accumulate, uncompiled) = changes
  assert largest.per_device_batch == 1296 and largest.fits
  assert 'in 128 micro-batches of 1024 rows' in accumulate and uncompiled is None, accumulate
  entry = preflight._suggestion(accumulate, uncompiled, check._changed)
  assert entry['fits'] is None and entry['figures'] is None


def test_when_the_small_compiles_do_not_fit_the_search_goes_down_to_one_row():
  check, compiled = _fake_check(lambda rows: 15 * 2**30 + rows * 2**20)
  assert check.largest_batch({'train.batch_size': 4096}).best is None
  assert compiled == [16, 1]
  check, compiled = _fake_check(lambda rows: 14 * 2**30 + rows * 40 * 2**20)
  search = check.largest_batch({'train.batch_size': 4096})
  assert compiled[:2] == [16, 1] and search.best.per_device_batch in (9, 10), compiled


def test_a_compiler_failure_is_one_line_naming_the_step_and_a_known_fix():
  from mlm_jax.perf import preflight
  message = ("INTERNAL: Couldn't find output tile sizes that satisfy hlo: %dot.1098 = "
             'bf16[29472,768]{1,0} dot(...)\n\tSymbolic tile with\n')
  line = preflight._compiler_failure(message, 'train', 'h100', 307)  # pylint: disable=protected-access
  assert '\n' not in line
  assert line.startswith("the compiler for h100 failed on the train step: INTERNAL: Couldn't "
                         'find output tile sizes')
  assert ('config.masking.max_predictions=307 has no tiling there: round it up to a multiple '
          'of 8 (312') in line


def test_a_micro_batched_steps_flops_difference_names_the_loop_xla_counts_once():
  """XLA's cost analysis counts a while loop's body once: a step in k micro-batches reports
  about one micro-batch's FLOPs, and the report says so with k times the figure."""
  from configs import bert_tiny
  from mlm_jax.perf import preflight
  check = preflight.Preflight.__new__(preflight.Preflight)
  check.config = bert_tiny.get_config()
  check.model_flops_per_device = lambda figures: 64e12
  figures = preflight.StepFigures(
      step='train', global_batch=4608, per_device_batch=1152, grad_accum_steps=32, fsdp=1,
      memory={}, usable_memory=1, compile_s=0.0, flops=1.8e12,
      flops_source="XLA's cost analysis", hlo={}, xla_cost={})
  assert ("XLA's cost analysis counts the loop over the 32 micro-batches once: its figure is "
          "about one micro-batch's (32x is 57.6 T)") in check.explain_flops(figures)
  figures.grad_accum_steps, figures.flops = 1, 70e12
  assert 'micro-batch' not in check.explain_flops(figures)


def test_a_micro_batched_step_plans_its_fused_calls_once_per_micro_batch():
  """The accumulation loop runs each layer's kernels once per micro-batch, and the compiled
  count follows the loop's trip count: 2 splash layers x 3 kernels x 4 micro-batches."""
  import types

  from mlm_jax.perf import preflight
  check = preflight.Preflight.__new__(preflight.Preflight)
  check._attention_plan = lambda: [types.SimpleNamespace(kernel='splash', layers=(0, 3),
                                                         what='global layers 0, 3', why='')]
  figures = preflight.StepFigures(
      step='train', global_batch=64, per_device_batch=16, grad_accum_steps=4, fsdp=1,
      memory={}, usable_memory=1, compile_s=0.0, flops=None, flops_source='',
      hlo={'splash_attention_calls': 24}, xla_cost={})
  assert check.attention_report(figures)['fused_calls'] == {
      'splash': {'expected': 24, 'compiled': 24}}


def test_a_loop_whose_count_the_data_sets_runs_as_often_as_told():
  """A batch warm-up's accumulation is a loop to a count the step's data gives: the HLO counts
  cannot read it, and take it as `unknown_trips` (the pre-flight: the full batch's k);
  scan-like loops keep their own count."""
  import jax
  import jax.numpy as jnp

  from mlm_jax.perf import hlo_cost
  w = jnp.ones((64, 64))
  step = lambda i, y: jnp.tanh(y @ w)
  data = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, step, x)).lower(
      jnp.ones((8, 64)), 3).compile().as_text()
  fixed = jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, x)).lower(
      jnp.ones((8, 64))).compile().as_text()
  one = 2 * 8 * 64 * 64
  assert hlo_cost.summary(data)['matmul_flops'] == one
  assert hlo_cost.summary(data, unknown_trips=4)['matmul_flops'] == 4 * one
  assert hlo_cost.summary(fixed)['matmul_flops'] == hlo_cost.summary(
      fixed, unknown_trips=4)['matmul_flops'] == 5 * one


def test_a_loops_matmuls_and_collectives_count_once_per_iteration():
  """Each iteration of a loop over a sharded row: one matmul, one all-reduce (the body's,
  not the loop instruction's too)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec

  from mlm_jax.perf import hlo_cost
  mesh = jax.make_mesh((8,), ('rows',))
  x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, PartitionSpec('rows')))
  w = jnp.ones((64, 64))
  step = lambda i, y: jnp.tanh(y @ w) + jnp.sum(y)
  summary = hlo_cost.summary(
      jax.jit(lambda x: jax.lax.fori_loop(0, 5, step, x)).lower(x).compile().as_text())
  assert summary['collectives']['all-reduce']['count'] == 5
  assert summary['matmul_flops'] == 5 * 2 * 64 * 64   # A row per device.
