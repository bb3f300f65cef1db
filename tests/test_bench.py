"""The benchmark command and the FLOP count behind its MFU."""

import functools
import json
import math
import os
import subprocess
import sys

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from configs import bert_tiny
from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.model import flops as flops_lib
from mlm_jax.perf import bench
from mlm_jax.perf import hf_peer
from mlm_jax.perf import host as host_lib
from mlm_jax.perf import op_breakdown
from tests.conftest import REPO
from tests.conftest import micro_config


def _odd_config():
  """Nothing square: d_ff != 4d, a vocabulary that needs padding, P not a fraction of T."""
  config = bert_tiny.get_config()
  config.data.seq_len = 72
  config.masking.max_predictions = 11
  config.tokenizer.vocab_size = 777
  config.model.num_layers = 3
  config.model.hidden_size = 96
  config.model.num_heads = 3
  config.model.intermediate_size = 200
  return config


def _flops_from_param_shapes(config) -> float:
  """Training FLOPs per token counted from the initialised model's parameter shapes.

  Every matmul weight of a block is used once per token (2 FLOPs forward, 4
  backward); the attention scores QKᵀ and the weighted sum of V each cost
  2·T·(N·H) per token and layer forward, N·H being the query projection's
  output width; the head's transform and the tied embedding run on P of T
  rows, and so does the last block, its key and value projections aside.
  """
  vocab = config.tokenizer.vocab_size
  cfg = model_lib.ModelConfig.from_config(config.model, vocab, tok_lib.padded_vocab_size(vocab),
                                          jnp.float32, platform='cpu')
  t, p = config.data.seq_len, config.masking.max_predictions
  ids, slots = np.zeros((1, t), np.int32), np.zeros((1, p), np.int32)
  batch = {'input_ids': ids, 'segment_ids': ids, 'attention_mask': ids + 1,
           'masked_positions': slots}
  variables = jax.eval_shape(lambda: model_lib.BertForMLM(cfg).init(jax.random.key(0), batch))
  params = flax.traverse_util.flatten_dict(nn.unbox(variables['params']))
  table = params[('encoder', 'embeddings', 'token', 'embedding')].shape       # [V, d]
  d = table[-1]
  last = f'layer_{cfg.num_layers - 1}'

  def rows(path) -> float:  # The share of a token's rows a block kernel's product runs on.
    return p / t if last in path and not {'key', 'value'} & set(path) else 1.0

  kernels = {path: x for path, x in params.items()
             if path[0] == 'encoder' and 'embeddings' not in path and path[-1] == 'kernel'}
  block_flops = sum(6 * x.size * rows(path) for path, x in kernels.items())
  # The query projections' output widths N·H, summed over layers.
  attention_width = sum(x.size / d * rows(path) for path, x in kernels.items() if 'query' in path)
  head_weights = params[('mlm_head', 'transform', 'kernel')].size + math.prod(table)
  return block_flops + 3 * (2 + 2) * t * attention_width + 6 * head_weights * p / t


@pytest.mark.parametrize('get_config', [base.get_config, bert_tiny.get_config, _odd_config],
                         ids=['base', 'bert_tiny', 'odd'])
def test_flops_per_token_matches_the_count_from_parameter_shapes(get_config):
  config = get_config()
  m = config.model
  formula = flops_lib.flops_per_token(
      num_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
      seq_len=config.data.seq_len, max_predictions=config.masking.max_predictions,
      vocab_size=tok_lib.padded_vocab_size(config.tokenizer.vocab_size))
  assert formula == pytest.approx(_flops_from_param_shapes(config), rel=1e-12)


def test_flops_per_token_of_bert_base_by_hand():
  # 6·11·(4·768² + 2·768·3072) + 6·(2·768² + (2·768² + 2·768·3072)·20/128)
  # + 12·768·(11·128 + 20) + 6·(768² + 768·32000)·20/128
  assert flops_lib.flops_per_token(num_layers=12, hidden_size=768, intermediate_size=3072,
                                   seq_len=128, vocab_size=32000, max_predictions=20) == (
                                       467_140_608 + 12_607_488 + 13_160_448 + 23_592_960)
  # The last block on all 128 rows, as Hugging Face's step computes it.
  assert flops_lib.flops_per_token(num_layers=12, hidden_size=768, intermediate_size=3072,
                                   seq_len=128, vocab_size=32000, max_predictions=20,
                                   last_block_rows=128) == (
                                       509_607_936 + 14_155_776 + 23_592_960)


