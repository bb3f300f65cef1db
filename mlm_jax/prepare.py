"""Command line: python -m mlm_jax.prepare --config=FILE [--config.data.num_workers=N ...]
                                           [--tfds_export]
                                           [--beam [--beam_options='--runner=... ...']].

Prepares the data a config trains on (tokenizer, packed rows, counts) and
prints the report, without training: what `train` does first when the data
is not prepared yet, run on its own (e.g. once, on a machine with many
cores, into a data dir the training hosts share). Nothing is done when the
data dir already holds the data; an interrupted run continues where it
stopped. See mlm_jax/data/prepare.py.

--tfds_export (config.data.tfds_export) also writes the rows as a tfds
dataset in array_record format, for tools that read tfds; asked of a data dir
prepared without it, it is added from the rows there. See
docs/data.md#the-tfds-export.

--beam runs the work as Apache Beam pipelines (pip install -e '.[beam]'):
DirectRunner with config.data.num_workers processes by default, or any
runner given by --beam_options (Dataflow, Flink, Spark); the data dir is the
same byte for byte. See docs/data.md#apache-beam.
"""

from __future__ import annotations

import shlex
import time

from absl import flags

from mlm_jax import cli
from mlm_jax.config import fields
from mlm_jax.data import prepare
from mlm_jax.runtime import cores

_CONFIG = cli.config_flag()
_TFDS_EXPORT = flags.DEFINE_bool(
    'tfds_export', False, 'Also export the rows as a tfds dataset (array_record) under '
    'DATA_DIR/tfds/: the same as --config.data.tfds_export=True.')
_BEAM = flags.DEFINE_bool('beam', False, 'Run the stages as Apache Beam pipelines.')
_BEAM_OPTIONS = flags.DEFINE_string(
    'beam_options', '', "Beam pipeline options as on Beam's command line, e.g. "
    "'--runner=DataflowRunner --project=P --region=R --temp_location=gs://B/tmp'. "
    'Default: DirectRunner with config.data.num_workers processes (0: one per core). '
    'Implies --beam.')


def main() -> None:
  config = cli.resolved_config(_CONFIG, num_devices=None).config
  if _TFDS_EXPORT.value:
    config.data.tfds_export = True  # Neither in the fingerprint nor checked: the rows are the same.
  beam_options = None
  if _BEAM.value or _BEAM_OPTIONS.value:
    workers = config.data.num_workers or cores.usable_cores()
    beam_options = shlex.split(_BEAM_OPTIONS.value) or [
        '--runner=DirectRunner', f'--direct_num_workers={workers}',
        '--direct_running_mode=multi_processing']
  start = time.perf_counter()
  data = prepare.prepare(*fields.data_request(config), beam_options)
  print(f'Data dir: {data.data_dir} (ready after {time.perf_counter() - start:.1f} s)',
        flush=True)
  if config.data.tfds_export:
    print(f'tfds export: {data.tfds_dir} (tfds.builder_from_directory(DIR).as_data_source(SPLIT))',
          flush=True)


if __name__ == '__main__':
  cli.run(main, info=True)
