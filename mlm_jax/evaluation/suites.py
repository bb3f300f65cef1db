"""`evaluate`: a suite x a protocol on one encoder -> cells on disk -> results, resumable.

`run_suite` reads top to bottom as the work goes:
  protocol, encoder   the protocol (name or file) and the encoder (a run or a checkpoint),
                      loaded once for every cell
  tasks and data      GLUE's (glue_data.py: every split read and checked before anything
                      trains) or a suite file's (suite_file.py)
  sweep directory     OUT/sweep.json: the same suite, protocol, model and data, or refused
  our cells           sweep.run_all with ours (cell_run.py)
  their cells         with --compare=hf, the same through transformers (hf_peer.py) on the
                      model exported to Hugging Face's format
  results             results.json, results.md, results.png (results.py)

What must stay true: nothing is trained before every input is read and
checked; a rerun of the same command runs only the unfinished cells; a
signal stops the sweep after the current cell's checkpoint, and the same
command continues it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from absl import logging

from mlm_jax.errors import ConfigError
from mlm_jax.evaluation import cell_run
from mlm_jax.evaluation import glue_data
from mlm_jax.evaluation import identity
from mlm_jax.evaluation import protocols as protocols_lib
from mlm_jax.evaluation import results as results_lib
from mlm_jax.evaluation import suite_file
from mlm_jax.evaluation import sweep as sweep_lib
from mlm_jax.evaluation import tasks as tasks_lib
from mlm_jax.finetuning import pretrained as pretrained_lib
from mlm_jax.training import lock
from mlm_jax.training import workdir as workdir_lib

COMPARE = ('hf',)


def run_suite(suite: str, *, workdir: str | None, hf_dir: str | None, out_dir: str,
              data: str | None = None, protocol: str | None = None,
              tasks: list[str] | None = None, compare: str | None = None,
              keep_models: bool = False, tfds_data_dir: str | None = None) -> dict[str, Any]:
  """Evaluates the run in `workdir` or the checkpoint in `hf_dir` on `suite` ('glue' or a
  suite file) under `protocol` (None: protocols.default_name) into `out_dir`; returns
  results.json's content ({'stopped': True} when a signal stopped it)."""
  out_dir = os.path.abspath(out_dir)
  if compare is not None and compare not in COMPARE:
    raise ConfigError(f'--compare={compare!r}: use {", ".join(COMPARE)}.')
  # ------------------------------------------------------- protocol, encoder
  chosen = protocols_lib.load(protocol or protocols_lib.default_name(jax.default_backend()))
  chosen.check()
  if suite != 'glue' and (tasks or data):
    raise ConfigError('--tasks and --data choose among GLUE\'s tasks and layouts; a suite file '
                      'names its own files.')
  # ---------------------------------------------------------- tasks and data
  if suite == 'glue':
    suite_tasks, payloads = glue_tasks(chosen, tasks, data or 'tfds', out_dir, tfds_data_dir)
    averaged = [t.task.name for t in suite_tasks if t.task.name not in tasks_lib.NOT_AVERAGED]
    source = glue_data.describe(data or 'tfds')
  elif suite.endswith('.json'):
    suite, suite_tasks = suite_file.load(suite)
    payloads, averaged, source = {}, [t.task.name for t in suite_tasks], 'the suite file\'s'
    # The MNLI start and the drawn-down training files are GLUE's: a suite file's tasks start
    # from the encoder and train on their whole files.
    chosen = dataclasses.replace(chosen, start_from_mnli=(), max_train_rows=None)
  else:
    raise ConfigError(f'--suite={suite!r}: use glue, retrieval, sts or a suite file (.json).')
  tagged = [t.task.name for t in suite_tasks if t.task.kind == 'tag']
  if compare and tagged:
    raise ConfigError(f'--compare=hf runs sequence tasks (classify, pair, regress) through '
                      f'AutoModelForSequenceClassification; {", ".join(tagged)} tag words.')
  sweep_lib.check_batches(chosen, suite_tasks)
  pretrained = pretrained_lib.load(workdir, hf_dir)
  # --------------------------------------------------------- sweep directory
  header = {'suite': suite, 'protocol': chosen.to_dict(),
            'model': identity.model_identity(pretrained), 'mlm_jax': identity.mlm_jax_version(),
            'data_source': source, 'data': {t.task.name: t.digests for t in suite_tasks}}
  sweep_lib.check_manifest(out_dir, {k: header[k] for k in ('suite', 'protocol', 'model',
                                                             'data')})
  for path, (task, rows) in payloads.items():
    glue_data.write_rows(path, task, rows)
  peer_dir = _peer_model(out_dir, workdir, pretrained) if compare else None
  # ------------------------------------------------------------ cells
  ours_root = os.path.join(out_dir, 'cells')
  try:
    ours = sweep_lib.run_all(chosen, suite_tasks,
                             cell_run.make_runner(chosen, pretrained, ours_root), keep_models)
    theirs = None
    if compare:
      from mlm_jax.evaluation import hf_peer  # pylint: disable=import-outside-toplevel  # torch
      theirs = sweep_lib.run_all(
          chosen, suite_tasks,
          hf_peer.make_runner(chosen, peer_dir, ours_root, os.path.join(out_dir, 'hf', 'cells')),
          keep_models)
  except sweep_lib.Stopped as e:
    logging.warning('Stopped by a signal in cell %s (its checkpoint is saved). Run the same '
                    'command to continue the sweep.', e)
    return {'stopped': True}
  # ------------------------------------------------------------ results
  task_list = [st.task for st in suite_tasks]
  summary = results_lib.summarize(chosen, task_list, ours, averaged)
  their_summary = (results_lib.summarize(chosen, task_list, theirs, averaged)
                   if theirs is not None else None)
  content = summary
  if jax.process_index() == 0:
    content = results_lib.write(out_dir, header, summary, their_summary)
    print(results_lib.table(header, summary, their_summary), flush=True)
    print(f'written: {os.path.join(out_dir, results_lib.JSON_FILE)}, '
          f'{results_lib.TABLE_FILE}, {results_lib.FIGURE_FILE}', flush=True)
  return content


