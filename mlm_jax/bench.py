"""Command line: python -m mlm_jax.bench --config=configs/base.py [--compare=hf].

Times the jitted train step of a config and prints the median step time,
tokens/s, MFU, compile time and peak memory; --compare=hf times Hugging
Face's model of the same architecture (BertForMaskedLM or
ModernBertForMaskedLM) on the same batches in the same process, with
--hf_compile both eager and under torch.compile; --json_out keeps every
figure and the host they were measured on. Any config field can be
overridden, e.g. --config.train.batch_size=8. See mlm_jax/perf/bench.py and docs/benchmarks.md.

--seq_lens=1024,4096,8192 times the config at each row length instead, with
--tokens_per_batch tokens per batch, beside one attention layer of each kind
(mlm_jax/perf/scaling.py).
"""

from __future__ import annotations

import json
import math
import shlex
import sys

from absl import flags

from mlm_jax import cli
from mlm_jax.errors import ConfigError
from mlm_jax.perf import bench
from mlm_jax.perf import scaling

_CONFIG = cli.config_flag()
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps after compilation.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Steps per timing window.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timing windows; the median window is reported.')
_NUM_BATCHES = flags.DEFINE_integer('num_batches', 4, 'Distinct synthetic batches, cycled.')
_PEAK_TFLOPS = flags.DEFINE_float(
    'peak_tflops', 0.0, 'Peak TFLOP/s of one device for MFU (0: config.profile.peak_tflops, '
    'else the chip table in mlm_jax/runtime/hardware.py; an unknown chip, e.g. a CPU, gets no MFU).')
_COMPARE = flags.DEFINE_enum('compare', '', ['', 'hf'],
                             "'hf': also time Hugging Face's model of the same architecture "
                             '(BertForMaskedLM or ModernBertForMaskedLM, PyTorch).')
_HF_COMPILE = flags.DEFINE_bool(
    'hf_compile', False, 'With --compare=hf: time HF both eager and under torch.compile (its '
    'compile time apart; a failure, e.g. no C++ compiler on CPU, is noted, not fatal).')
_BREAKDOWN = flags.DEFINE_integer(
    'breakdown', 0, 'After the timed windows, trace this many more steps of ours '
    '(jax.profiler) and of eager HF (torch.profiler, with --compare=hf) and print their time '
    'by kind of operation (matmuls by part, softmax, layer norm, GELU, gathers, optimizer, '
    'copies); 0: none.')
_JSON_OUT = flags.DEFINE_string('json_out', '', 'Also write all figures to this JSON file.')
_SEQ_LENS = flags.DEFINE_list(
    'seq_lens', [], 'Row lengths to time the config at, each in its own process, with '
    '--tokens_per_batch tokens per batch, beside one local and one global attention layer '
    '(mlm_jax/perf/scaling.py); empty: the config as it is.')
_TOKENS_PER_BATCH = flags.DEFINE_integer(
    'tokens_per_batch', 0, 'With --seq_lens: tokens per batch at every length (0: the longest '
    'length, one row).')
_SCALING_FLAGS = ('--seq_lens', '--tokens_per_batch', '--json_out')


def main() -> int:
  if _SEQ_LENS.value:
    return _scaling()
  result = bench.run_benchmark(
      _CONFIG.value, warmup=_WARMUP.value, steps=_STEPS.value, repeats=_REPEATS.value,
      num_batches=_NUM_BATCHES.value, peak_tflops=_PEAK_TFLOPS.value, compare=_COMPARE.value,
      hf_compile=_HF_COMPILE.value, breakdown_steps=_BREAKDOWN.value, log=_log)
  _report(result, bench.format_report)
  systems = [k for k in ('ours', *bench.PEERS) if k in result]
  if not all(math.isfinite(result[k]['final_loss']) for k in systems):
    print('error: a loss is not finite', file=sys.stderr)
    return 1
  return 0


def _scaling() -> int:
  """--seq_lens: the config at each row length (perf/scaling.py)."""
  try:
    seq_lens = [int(t) for t in _SEQ_LENS.value]
  except ValueError:
    raise ConfigError(f'--seq_lens={",".join(_SEQ_LENS.value)}: give row lengths, e.g. '
                      '1024,4096,8192.') from None
  tokens = _TOKENS_PER_BATCH.value or max(seq_lens)
  # The same command at each length, less the flags that ask for the sweep.
  argv = [a for a in sys.argv[1:] if not a.startswith(_SCALING_FLAGS)]
  result = scaling.run(argv, _CONFIG.value, seq_lens, tokens, log=_log)
  _report(result, scaling.format_report)
  return 1 if any('error' in r for r in result['rows']) else 0


def _log(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _report(result: dict, format_report) -> None:
  """Prints the result's table; with --json_out also writes every figure and the command."""
  result['command'] = shlex.join(['python', '-m', 'mlm_jax.bench', *sys.argv[1:]])
  print(format_report(result), flush=True)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, 'w') as f:
      json.dump(result, f, indent=2)
    print(f'Wrote {_JSON_OUT.value}', flush=True)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True)
