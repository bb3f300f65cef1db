"""The benchmark (python -m mlm_jax.bench): our train step, timed.

Times the jitted train step of a config and prints the median step time,
tokens/s, MFU (flops.py's count of model FLOPs over the chip's peak), compile
time and peak memory; --json_out also writes every figure. Any config field can
be overridden, e.g. --config.train.batch_size=8.

No data is prepared: the rows are full [CLS] ... [SEP] rows (no padding) of
random ids that are no special token's, masked by the real masker, so every
step holds B·T real tokens. The special ids are those of the tokenizers
trained here (SYNTHETIC_SPECIALS), whose size is config.tokenizer.vocab_size.
A few distinct batches are put on the devices before timing and cycled; the
state is donated as in the trainer.

With --compare=hf the same model shape (layers, widths, padded vocabulary),
batch, masked positions and optimizer (AdamW, same hyper-parameters, clipping
and weight-decay mask) run through Hugging Face's model of the same
architecture in PyTorch (`BertForMaskedLM` for variant 'bert',
`RobertaForMaskedLM` for 'roberta', `ModernBertForMaskedLM` for 'modern';
interop/torch_mlm.py) in the same
process: float32 eager on CPU; on a GPU bf16 autocast (when our
compute dtype is bf16), SDPA attention and `torch.compile`. With --hf_compile
HF runs twice, eager and under `torch.compile`, on either device; if
torch.compile cannot run, a one-line note says why and the rest stands.
Timing windows of all systems alternate, so all see the same machine load.

Every result carries `host` (host.py): the CPU, its cores and vector
extensions and the library versions, since a CPU figure holds for one CPU.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from typing import Any
from typing import Callable

import jax
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.config import checks
from mlm_jax.data import masking
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.interop import hf as hf_lib
from mlm_jax.model import flops as flops_lib
from mlm_jax.perf import hf_peer
from mlm_jax.perf import host as host_lib
from mlm_jax.perf import op_breakdown
from mlm_jax.runtime import host_malloc
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from mlm_jax.training import optimizer

# What HF's step computes that ours does not: its last block on every row, and
# by variant its head: BertForMaskedLM's and RobertaForMaskedLM's on all T
# positions, ModernBertForMaskedLM's (sparse_prediction) on the masked tokens only.
_LAST_BLOCK_NOTE = (' HF computes its last block on every row, ours on the masked slots only '
                    '(the rows the loss reads; every other row\'s output would be discarded). '
                    'MFU counts the same model FLOPs (last block and head on P slots) for both.')
_DENSE_HEAD_NOTE = ('HF computes its MLM head (dense + LayerNorm + vocabulary projection) on all '
                    'T positions of a row, ours on the P gathered masked slots only: that is '
                    "HF's design and part of this comparison." + _LAST_BLOCK_NOTE)
_HF_HEAD_NOTE = {
    'bert': _DENSE_HEAD_NOTE,
    'roberta': _DENSE_HEAD_NOTE,
    'modern': ('HF computes its MLM head on the masked tokens only (sparse_prediction), as '
               'ours does on the P gathered slots.' + _LAST_BLOCK_NOTE),
}


# ------------------------------------------------------------------ batches

# The special ids of the tokenizers trained here ([PAD] [UNK] [CLS] [SEP] [MASK] = 0-4), which
# a config without a tokenizer file gets; the benchmark has no tokenizer of its own.
SYNTHETIC_SPECIALS = sp_tokenizer.SPECIALS


# Mean document length of synthetic packed rows (with config.model.document_mask).
SYNTHETIC_DOCUMENT = 512


def synthetic_batches(config: ml_collections.ConfigDict,
                      num_batches: int) -> list[dict[str, np.ndarray]]:
  """`num_batches` masked global batches of full rows: input_ids [B, T], masked_* [B, P]...

  Token ids are drawn uniformly from the ids of [0, vocab) that are not
  SYNTHETIC_SPECIALS'; random replacements are uniform too (no corpus, hence
  no unigram counts), and every piece is a word (whole-word masking). With
  config.model.document_mask the rows are packed documents: a [SEP] closes
  one about every SYNTHETIC_DOCUMENT tokens (at random), so the document
  mask has documents to keep apart.
  """
  vocab, b, t = config.tokenizer.vocab_size, config.train.batch_size, config.data.seq_len
  specials = SYNTHETIC_SPECIALS
  # Equal counts make the 'unigram' source uniform; 'uniform' ignores them.
  masker = masking.make_masker_for_ids(
      config.masking, vocab, np.ones(vocab), specials,
      word_start=np.ones(vocab, bool) if config.masking.mode == 'whole_word' else None)
  normal = np.setdiff1d(np.arange(vocab), specials.ids)
  rng = np.random.default_rng(config.seed)
  batches = []
  for i in range(num_batches):
    ids = rng.choice(normal, (b, t))
    if config.model.document_mask:
      ids[rng.random((b, t)) < 1 / SYNTHETIC_DOCUMENT] = specials.sep
    ids[:, 0], ids[:, -1] = specials.cls, specials.sep
    batches.append(masker(ids, seed=config.seed, step=i, rows=np.arange(i * b, (i + 1) * b)))
  return batches


# ---------------------------------------------------------------- ours (JAX)


class _JaxRunner:
  """Our train step: compiled once (timed), then run in windows on device-resident batches."""

  def __init__(self, config: ml_collections.ConfigDict, host_batches: list[dict[str, np.ndarray]]):
    self.timed = hf_peer.Timed('mlm_jax (JAX)')
    mesh = sharding.make_mesh(config.mesh.fsdp)
    # The embedding rows the trainer builds: a checkpoint's table (config.model.vocab_size),
    # else the tokenizer's size.
    vocab_size = tok_lib.model_vocab_size(config.model.vocab_size, config.tokenizer.vocab_size)
    built = build_lib.build(config, vocab_size, mesh)
    self.model_cfg, self._state, step = built.model_cfg, built.init_state(), built.train_step
    self.chains, self.attention = built.chains, built.attention
    self._rng = jax.device_put(built.dropout_rng, sharding.replicated(mesh))
    self._batches = [sharding.to_global(b, mesh) for b in host_batches]
    start = time.perf_counter()
    lowered = step.lower(self._state, self._batches[0], self._rng)
    lowered_s = time.perf_counter() - start
    self._step = lowered.compile()
    self.timed.info.update(
        lower_s=lowered_s, compile_s=time.perf_counter() - start,
        num_params=sum(x.size for x in jax.tree_util.tree_leaves(self._state.params)),
        num_devices=mesh.size, mesh_shape=dict(mesh.shape))
    self._i = 0
    self._metrics = None

  def run(self, steps: int) -> float:
    """Runs `steps` steps; returns their wall time, the last one finished on device."""
    start = time.perf_counter()
    for _ in range(steps):
      batch = self._batches[self._i % len(self._batches)]
      self._state, self._metrics = self._step(self._state, batch, self._rng)
      self._i += 1
    jax.block_until_ready((self._state, self._metrics))
    return time.perf_counter() - start

  def compiled_text(self) -> str:
    return self._step.as_text()

  def finish(self) -> None:
    metrics = jax.device_get(self._metrics)
    self.timed.info.update(final_loss=float(metrics['loss']),
                           masked_tokens_per_step=float(metrics['num_masked']))


# ------------------------------------------------------------------ figures


def _peak_memory(devices) -> tuple[int, str]:
  """Largest device peak_bytes_in_use, else the process's peak RSS (CPU backends)."""
  stats = [d.memory_stats() for d in devices]
  if all(s and 'peak_bytes_in_use' in s for s in stats):
    return max(s['peak_bytes_in_use'] for s in stats), 'device (peak_bytes_in_use)'
  return hf_peer.host_peak_rss(), 'host peak RSS of the process'


