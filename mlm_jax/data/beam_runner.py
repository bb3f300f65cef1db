"""Prepare's stages on Apache Beam (python -m mlm_jax.prepare --beam).

`BeamPool` stands in for packing.Pool: the same task functions
(packing.sample_unit, tokenize_unit, write_shard, tfds_export.export_shard) on
the same tasks, each stage run as one Beam pipeline, so that a runner spreads
the tasks over its workers: DirectRunner's processes on one machine, or
Dataflow, Flink or Spark workers on a cluster. The driver (this process) does
what needs the whole corpus at once, as in a local prepare: cutting the
corpus into units, merging the tokenizer sample, training the tokenizer and,
when the rows are exported to tfds, writing the export's metadata. Every
task's output is a pure function of its inputs, so the data dir is the same
byte for byte whatever runs the tasks.

The tasks read the corpus and write into the data dir by path: on a cluster
both must be on a filesystem that every worker mounts at the same path
(NFS, Filestore, a gcsfuse mount). Results that come back to the driver (the
tokenizer sample) are pickled into the data dir and read back in task order.
See docs/data.md#apache-beam. Imported only by a prepare that asks for
Beam (the .[beam] extra).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam import runners
from apache_beam.options import pipeline_options

from mlm_jax.data import packing
from mlm_jax.errors import ConfigError


def check_options(options: list[str]) -> None:
  """Refuses options whose runner Beam does not know (before anything is prepared)."""
  name = pipeline_options.PipelineOptions(options).view_as(
      pipeline_options.StandardOptions).runner
  if name is None:
    return  # Beam's default, the DirectRunner.
  try:
    runners.create_runner(name)
  except (ValueError, ImportError) as e:
    raise ConfigError(f'--beam_options: {e}') from e


class _RunTask(beam.DoFn):
  """A DoFn: packing.init_worker once per worker (unless `init_args` is None), then fn(*task)
  per element."""

  def __init__(self, fn: Callable, init_args: tuple, results_dir: str | None):
    super().__init__()
    self._fn, self._init_args, self._results_dir = fn, init_args, results_dir

  def setup(self) -> None:
    if self._init_args is not None:
      packing.init_worker(*self._init_args)

  def process(self, element: tuple[int, bytes]) -> Iterator[Any]:
    index, task = element
    result = self._fn(*pickle.loads(task))
    if self._results_dir is not None:
      path = os.path.join(self._results_dir, f'{index:06d}.pkl')
      tmp = f'{path}.tmp-{os.getpid()}'
      with open(tmp, 'wb') as f:
        pickle.dump(result, f)
      os.replace(tmp, path)  # A retried task rewrites the same result.
    return iter(())


class BeamPool:
  """packing.Pool's interface (run, results) with each call one Beam pipeline.

  `options`: Beam pipeline options as on a command line (e.g.
  ['--runner=DataflowRunner', '--project=P', ...]). `scratch`: a directory
  in the data dir for results on their way back to the driver.
  """

  def __init__(self, options: list[str], init_args: tuple | None, scratch: str):
    self.options = list(options)
    self._pipeline_options = pipeline_options.PipelineOptions(self.options)
    self._init_args, self._scratch = init_args, scratch

  def __enter__(self) -> BeamPool:
    return self

  def __exit__(self, *exc) -> None:
    pass

  @contextlib.contextmanager
  def meanwhile(self, fn: Callable, tasks: Iterable[tuple]) -> Iterator[None]:
    """Nothing ahead: a Beam runner's workers are not idle processes of this one."""
    del fn, tasks
    yield

  def run(self, fn: Callable, tasks: Iterable[tuple], desc: str, total: int) -> None:
    self._pipeline(fn, list(tasks), desc, total, results_dir=None)

  def results(self, fn: Callable, tasks: Iterable[tuple], desc: str, total: int,
              todo: int | None = None) -> Iterator[Any]:
    """fn(*task) for every task, in task order, once the whole stage has run."""
    del todo
    tasks = list(tasks)
    os.makedirs(self._scratch, exist_ok=True)
    results_dir = tempfile.mkdtemp(prefix=f'{desc.replace(" ", "-")}.tmp-', dir=self._scratch)
    try:
      self._pipeline(fn, tasks, desc, total, results_dir)
      for i in range(len(tasks)):
        with open(os.path.join(results_dir, f'{i:06d}.pkl'), 'rb') as f:
          yield pickle.load(f)
    finally:
      shutil.rmtree(results_dir, ignore_errors=True)

  def _pipeline(self, fn: Callable, tasks: list[tuple], desc: str, total: int,
                results_dir: str | None) -> None:
    if not tasks:
      return
    do_fn = _RunTask(fn, self._init_args, results_dir)
    logging.info('Beam: %s, %d of %d tasks (%s)', desc, len(tasks), total,
                 ' '.join(self.options))
    start = time.perf_counter()
    with beam.Pipeline(options=self._pipeline_options) as p:
      _ = (p
           # Pickled: Beam's coders cannot hold every task (e.g. ints >= 2**63).
           | 'Tasks' >> beam.Create([(i, pickle.dumps(t)) for i, t in enumerate(tasks)])
           | 'Spread' >> beam.Reshuffle()
           | desc.title().replace(' ', '') >> beam.ParDo(do_fn))
    logging.info('Beam: %s done in %.1f s', desc, time.perf_counter() - start)