@pytest.mark.parametrize('kind, tflops', [
    ('NVIDIA H100 80GB HBM3', 989), ('NVIDIA H100 PCIe', 756), ('NVIDIA A100-SXM4-80GB', 312),
    ('TPU v4', 275), ('TPU v5 lite', 197), ('TPU v5p', 459), ('TPU v5', 459), ('cpu', None)])
def test_peak_of_known_chips(kind, tflops):
  peak = flops_lib.peak_flops_per_device(kind)
  assert peak == (None if tflops is None else tflops * 1e12)
  assert flops_lib.peak_flops_per_device(kind, peak_tflops=2.5) == 2.5e12


@pytest.mark.slow
def test_bench_tiny_with_hf_comparison(tmp_path):
  """The command on configs/bert_tiny.py: sane figures for both, the same work for both."""
  json_out = tmp_path / 'bench.json'
  cmd = [sys.executable, '-m', 'mlm_jax.bench', '--config=configs/bert_tiny.py',
         '--config.model.num_layers=1', '--config.train.batch_size=8', '--warmup=1',
         '--steps=3', '--repeats=2', '--peak_tflops=1', '--compare=hf',
         f'--json_out={json_out}']
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  for field in ('step time', 'tokens/s', 'MFU', 'compile', 'peak memory',
                'mlm_jax / HF eager tokens/s', 'on all T positions'):
    assert field in out.stdout, out.stdout
  assert 'n/a' not in out.stdout and 'torch.compile' not in out.stdout

  result = json.loads(json_out.read_text())
  # The figures name their host: the report's first line, the whole of it in the JSON.
  assert out.stdout.splitlines()[0] == result['host']['summary']
  assert result['host']['versions']['torch'] and result['host']['cpu']['logical_cores'] >= 1
  b, t = 8, 128
  assert result['tokens_per_step'] == b * t  # Full rows: every token is real.
  assert result['command'].endswith(' '.join(cmd[3:]))
  ours, hf = result['ours'], result['hf']
  for r in (ours, hf):
    assert len(r['step_time_s']['windows']) == 2
    assert 0 < r['step_time_s']['min'] <= r['step_time_s']['median'] <= r['step_time_s']['max']
    assert r['tokens_per_sec'] == pytest.approx(b * t / r['step_time_s']['median'])
    assert 0 < r['mfu'] < 1
    assert r['peak_memory_bytes'] > 0
    # A fresh model on 1000 ids: both losses start near ln(1000).
    assert abs(r['final_loss'] - math.log(1000)) < 0.5
  # The same model, the same masked tokens (19 of P=20 slots of each row).
  assert hf['num_params'] == ours['num_params']
  assert hf['masked_tokens_per_step'] == ours['masked_tokens_per_step'] == b * 19
  assert ours['compile_s'] > ours['lower_s'] > 0
  assert result['ratio_tokens_per_sec'] == pytest.approx(
      ours['tokens_per_sec'] / hf['tokens_per_sec'])
  assert result['ratio_tokens_per_sec_best_window'] == pytest.approx(
      hf['step_time_s']['min'] / ours['step_time_s']['min'])
  assert 'hf_compiled' not in result and 'ratio_tokens_per_sec_compiled' not in result


