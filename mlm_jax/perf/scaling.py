"""Row length against speed and memory (python -m mlm_jax.bench --seq_lens=1024,4096,8192).

At equal tokens per batch, a step whose every layer costs O(T·w) runs at the
same tokens/s at any row length T; global layers cost O(T²) and slow it down
as T grows. Two measurements show which part grows:

  - the whole train step of the config at each T, each in its own process
    (the benchmark of bench.py; peak memory is then that length's own);
  - one attention layer of each kind (local, global), forward and backward,
    by the kernel the builder picks for that length, in this process: its
    time per token stays flat for a local layer and grows with T for a
    global one.

The batch at length T is tokens_per_batch // T rows.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.model import attention


def batch_at(seq_len: int, tokens_per_batch: int) -> int:
  """Rows per batch at length seq_len for (about) tokens_per_batch tokens; at least 1."""
  if tokens_per_batch < seq_len:
    raise ConfigError(f'--tokens_per_batch={tokens_per_batch} is less than one row of '
                      f'{seq_len} tokens: raise it to at least the longest --seq_lens.')
  return tokens_per_batch // seq_len


def length_overrides(config: ml_collections.ConfigDict, seq_len: int,
                     tokens_per_batch: int) -> list[str]:
  """The command-line overrides that set the config to rows of seq_len tokens."""
  rows = batch_at(seq_len, tokens_per_batch)
  out = [f'--config.data.seq_len={seq_len}', f'--config.train.batch_size={rows}',
         f'--config.eval.batch_size={rows}']
  if config.model.max_position_embeddings < seq_len:
    out.append(f'--config.model.max_position_embeddings={seq_len}')
  return out


def step_at_length(argv: Sequence[str], config: ml_collections.ConfigDict, seq_len: int,
                   tokens_per_batch: int) -> dict[str, Any]:
  """The benchmark (bench.run_benchmark) of the config at seq_len, in a process of its own.

  argv: the command's own arguments less --seq_lens and --tokens_per_batch
  (the config file, its overrides, the timing flags).
  """
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'result.json')
    command = [sys.executable, '-m', 'mlm_jax.bench', *argv,
               *length_overrides(config, seq_len, tokens_per_batch), f'--json_out={out}']
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not os.path.exists(out):
      tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
      return {'seq_len': seq_len, 'error': ' | '.join(tail) or f'exit {done.returncode}'}
    with open(out) as f:
      result = json.load(f)
  return {'seq_len': seq_len, 'batch_size': batch_at(seq_len, tokens_per_batch),
          'step_time_s': result['ours']['step_time_s']['median'],
          'tokens_per_sec': result['ours']['tokens_per_sec'],
          'peak_memory_bytes': result['ours']['peak_memory_bytes'],
          'memory_kind': result['ours']['memory_kind'],
          'compile_s': result['ours']['compile_s'], 'attention': result.get('attention', ''),
          'host': result['host']['summary']}


def layer_times(cfg: model_lib.ModelConfig, seq_len: int, tokens_per_batch: int,
                repeats: int = 5) -> dict[str, dict[str, Any]]:
  """One local and one global attention layer at seq_len: kernel, forward + backward time.

  Random q, k, v [B, T, N, H] in the compute dtype, full rows, documents of
  512 tokens when cfg.document_mask; the kernel `attention.choose` gives a
  layer of every token's queries. Median of `repeats` timed calls after one
  warm-up (compile) call.
  """
  b = batch_at(seq_len, tokens_per_batch)
  n, h = cfg.num_heads, cfg.hidden_size // cfg.num_heads
  rng = np.random.default_rng(0)
  qkv = [jnp.asarray(rng.normal(size=(b, seq_len, n, h)), cfg.dtype) for _ in range(3)]
  valid = jnp.ones((b, seq_len), bool)
  docs = jnp.asarray(1 + np.arange(seq_len) // 512)[None].repeat(b, 0)
  out = {}
  kinds = [('global', None)] + ([('local', cfg.local_attention // 2)]
                                if cfg.variant == 'modern' else [])
  for kind, window in kinds:
    mask = attention.Mask(valid, None, docs if cfg.document_mask else None, window)
    kernel, why = attention.choose(cfg, local=window is not None, q_len=seq_len, kv_len=seq_len,
                                   rows=False, contiguous=True, documents=cfg.document_mask,
                                   dropout=False)

    def loss(q, k, v, mask=mask):
      return jnp.sum(attention.attend(cfg, q, k, v, mask, True).astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(step(*qkv))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(*qkv))
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    out[kind] = {'kernel': kernel, 'why': why, 'seconds': seconds,
                 'ns_per_token': 1e9 * seconds / (b * seq_len)}
  return out


def model_config(config: ml_collections.ConfigDict, platform: str) -> model_lib.ModelConfig:
  """The config's ModelConfig for a one-device step on `platform` (no sharding)."""
  vocab = config.tokenizer.vocab_size
  return model_lib.ModelConfig.from_config(
      config.model, vocab, tok_lib.padded_vocab_size(vocab),
      model_lib.compute_dtype(config.model.dtype, platform), platform=platform)


def run(argv: Sequence[str], config: ml_collections.ConfigDict, seq_lens: Sequence[int],
        tokens_per_batch: int, log=lambda s: None) -> dict[str, Any]:
  """Every row length: the whole step (own process) and one attention layer of each kind.

  The steps run first, each process with the device to itself; this process
  touches the device only afterwards, for the layers.
  """
  rows = []
  for t in seq_lens:
    log(f'Row length {t}: {batch_at(t, tokens_per_batch)} rows per batch...')
    rows.append(step_at_length(argv, config, t, tokens_per_batch))
  # Take device memory as needed, not JAX's default share up front.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  cfg = model_config(config, jax.default_backend())
  for row in rows:
    log(f"Attention layers at row length {row['seq_len']}...")
    row['layers'] = layer_times(cfg, row['seq_len'], tokens_per_batch)
  return {'tokens_per_batch': tokens_per_batch, 'rows': rows}


def format_report(result: dict[str, Any]) -> str:
  """A table: per row length, the step and each kind of attention layer."""
  rows = result['rows']
  host = next((r['host'] for r in rows if 'host' in r), '')
  kinds = [k for k in ('local', 'global') if any(k in r.get('layers', {}) for r in rows)]
  header = (f"{'T':>6} {'rows':>5} {'step':>10} {'tokens/s':>10} {'peak memory':>12}"
            + ''.join(f" {kind + ' layer (fwd+bwd)':>28}" for kind in kinds))
  lines = [host, f"{result['tokens_per_batch']:,} tokens per batch", '', header]
  for r in rows:
    if 'error' in r:
      lines.append(f"{r['seq_len']:>6} failed: {r['error']}")
      continue
    cells = ''.join(
        f" {r['layers'][k]['kernel']:>8} {r['layers'][k]['seconds'] * 1e3:7.2f} ms "
        f"{r['layers'][k]['ns_per_token']:6.1f} ns/tok" for k in kinds)
    lines.append(f"{r['seq_len']:>6} {r['batch_size']:>5} {r['step_time_s'] * 1e3:8.1f}ms "
                 f"{r['tokens_per_sec']:>10,.0f} {r['peak_memory_bytes'] / 2**30:>8.2f} GiB"
                 + cells)
  lines += ['', 'attention per row length:'] + [
      f"  T={r['seq_len']}: {r['attention']}" for r in rows if r.get('attention')]
  return '\n'.join(lines)
