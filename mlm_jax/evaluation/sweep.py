"""The sweep: every (task, grid cell, seed) of a protocol as a fine-tuning run kept on disk.

  OUT/sweep.json                       the suite, protocol, model and data the cells
                                       belong to (a rerun with others is refused)
  OUT/cells/TASK/CELL/seedS/cell.json  a finished cell: its metrics on every dev split,
                                       its steps, row length, start, wall time
  OUT/cells/TASK/CELL/seedS/model/     its fine-tuning output (finetune's --out); the
                                       resume checkpoints are removed once it is scored,
                                       the kept parameters (best/) too unless another task
                                       starts from them or --keep_models
  OUT/hf/cells/...                     the same for transformers' runs (--compare=hf)

What must stay true:
  - a cell is finished when its cell.json exists, written last and whole; a
    rerun never runs a finished cell again. A cell stopped half-way (Ctrl-C,
    SIGTERM, a kill) continues from its own last checkpoint, as finetune does;
  - cells run in order: tasks that others start from (MNLI) before those
    (RTE, MRPC, STS-B under RoBERTa's and ModernBERT's protocols), which start
    from the MNLI cell the selection picks, its run with the protocol's first
    seed (ModernBERT's glue.py takes its first MNLI run's checkpoint);
  - every cell runs on the mesh of all devices, as finetune does, with its
    batch split over them. A cell whose batch does not divide over the devices
    is refused before anything runs; several processes, each given a share of
    the devices (CUDA_VISIBLE_DEVICES=0, =1, ...), can run the same command on
    the same OUT at once: each cell is held by one process (its lock), the others
    take the next free cell, and all wait for the MNLI cells before a task that
    starts from them;
  - the same (task, cell, seed) gives transformers' run the row length, steps,
    warm-up and evaluation cadence that ours resolved to (hf_peer.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from mlm_jax.errors import ConfigError
from mlm_jax.errors import WorkdirLockedError
from mlm_jax.evaluation import identity
from mlm_jax.evaluation import protocols as protocols_lib
from mlm_jax.evaluation import tasks as tasks_lib
from mlm_jax.training import lock

CELL_FILE, SWEEP_FILE = 'cell.json', 'sweep.json'
# How often a process that waits for cells other processes hold looks again.
POLL_S = 10.0


class Stopped(Exception):
  """A signal stopped a cell after its checkpoint: the sweep stops, resumable."""


@dataclasses.dataclass(frozen=True)
class SuiteTask:
  """A task of the suite with its files ({'train': path, dev split: path}) and field names."""

  task: tasks_lib.Task
  files: dict[str, str]
  fields: dict[str, str] = dataclasses.field(default_factory=dict)   # config.data.*_field
  digests: dict[str, str] = dataclasses.field(default_factory=dict)  # split -> sha256


@dataclasses.dataclass(frozen=True)
class Job:
  """One run: a task's cell and seed, where it is written, and the model it starts from
  (None: the pretrained encoder; else the MNLI cell's directory of the same runner)."""

  suite_task: SuiteTask
  cell: protocols_lib.Cell
  seed: int
  cell_dir: str
  start: str | None

  @property
  def model_dir(self) -> str:
    return os.path.join(self.cell_dir, 'model')

  @property
  def name(self) -> str:
    return f'{self.suite_task.task.name}/{self.cell.name}/seed{self.seed}'


@dataclasses.dataclass(frozen=True)
class Runner:
  """Who fine-tunes a job: ours (mlm_jax) or transformers' (hf_peer). `run` returns the
  cell's record (its 'metrics' and what else it reports); `root` holds its cells."""

  name: str
  root: str
  run: Callable[[Job], dict[str, Any]]


# ------------------------------------------------------------- the sweep


def check_batches(protocol: protocols_lib.Protocol, tasks: list[SuiteTask]) -> None:
  """ConfigError before anything runs for a cell whose batch does not divide over the devices."""
  devices = jax.device_count()
  for st in tasks:
    for batch in protocol.grid_for(st.task.name).batch_sizes:
      if batch % devices:
        raise ConfigError(
            f'protocol {protocol.name!r}: {st.task.name} cells take batches of {batch} rows, '
            f'which do not split over the {devices} devices. Give each process a share of the '
            'devices that divides it (e.g. CUDA_VISIBLE_DEVICES=0 and =1 ... for one GPU each) '
            'and start the same command in each, with the same --out: every cell is run by '
            'one process, the others take the next.')


def check_manifest(out_dir: str, manifest: dict[str, Any]) -> None:
  """Writes OUT/sweep.json, or refuses an OUT whose cells belong to another suite, protocol,
  model or data (the tasks of both must have the same files)."""
  path = os.path.join(out_dir, SWEEP_FILE)
  os.makedirs(out_dir, exist_ok=True)
  manifest = json.loads(json.dumps(manifest, default=str))   # As the file holds it: lists.
  if os.path.exists(path):
    saved = read_json(path)
    differ = [k for k in ('suite', 'protocol', 'model') if saved.get(k) != manifest[k]]
    differ += [f'data of {t}' for t, d in manifest['data'].items()
               if t in saved.get('data', {}) and saved['data'][t] != d]
    if differ:
      raise ConfigError(f'{out_dir} holds a sweep of another {", ".join(differ)} ({path}): its '
                        'finished cells would be mixed with these. Use a new --out, or the '
                        'same model, protocol and data.')
    manifest = {**manifest, 'data': {**saved.get('data', {}), **manifest['data']}}
  if jax.process_index() == 0:
    write_json(path, manifest)


def jobs(protocol: protocols_lib.Protocol, tasks: list[SuiteTask], root: str) -> list[Job]:
  """Every job of the sweep, in the order they run (MNLI's before the tasks it starts)."""
  out = []
  order = sorted(tasks, key=lambda st: st.task.name in protocol.start_from_mnli)
  for st in order:
    for cell in protocol.cells(st.task.name):
      for seed in protocol.seeds:
        out.append(Job(st, cell, seed, os.path.join(root, st.task.name, cell.name,
                                                    f'seed{seed}'), None))
  return out


def run_all(protocol: protocols_lib.Protocol, tasks: list[SuiteTask], runner: Runner,
            keep_models: bool) -> dict[str, dict[str, Any]]:
  """Runs every unfinished job with `runner` (waiting for those other processes hold);
  returns each task's cells as results.summarize wants them. Raises Stopped."""
  todo = jobs(protocol, tasks, runner.root)
  starts = {st.task.name for st in tasks if st.task.name in protocol.start_from_mnli}
  announced: set[str] = set()
  while True:
    pending = [j for j in todo if not finished(j.cell_dir)]
    if not pending:
      break
    progressed, waiting = False, []
    for job in pending:
      name = job.suite_task.task.name
      if name in starts:
        start = _mnli_start(protocol, tasks, runner.root)
        if start is None:
          waiting.append(job.name)
          continue
        job = dataclasses.replace(job, start=start)
      keep = keep_models or (name == 'mnli' and bool(starts))
      progressed |= _run_job(job, runner, keep, announced)
    if not progressed:
      logging.info('Waiting for %d cells held by other processes or for the MNLI cells (%s, ...)',
                   len(pending), pending[0].name)
      time.sleep(POLL_S)
  return {st.task.name: {c.name: {s: read_cell(os.path.join(runner.root, st.task.name, c.name,
                                                            f'seed{s}'))
                                  for s in protocol.seeds}
                         for c in protocol.cells(st.task.name)}
          for st in tasks}


def _run_job(job: Job, runner: Runner, keep_model: bool, announced: set[str]) -> bool:
  """Runs `job` unless another process holds it (False) or finished it meanwhile."""
  try:
    with lock.hold(job.cell_dir):
      if finished(job.cell_dir):
        return True
      if job.name not in announced:
        logging.info('%s cell %s%s', runner.name, job.name,
                     f' (from {job.start})' if job.start else '')
        announced.add(job.name)
      began = time.perf_counter()
      record = runner.run(job)
      record |= {'task': job.suite_task.task.name, 'cell': dataclasses.asdict(job.cell),
                 'seed': job.seed, 'start': job.start or 'pretrained',
                 'wall_time_s': round(time.perf_counter() - began, 3),
                 'mlm_jax': identity.mlm_jax_version()}
      if jax.process_index() == 0:
        write_json(os.path.join(job.cell_dir, CELL_FILE), record)
        _clean(job.model_dir, keep_model)
        print(f'{runner.name} {job.name}: ' + ', '.join(
            f'{k} {v:.4f}' for k, v in record['metrics'].items()), flush=True)
      return True
  except WorkdirLockedError:
    return False


def _clean(model_dir: str, keep_model: bool) -> None:
  """A scored cell's resume checkpoints go; its kept parameters too, unless wanted."""
  shutil.rmtree(os.path.join(model_dir, 'checkpoints'), ignore_errors=True)
  if not keep_model:
    shutil.rmtree(os.path.join(model_dir, 'best'), ignore_errors=True)


def _mnli_start(protocol: protocols_lib.Protocol, tasks: list[SuiteTask],
                root: str) -> str | None:
  """The model directory dependent tasks start from: the selected MNLI cell's run with the
  first seed; None while an MNLI cell is unfinished."""
  mnli = next(st for st in tasks if st.task.name == 'mnli')
  cells = {}
  for cell in protocol.cells('mnli'):
    dirs = [os.path.join(root, 'mnli', cell.name, f'seed{s}') for s in protocol.seeds]
    if not all(finished(d) for d in dirs):
      return None
    cells[cell.name] = {s: read_cell(d) for s, d in zip(protocol.seeds, dirs)}
  chosen = select(protocol, mnli.task, cells)
  return os.path.join(root, 'mnli', chosen, f'seed{protocol.seeds[0]}', 'model')


# -------------------------------------------------------------- selection


def aggregate(protocol: protocols_lib.Protocol, values: list[float]) -> float:
  return statistics.median(values) if protocol.aggregate == 'median' else statistics.fmean(values)


def cell_score(protocol: protocols_lib.Protocol, task: tasks_lib.Task,
               seeds: dict[int, dict[str, Any]]) -> float:
  """The cell's figure for selection: the protocol's summary of the task score over seeds."""
  return aggregate(protocol, [tasks_lib.score(task, r['metrics']) for r in seeds.values()])


def select(protocol: protocols_lib.Protocol, task: tasks_lib.Task,
           cells: dict[str, dict[int, dict[str, Any]]]) -> str:
  """The chosen cell's name: the highest score; a tie keeps the earlier cell of the grid."""
  best, chosen = None, None
  for name, seeds in cells.items():
    score = cell_score(protocol, task, seeds)
    if best is None or score > best:
      best, chosen = score, name
  return chosen


# ------------------------------------------------------------------ files


def finished(cell_dir: str) -> bool:
  return os.path.exists(os.path.join(cell_dir, CELL_FILE))


def read_cell(cell_dir: str) -> dict[str, Any]:
  return read_json(os.path.join(cell_dir, CELL_FILE))


def read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def write_json(path: str, content: Any) -> None:
  """Writes `path` whole: a temporary file, then a rename (a kill leaves the old or the new)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(content, f, indent=2, default=str)
  os.replace(tmp, path)