@pytest.mark.slow
def test_bench_with_torch_compile_peer(tmp_path):
  """--hf_compile: HF eager and compiled both timed, the same losses, a ratio to each."""
  if hf_peer.cxx_compiler() is None:  # Asked here: it imports torch.
    pytest.skip('torch.compile on CPU builds its kernels with a C++ compiler; none on PATH')
  json_out = tmp_path / 'bench.json'
  cmd = [sys.executable, '-m', 'mlm_jax.bench', '--config=configs/bert_tiny.py',
         '--config.model.num_layers=1', '--config.train.batch_size=8',
         '--config.data.seq_len=32', '--config.masking.max_predictions=6', '--warmup=1',
         '--steps=2', '--repeats=2', '--compare=hf', '--hf_compile', f'--json_out={json_out}']
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(json_out.read_text())
  assert 'hf_compile_error' not in result, result['hf_compile_error']
  eager, compiled = result['hf'], result['hf_compiled']
  assert not eager['torch_compile'] and compiled['torch_compile']
  # Compilation happens in the untimed first step, not in the timing windows.
  assert compiled['first_step_s'] > compiled['step_time_s']['max']
  # The same seed, batches and learning rates: compiling changes no result.
  assert compiled['final_loss'] == pytest.approx(eager['final_loss'], rel=1e-3)
  assert compiled['num_params'] == eager['num_params'] == result['ours']['num_params']
  assert result['ratio_tokens_per_sec_compiled'] == pytest.approx(
      result['ours']['tokens_per_sec'] / compiled['tokens_per_sec'])
  assert result['ratio_tokens_per_sec'] == pytest.approx(
      result['ours']['tokens_per_sec'] / eager['tokens_per_sec'])
  assert 'ratio_tokens_per_sec_best_window_compiled' in result
  for line in ('mlm_jax / HF eager tokens/s', 'mlm_jax / HF torch.compile tokens/s',
               '(first step, torch.compile)'):
    assert line in out.stdout, out.stdout
  assert out.stdout.splitlines()[0] == result['host']['summary']


@pytest.mark.slow
def test_torch_compile_that_cannot_run_is_a_note(monkeypatch):
  """Without a C++ compiler the eager comparison stands and one line says why."""
  monkeypatch.setattr(hf_peer, 'cxx_compiler', lambda: None)
  config = micro_config('', '')
  config.model.num_layers = 1
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  result = bench.run_benchmark(config, warmup=1, steps=1, repeats=1, num_batches=1,
                               compare='hf', hf_compile=True)
  assert 'hf_compiled' not in result and 'ratio_tokens_per_sec_compiled' not in result
  note = result['hf_compile_error']
  assert note.startswith('torch.compile did not run') and 'no C++ compiler' in note
  assert '\n' not in note
  report = bench.format_report(result)
  assert note in report.splitlines() and 'mlm_jax / HF eager tokens/s' in report
  assert result['ratio_tokens_per_sec'] > 0 and result['host']['summary'] in report
  with pytest.raises(ConfigError, match='--compare=hf'):
    bench.run_benchmark(config, hf_compile=True)


@pytest.mark.slow
def test_without_a_known_peak_mfu_is_na():
  config = micro_config('', '')
  # The smallest step to compile: one block, no dropout.
  config.model.num_layers = 1
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  result = bench.run_benchmark(config, warmup=1, steps=2, repeats=3, num_batches=2)
  assert jax.default_backend() == 'cpu' and result['ours']['mfu'] is None
  assert result['ours']['tokens_per_sec'] > 0
  assert len(result['ours']['step_time_s']['windows']) == 3
  assert 'MFU' in bench.format_report(result) and 'n/a' in bench.format_report(result)
  with pytest.raises(ConfigError, match='--steps=0'):
    bench.run_benchmark(config, steps=0)