def _summarise(timed: hf_peer.Timed, tokens_per_step: float, flops_per_token: float,
               peak_per_device: float | None, num_devices: int) -> dict[str, Any]:
  median = statistics.median(timed.window_step_s)
  tokens_per_sec = tokens_per_step / median
  return {
      'name': timed.name,
      'step_time_s': {'median': median, 'min': min(timed.window_step_s),
                      'max': max(timed.window_step_s), 'windows': timed.window_step_s},
      'tokens_per_sec': tokens_per_sec,
      'mfu': flops_lib.mfu(tokens_per_sec, flops_per_token, peak_per_device, num_devices),
      **timed.info,
  }


# ----------------------------------------------------------- peers (torch)

# Result keys of HF's runs; a key's ratios are named 'ratio_tokens_per_sec' + its suffix.
PEERS = {'hf': '', 'hf_compiled': '_compiled'}


def _warm_peer(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig,
               host_batches: list[dict[str, np.ndarray]], lrs: np.ndarray, warmup: int,
               use_gpu: bool, compiled: bool, log: Callable[[str], None]) -> hf_peer.TorchRunner:
  peer = hf_peer.TorchRunner(config, model_cfg, host_batches, lrs, use_gpu, compiled)
  log(f'Warming up {peer.timed.name} on {peer.timed.info["device"]}...')
  # torch.compile compiles here: kept apart from the timed windows.
  peer.timed.info['first_step_s'] = peer.run(1)
  if warmup > 1:
    peer.run(warmup - 1)
  return peer


