"""The host pipeline alone, timed (python -m mlm_jax.pipeline_bench).

Times the host input pipeline alone, as the trainer runs it for one process:
prepared rows -> grain (shuffle, batch, config.input's worker processes and
prefetch) -> sentence pairs (if configured) -> masking. No model, no devices.
Prints tokens/s (rows x T per second, padding included, as the trainer counts
them): the median of several timed windows after a warm-up, and the peak
resident memory of this process and of its largest worker process. Any config field
can be overridden, e.g. --config.input.worker_count=2 or
--config.masking.mode=span. The data is prepared first if needed, exactly as
the trainer prepares it.
"""

from __future__ import annotations

import platform
import resource
import statistics
import time
from typing import Any

import ml_collections

from mlm_jax.config import checks
from mlm_jax.config import fields
from mlm_jax.data import masking
from mlm_jax.data import pipeline as input_pipeline
from mlm_jax.data import prepare


def measure(config: ml_collections.ConfigDict, *, warmup_s: float, window_s: float,
            repeats: int, num_processes: int = 1) -> dict[str, Any]:
  """Tokens/s of one process's train batches; the median of `repeats` windows."""
  checks.validate(config)
  data = prepare.prepare(*fields.data_request(config))
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  start = time.perf_counter()
  batches = input_pipeline.train_batches(
      data.source('train'), masker, global_batch=config.train.batch_size, seed=config.seed,
      process_count=num_processes, prefetch=config.input.prefetch,
      worker_count=config.input.worker_count, sentence_pair=config.sentence_pair.task)
  try:
    first = next(batches)
    first_batch_s = time.perf_counter() - start
    tokens_per_batch = first['input_ids'].size

    def run(seconds: float) -> float:
      """Tokens/s over whole batches for at least `seconds`."""
      n, t0 = 0, time.perf_counter()
      while (elapsed := time.perf_counter() - t0) < seconds or n == 0:
        next(batches)
        n += 1
      return n * tokens_per_batch / elapsed

    run(warmup_s)
    windows = [run(window_s) for _ in range(repeats)]
  finally:
    batches.close()  # Joins the worker processes: their peak is known after this.
  # ru_maxrss is in KiB on Linux (bytes on macOS).
  unit = 1 if platform.system() == 'Darwin' else 1024
  peak_main = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
  peak_worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit
  return {
      'tokens_per_sec': statistics.median(windows),
      'windows_tokens_per_sec': windows,
      'first_batch_s': first_batch_s,
      'rows_per_batch': len(first['input_ids']),
      'seq_len': first['input_ids'].shape[1],
      'max_predictions': first['masked_positions'].shape[1],
      'masking_mode': masker.mode,
      'sentence_pair': config.sentence_pair.task,
      'worker_count': config.input.worker_count,
      'prefetch': config.input.prefetch,
      'peak_rss_bytes': peak_main,
      # The largest child of this process: a grain worker (or a prepare worker
      # if the data was prepared in this run).
      'peak_worker_rss_bytes': peak_worker if config.input.worker_count else None,
  }


def format_report(r: dict[str, Any]) -> str:
  return '\n'.join([
      f"host pipeline: {r['rows_per_batch']} rows x T={r['seq_len']}, P={r['max_predictions']}, "
      f"masking={r['masking_mode']}, sentence_pair={r['sentence_pair']}, "
      f"workers={r['worker_count']}, prefetch={r['prefetch']}",
      f"first batch after {r['first_batch_s']:.2f} s; windows (tokens/s): "
      + ', '.join(f'{w:,.0f}' for w in r['windows_tokens_per_sec']),
      f"peak resident memory: {r['peak_rss_bytes'] / 2**30:.2f} GiB this process"
      + (f", {r['peak_worker_rss_bytes'] / 2**30:.2f} GiB the largest worker"
         if r['peak_worker_rss_bytes'] is not None else ''),
      f"tokens/s per process (median of {len(r['windows_tokens_per_sec'])} windows): "
      f"{r['tokens_per_sec']:,.0f}"])