@pytest.mark.slow
def test_a_modernbert_config_is_timed_against_modernbert():
  pytest.importorskip('transformers')
  config = micro_config('', '')
  config.model.num_layers, config.model.variant, config.model.layer_norm_eps = 2, 'modern', 1e-5
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  result = bench.run_benchmark(config, warmup=1, steps=1, repeats=1, num_batches=1, compare='hf',
                               breakdown_steps=3)
  ours, hf = result['ours'], result['hf']
  assert hf['num_params'] == ours['num_params']
  assert hf['masked_tokens_per_step'] == ours['masked_tokens_per_step']
  # Its head, like ours, runs on the masked tokens only; its last block on every row.
  vocab = config.tokenizer.vocab_size
  cfg = model_lib.ModelConfig.from_config(config.model, vocab, tok_lib.padded_vocab_size(vocab),
                                          jnp.float32, platform='cpu')
  t, p = config.data.seq_len, config.masking.max_predictions
  assert result['flops_per_token'] == flops_lib.model_flops_per_token(cfg, t, p)
  assert hf['flops_per_token_as_computed'] == flops_lib.model_flops_per_token(
      cfg, t, p, last_block_rows=t) > result['flops_per_token']
  report = bench.format_report(result)
  assert 'ModernBertForMaskedLM' in report
  # Both steps' time by kind of operation: the matmuls of every part, found in both.
  assert 'Time per step by kind of operation' in report
  breakdown = result['breakdown']
  assert list(breakdown) == [ours['name'], hf['name']]
  for system in breakdown.values():
    seconds = system['seconds']
    assert set(seconds) <= set(op_breakdown.CATEGORIES)
    assert seconds['matmul: MLP'] > 0 and seconds['matmul: MLM head'] > 0
    assert seconds['layer norm'] > 0 and seconds['optimizer update'] > 0
    # Per step, not per trace: within the wall time per step of the traced steps themselves,
    # measured under the tracer and the same load as the breakdown (the timed windows may
    # have run in a quieter moment). Summed over the 3 traced steps, it would be about 3x.
    total = sum(seconds.values())
    assert 0 < total <= 1.25 * system['traced_step_s'], (total, system['traced_step_s'])


def test_concurrent_operations_share_the_wall_time():
  # a alone for 2, a and b together for 2, b alone for 1: 3 and 2.
  shares = op_breakdown._wall_shares([(0, 4, 'a'), (2, 5, 'b')])
  assert shares == {'a': 3.0, 'b': 2.0}
  assert op_breakdown._wall_shares([(0, 1, 'a'), (3, 4, 'a')]) == {'a': 2.0}


def test_asynchronous_operations_run_until_their_completion_event():
  x = lambda name, ts, dur: {'ph': 'X', 'name': name, 'ts': ts, 'dur': dur}
  events = [x('dot.1', 0, 1), x('fusion', 1, 2), x('end: fusion', 2.5, 0.5),   # Synchronous.
            x('end: dot.1', 9, 1),                                         # dot.1 done at 10.
            x('dot.1', 20, 1),                                             # No completion seen.
            x('end: other', 30, 1), x('ThunkExecutor::Execute', 0, 40)]
  got = op_breakdown._op_intervals(events, {'dot.1', 'fusion'})
  assert sorted(got) == [(0, 10, 'dot.1'), (1, 3, 'fusion'), (20, 21, 'dot.1')]


def test_torch_operations_are_sorted_into_the_same_categories():
  assert op_breakdown.categorize_torch('aten::addmm') == 'matmul: other'
  assert op_breakdown.categorize_torch('aten::native_layer_norm_backward') == 'layer norm'
  assert op_breakdown.categorize_torch(
      'aten::_scaled_dot_product_flash_attention_for_cpu') == 'attention (fused kernel)'
  assert op_breakdown.categorize_torch('aten::_foreach_mul_') == 'optimizer update'
  assert op_breakdown.categorize_torch('aten::gelu_backward') == 'GELU / GeGLU'
  assert op_breakdown.categorize_torch('aten::add') == 'other elementwise'
  assert op_breakdown.categorize_torch('autograd::engine::evaluate_function: MmBackward0') is None
  # d=128, d_ff=640, V=1024; B=4, T=128: 512 tokens, not a model width.
  part = functools.partial(op_breakdown._matmul_part, mlp_widths={640}, vocab_sizes={1024},
                           token_counts={4, 128, 512})
  assert part([[512, 128], [128, 128]]) == 'matmul: attention'   # x @ W_q: all d.
  assert part([[20, 128], [128, 1024]]) == 'matmul: MLM head'
  assert part([[512, 128], [128, 640]]) == 'matmul: MLP'