def _hf_peers(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig,
              host_batches: list[dict[str, np.ndarray]], warmup: int, repeats: int, steps: int,
              use_gpu: bool, hf_compile: bool,
              log: Callable[[str], None]) -> tuple[dict[str, hf_peer.TorchRunner], str | None]:
  """HF's runs by result key, warmed up, and why torch.compile did not run, if it did not."""
  # The learning rates our schedule gives at each step (it matters little for speed).
  schedule = optimizer.learning_rate_schedule(config.train)
  lrs = np.asarray(schedule(np.arange(max(warmup, 1) + repeats * steps + 1)))
  warm = functools.partial(_warm_peer, config, model_cfg, host_batches, lrs, warmup, use_gpu,
                           log=log)
  # Alone, HF runs as it is usually run on the device (compiled on GPU only);
  # --hf_compile asks for both, so then the first run is eager everywhere.
  peers = {'hf': warm(compiled=use_gpu and not hf_compile)}
  if not hf_compile:
    return peers, None
  try:
    peers['hf_compiled'] = warm(compiled=True)
  except Exception as e:  # pylint: disable=broad-except
    # torch.compile fails in many ways (no compiler, an op it cannot trace, a
    # backend bug); the eager comparison stands without it.
    first_line = (str(e).strip().splitlines() or [''])[0][:200]
    return peers, (f'torch.compile did not run, HF timed eager only: '
                   f'{type(e).__name__}: {first_line}')
  return peers, None


# ---------------------------------------------------------------- benchmark