def glue_tasks(protocol: protocols_lib.Protocol, names: list[str] | None, data: str,
               out_dir: str, tfds_data_dir: str | None
               ) -> tuple[list[sweep_lib.SuiteTask],
                          dict[str, tuple[tasks_lib.Task, list[glue_data.Row]]]]:
  """GLUE's tasks (with MNLI where a task starts from it), every split read and checked; the
  rows to write ({path: (suite task, rows)}), written once the sweep directory agrees."""
  tasks = tasks_lib.glue_tasks(names)
  if any(t.name in protocol.start_from_mnli for t in tasks) and 'mnli' not in [
      t.name for t in tasks]:
    logging.info('%s start from the MNLI model under protocol %r: MNLI runs too.',
                 ', '.join(t.name for t in tasks if t.name in protocol.start_from_mnli),
                 protocol.name)
    tasks = tasks_lib.glue_tasks([t.name for t in tasks] + ['mnli'])
  suite_tasks, payloads = [], {}
  for task in tasks:
    files, digests = {}, {}
    for split in ('train', *task.dev_splits):
      rows = glue_data.read_split(data, task, split, tfds_data_dir)
      if split == 'train':
        rows = glue_data.subsample(rows, protocol.max_train_rows)
      path = os.path.join(out_dir, 'data', task.name, f'{split}.jsonl')
      files[split], digests[split] = path, glue_data.rows_digest(task, rows)
      payloads[path] = (task, rows)
    suite_tasks.append(sweep_lib.SuiteTask(task, files, {}, digests))
  return suite_tasks, payloads


def _peer_model(out_dir: str, workdir: str | None,
                pretrained: pretrained_lib.Pretrained) -> str:
  """The Hugging Face directory transformers' runs start from: the --hf_dir, or the run's
  checkpoint evaluated, exported once into OUT/hf/model."""
  if not workdir:
    local = identity.local_dir(pretrained)
    if local is None:
      raise ConfigError(f'--compare=hf: no local directory for {pretrained.description}.')
    return local
  target = os.path.join(out_dir, 'hf', 'model')
  marker = os.path.join(target, 'exported_from.json')
  wanted = {'workdir': pretrained.source['workdir'], 'step': pretrained.source['step']}
  with lock.hold(target):
    if not os.path.exists(marker) or sweep_lib.read_json(marker) != wanted:
      workdir_lib.export_hf(workdir, target, wanted['step'])
      sweep_lib.write_json(marker, wanted)
  return target
