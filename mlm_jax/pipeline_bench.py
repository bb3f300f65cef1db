"""Command line: python -m mlm_jax.pipeline_bench --config=configs/tiny.py.

Times the host input pipeline alone, as the trainer runs it for one process
(prepared rows -> grain -> sentence pairs -> masking; no model, no devices),
and prints tokens/s per process: the median of several windows after a
warm-up. Any config field can be overridden, e.g. --config.input.worker_count=2.
See mlm_jax/perf/pipeline_bench.py.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.perf import pipeline_bench

_CONFIG = cli.config_flag()
_WARMUP_S = flags.DEFINE_float('warmup_s', 3.0, 'Untimed seconds after the first batch.')
_WINDOW_S = flags.DEFINE_float('window_s', 2.0, 'Seconds per timing window.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timing windows; the median is reported.')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', 1, 'Time process 0 of a run of this many processes (its share of '
    'config.train.batch_size).')


def main() -> None:
  result = pipeline_bench.measure(_CONFIG.value, warmup_s=_WARMUP_S.value,
                                  window_s=_WINDOW_S.value, repeats=_REPEATS.value,
                                  num_processes=_NUM_PROCESSES.value)
  print(pipeline_bench.format_report(result), flush=True)


if __name__ == '__main__':
  cli.run(main)