def test_synthetic_rows_are_full_and_masked_by_the_masker():
  config = micro_config('', '')
  batches = bench.synthetic_batches(config, 2)
  ids = batches[0]['input_ids']
  assert ids.shape == (config.train.batch_size, config.data.seq_len)
  specials = bench.SYNTHETIC_SPECIALS
  assert (ids[:, 0] == specials.cls).all() and (ids[:, -1] == specials.sep).all()
  assert batches[0]['attention_mask'].all()
  assert ((ids == specials.mask).sum(axis=1) > 0).all()
  # Between [CLS] and [SEP], only normal ids (the [MASK]s the masker put there aside).
  inner = ids[:, 1:-1][ids[:, 1:-1] != specials.mask]
  assert not np.isin(inner, specials.ids).any()
  assert not np.array_equal(ids, batches[1]['input_ids'])


# Two processors of a Sapphire Rapids part: only the first block is read.
_INTEL_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_vnni avx512_bf16 amx_bf16 amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512_vnni avx512_bf16 amx_bf16 amx_tile
"""

_AMD_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma4 misalignsse
"""


def test_cpuinfo_names_the_model_and_the_vector_extensions():
  intel = host_lib.parse_cpuinfo(_INTEL_CPUINFO)
  assert intel == {'model_name': 'Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz',
                   'vendor': 'GenuineIntel', 'family': None,
                   'extensions': ['AVX2', 'FMA', 'AVX512F', 'AVX512-VNNI', 'AVX512-BF16',
                                  'AMX-TILE', 'AMX-BF16']}
  # fma4 is not FMA (FMA3): flags match whole words.
  amd = host_lib.parse_cpuinfo(_AMD_CPUINFO)
  assert amd == {'model_name': 'AMD EPYC 7B13', 'vendor': 'AuthenticAMD',
                 'family': 'family 25 model 1', 'extensions': ['AVX2']}
  # ARM Linux names no model: the platform's word for it, never None.
  assert host_lib.parse_cpuinfo('processor\t: 0\nFeatures\t: fp asimd\n')['model_name'] is None
  assert host_lib.describe(cpuinfo='')['cpu']['model_name']


def test_host_summary_ties_figures_to_the_cpu_and_libraries():
  summary = host_lib.describe(cpuinfo=_AMD_CPUINFO)['summary']
  assert summary.startswith('AMD EPYC 7B13 (family 25 model 1), ') and ', AVX2, no AVX-512; jax ' in summary
  intel = host_lib.describe(accelerator='NVIDIA H100 80GB HBM3', cpuinfo=_INTEL_CPUINFO)
  assert intel['summary'].startswith('NVIDIA H100 80GB HBM3; host Intel(R) Xeon(R)')
  assert 'AVX512-BF16+AMX-TILE+AMX-BF16; jax' in intel['summary']
  assert intel['versions']['jax'] == jax.__version__
  cpu = intel['cpu']
  assert 1 <= (cpu['usable_cores'] or cpu['logical_cores']) <= cpu['logical_cores']


def test_thread_pools_are_sized_by_the_cpus_this_process_may_use(monkeypatch):
  """taskset, a container's cpuset or a SLURM allocation narrows the affinity mask, not
  os.cpu_count(): HF's threads and our concurrent chains follow the mask (with 2 of 16
  cores usable, 16 PyTorch threads made HF's bert_tiny step about 5x slower)."""
  torch = pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from mlm_jax.interop import torch_mlm
  from mlm_jax.runtime import cores
  from mlm_jax.runtime import platform_ops
  monkeypatch.setattr(os, 'cpu_count', lambda: 16)
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {5}, raising=False)
  assert cores.usable_cores() == 1
  config = bert_tiny.get_config()
  assert platform_ops.concurrent_chains(config.train, 1, 'cpu') == 1
  vocab = config.tokenizer.vocab_size
  cfg = model_lib.ModelConfig.from_config(config.model, vocab, tok_lib.padded_vocab_size(vocab),
                                          jnp.float32, platform='cpu')
  before = torch.get_num_threads()
  try:
    torch_mlm.TorchMLM(config, cfg)
    assert torch.get_num_threads() == 1
  finally:
    torch.set_num_threads(before)