def run_benchmark(config: ml_collections.ConfigDict, *, warmup: int = 3, steps: int = 10,
                  repeats: int = 5, num_batches: int = 4, peak_tflops: float = 0.0,
                  compare: str = '', hf_compile: bool = False, breakdown_steps: int = 0,
                  log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
  """Times our train step (and HF's with compare='hf'); returns every figure as a dict.

  With hf_compile (only with compare='hf'), HF runs both eager and under
  torch.compile; a torch.compile that fails leaves 'hf_compile_error' in the
  result instead of 'hf_compiled'.
  With breakdown_steps > 0, that many more steps of each (eager HF
  only) are traced and their time split by kind of operation
  (op_breakdown.py) into result['breakdown'].
  """
  _check(config, warmup=warmup, steps=steps, repeats=repeats, num_batches=num_batches,
         compare=compare, hf_compile=hf_compile)
  host_batches = synthetic_batches(config, num_batches)
  tokens_per_step = float(np.mean([b['attention_mask'].sum() for b in host_batches]))

  log('Compiling our train step...')
  ours = _JaxRunner(config, host_batches)
  model_cfg = ours.model_cfg
  backend = jax.default_backend()
  device_kind = jax.devices()[0].device_kind
  ours.run(max(warmup, 1))  # At least one step: the steady-state memory peak.
  ours.timed.info['peak_memory_bytes'], ours.timed.info['memory_kind'] = (
      _peak_memory(jax.local_devices()))
  peers, compile_error = {}, None
  if compare == 'hf':
    use_gpu = backend == 'gpu' and hf_lib.require('torch').cuda.is_available()
    peers, compile_error = _hf_peers(config, model_cfg, host_batches, warmup, repeats, steps,
                                     use_gpu, hf_compile, log)
  runners = [ours, *peers.values()]

  log(f'Timing {repeats} windows of {steps} steps{" each, alternating" if peers else ""}...')
  for _ in range(repeats):
    for runner in runners:
      runner.timed.window_step_s.append(runner.run(steps) / steps)
  for runner in runners:
    runner.finish()
  breakdown = {}
  if breakdown_steps:
    log(f'Tracing {breakdown_steps} steps of each, by kind of operation...')
    breakdown[ours.timed.name] = op_breakdown.jax_breakdown(ours.compiled_text(), ours.run,
                                                            breakdown_steps)
    if 'hf' in peers:
      d_ff = model_cfg.intermediate_size
      breakdown[peers['hf'].timed.name] = op_breakdown.torch_breakdown(
          peers['hf'].run, breakdown_steps, mlp_widths={d_ff, 2 * d_ff},
          vocab_sizes={model_cfg.vocab_size, model_cfg.padded_vocab_size},
          token_counts=_token_counts(config, peers['hf'].timed.info['masked_tokens_per_step']))

  # A CPU counts as one device however many XLA host devices it is split into.
  physical_devices = 1 if backend == 'cpu' else ours.timed.info['num_devices']
  peak = flops_lib.peak_flops_per_device(device_kind, peak_tflops or config.profile.peak_tflops)
  flops_per_token = flops_lib.model_flops_per_token(model_cfg, config.data.seq_len,
                                                    config.masking.max_predictions)
  result = {
      'host': host_lib.describe(accelerator=None if backend == 'cpu' else device_kind),
      'machine': _machine(backend, device_kind, compare),
      'shape': _shape(config, model_cfg) | {'concurrent_chains': ours.chains},
      'attention': ours.attention,
      'timing': {'warmup': warmup, 'steps': steps, 'repeats': repeats, 'num_batches': num_batches},
      'tokens_per_step': tokens_per_step,
      'flops_per_token': flops_per_token,
      'peak_flops_per_device': peak,
      'ours': _summarise(ours.timed, tokens_per_step, flops_per_token, peak, physical_devices),
  }
  for key, peer in peers.items():
    # The chip's peak applies to HF only if it runs on the same kind of device.
    same_chip = (peer.timed.info['device'] == 'cuda') == (backend == 'gpu')
    result[key] = _peer_summary(config, model_cfg, peer, tokens_per_step, flops_per_token,
                                peak if same_chip else None)
    result.update(_ratios(result['ours'], result[key], physical_devices, PEERS[key]))
  if peers:
    result['ratio_basis'] = 'per device' if physical_devices > 1 else 'total'
  if compile_error:
    result['hf_compile_error'] = compile_error
  if breakdown:
    result['breakdown'] = breakdown
  return result


def _check(config: ml_collections.ConfigDict, *, warmup: int, steps: int, repeats: int,
           num_batches: int, compare: str, hf_compile: bool) -> None:
  """ConfigError for what the benchmark cannot run, before anything compiles."""
  for name, value, least in (('warmup', warmup, 0), ('steps', steps, 1), ('repeats', repeats, 1),
                             ('num_batches', num_batches, 1)):
    if value < least:
      raise ConfigError(f'--{name}={value} must be at least {least}.')
  if hf_compile and compare != 'hf':
    raise ConfigError('--hf_compile compiles the HF peer: add --compare=hf.')
  if compare == 'hf':
    # JAX would otherwise reserve most of a GPU's memory before torch gets any
    # (read when JAX first touches a device, so it must be set before).
    os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  checks.validate(config, num_devices=jax.device_count())
  if config.sentence_pair.task != 'none':
    raise ConfigError(
        f'config.sentence_pair.task={config.sentence_pair.task!r}: the benchmark times the MLM '
        "objective only (as Hugging Face's ...ForMaskedLM); leave it 'none'.")


def _peer_summary(config: ml_collections.ConfigDict, model_cfg: Any, peer: Any,
                  tokens_per_step: float, flops_per_token: float,
                  peak: float | None) -> dict[str, Any]:
  """A Hugging Face peer's figures, with the FLOPs its step computes as it computes them."""
  summary = _summarise(peer.timed, tokens_per_step, flops_per_token, peak, 1)
  # What HF's step computes: its last block on all T rows, and BERT's (RoBERTa's)
  # head on all T positions (P = T).
  seq_len = config.data.seq_len
  summary['flops_per_token_as_computed'] = flops_lib.model_flops_per_token(
      model_cfg, seq_len,
      seq_len if model_cfg.variant != 'modern' else config.masking.max_predictions,
      last_block_rows=seq_len)
  summary['note'] = _HF_HEAD_NOTE[model_cfg.variant] + (
      ' Ours keeps the packed documents of a row apart (model.document_mask); HF attends '
      'across them.' if model_cfg.document_mask else '')
  return summary


def _token_counts(config: ml_collections.ConfigDict, masked_per_step: float) -> set[int]:
  """Sizes of token axes in HF's matmuls: rows, positions, masked tokens and their products."""
  b, t, p = config.train.batch_size, config.data.seq_len, config.masking.max_predictions
  return {b, t, p, b * t, b * p, int(masked_per_step)}


def _ratios(ours: dict[str, Any], peer: dict[str, Any], per: int, suffix: str) -> dict[str, float]:
  """Our tokens/s over a peer's, at the median and at the fastest windows."""
  # Several accelerators against HF's one: compare per device. The fastest
  # windows are less affected by other load on a shared machine.
  return {
      f'ratio_tokens_per_sec{suffix}': ours['tokens_per_sec'] / per / peer['tokens_per_sec'],
      f'ratio_tokens_per_sec_best_window{suffix}': (peer['step_time_s']['min']
                                                     / ours['step_time_s']['min'] / per),
  }


def _shape(config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig) -> dict[str, Any]:
  return {'num_layers': model_cfg.num_layers, 'hidden_size': model_cfg.hidden_size,
          'num_heads': model_cfg.num_heads, 'intermediate_size': model_cfg.intermediate_size,
          'seq_len': config.data.seq_len, 'max_predictions': config.masking.max_predictions,
          'vocab_size': model_cfg.vocab_size, 'padded_vocab_size': model_cfg.padded_vocab_size,
          'batch_size': config.train.batch_size, 'grad_accum_steps': config.train.grad_accum_steps,
          'dtype': np.dtype(model_cfg.dtype).name, 'dropout_rate': model_cfg.dropout_rate,
          'attention_dropout_rate': model_cfg.attention_dropout_rate}


def _machine(backend: str, device_kind: str, compare: str) -> dict[str, Any]:
  """How this run used the machine; what the machine is, is `host` (host.py)."""
  machine = {'jax_backend': backend, 'device_kind': device_kind,
             'num_devices': jax.device_count(), 'host_malloc': host_malloc.description()}
  if compare == 'hf':
    torch = hf_lib.require('torch')
    machine['torch_num_threads'] = torch.get_num_threads()
    if torch.cuda.is_available():
      machine['torch_device_name'] = torch.cuda.get_device_name()
  return machine


# ------------------------------------------------------------------- output


def format_report(result: dict[str, Any]) -> str:
  """The readable table printed by the command, under the host line."""
  s, m = result['shape'], result['machine']
  peers = [result[key] for key in PEERS if key in result]
  systems = [result['ours'], *peers]

  def gib(x):
    return f'{x / 2**30:.2f} GiB'

  def ms(t):
    return f'{1e3 * t["median"]:.1f} ms [{1e3 * t["min"]:.1f}, {1e3 * t["max"]:.1f}]'

  def mfu(x):
    return 'n/a (no known peak; pass --peak_tflops)' if x is None else f'{100 * x:.2f}%'

  rows = [
      ('step time: median [min, max]', [ms(x['step_time_s']) for x in systems]),
      ('tokens/s (real, non-padding)', [f'{x["tokens_per_sec"]:,.0f}' for x in systems]),
      ('MFU', [mfu(x['mfu']) for x in systems]),
      ('compile', [f'{result["ours"]["compile_s"]:.1f} s (lower + compile)']
       + [f'{x["first_step_s"]:.1f} s (first step, {_mode(x)})' for x in peers]),
      ('peak memory', [f'{gib(x["peak_memory_bytes"])} {x["memory_kind"]}' for x in systems]),
      ('parameters', [f'{x["num_params"]:,}' for x in systems]),
      ('masked tokens / step', [f'{x["masked_tokens_per_step"]:,.0f}' for x in systems]),
      ('loss at the last step', [f'{x["final_loss"]:.4f}' for x in systems]),
  ]
  width = max(len(name) for name, _ in rows)
  # Every column but the last is padded to the widest cell or name.
  col = max((len(v) for v in [x['name'] for x in systems[:-1]]
             + [v for _, values in rows for v in values[:-1]]), default=0) + 2
  lines = [
      result['host']['summary'],
      f'L={s["num_layers"]} d={s["hidden_size"]} heads={s["num_heads"]} '
      f'd_ff={s["intermediate_size"]} T={s["seq_len"]} P={s["max_predictions"]} '
      f'V={s["padded_vocab_size"]} ({s["vocab_size"]} real) B={s["batch_size"]} {s["dtype"]} '
      f'dropout={s["dropout_rate"]}/{s["attention_dropout_rate"]} '
      f'chains={s.get("concurrent_chains", 1)}',
      f'attention: {result.get("attention", "")}',
      f'{m["jax_backend"]}: {m["num_devices"]} x {m["device_kind"]}; '
      f'host malloc {m.get("host_malloc", "default")}'
      + (' (all systems: one process)' if peers else ''),
      f'{result["timing"]["repeats"]} windows of {result["timing"]["steps"]} steps after '
      f'{result["timing"]["warmup"]} warm-up steps; {result["tokens_per_step"]:,.0f} tokens/step; '
      f'{result["flops_per_token"] / 1e6:,.2f} MFLOPs/token (flops.py)',
      '',
      ' ' * width + '  ' + ''.join(x['name'].ljust(col) for x in systems),
  ]
  lines += [(name.ljust(width) + '  ' + ''.join(v.ljust(col) for v in values)).rstrip()
            for name, values in rows]
  lines += _peer_lines(result)
  if 'breakdown' in result:
    lines += ['', op_breakdown.format_table(result['breakdown'])]
  return '\n'.join(lines)


def _mode(peer: dict[str, Any]) -> str:
  return 'torch.compile' if peer['torch_compile'] else 'eager'


def _peer_lines(result: dict[str, Any]) -> list[str]:
  """The ratios to each HF run, how HF ran, and why torch.compile did not, if it did not."""
  keys = [key for key in PEERS if key in result]
  if not keys:
    return []
  lines = ['']
  for key in keys:
    suffix = PEERS[key]
    lines.append(f'mlm_jax / HF {_mode(result[key])} tokens/s ({result["ratio_basis"]}): '
                 f'{result["ratio_tokens_per_sec" + suffix]:.2f}x at the median window, '
                 f'{result["ratio_tokens_per_sec_best_window" + suffix]:.2f}x at the fastest')
  if 'hf_compile_error' in result:
    lines.append(result['hf_compile_error'])
  hf = result['hf']
  lines += [f'HF: {hf["device"]}, attention {hf["attn_implementation"]}, '
            f'bf16 autocast {hf["autocast_bf16"]}.', hf['note']]
  return lines
