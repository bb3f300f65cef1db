"""Command line: python -m mlm_jax.prepare --config=FILE [--config.data.num_workers=N ...].

Prepares the data a config trains on (tokenizer, packed rows, counts) and
prints the report, without training: what `train` does first when the data
is not prepared yet, run on its own (e.g. once, on a machine with many
cores, into a data dir the training hosts share). Nothing is done when the
data dir already holds the data; an interrupted run continues where it
stopped. See mlm_jax/data/prepare.py.
"""

from __future__ import annotations

import time

from mlm_jax import cli
from mlm_jax import configuration as config_lib
from mlm_jax.data import prepare

_CONFIG = cli.config_flag()


def main() -> None:
  config = _CONFIG.value
  config_lib.validate(config)
  start = time.perf_counter()
  data = prepare.prepare(config)
  print(f'Data dir: {data.data_dir} (ready after {time.perf_counter() - start:.1f} s)',
        flush=True)


if __name__ == '__main__':
  cli.run(main, info=True)
