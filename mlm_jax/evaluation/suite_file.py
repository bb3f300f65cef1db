"""A user's own suite: a JSON file naming each task's files, kind and metrics.

  {"name": "support",
   "tasks": [
     {"name": "topic", "kind": "classify", "train": "topic/train.jsonl",
      "dev": "topic/dev.jsonl", "metrics": ["accuracy", "macro_f1"]},
     {"name": "urgent", "kind": "pair", "train": "urgent/train.csv", "dev": "urgent/dev.csv",
      "metrics": ["f1", "accuracy"], "positive": "yes",
      "fields": {"text_field": "subject", "text_pair_field": "body"}},
     {"name": "ner", "kind": "tag", "train": "tfds:conll2003:train",
      "dev": "tfds:conll2003:validation", "metrics": ["f1"], "fields": {"tags_field": "ner"}}]}

kind: classify, pair, regress or tag (finetuning/data.py reads the files, as
finetune's --train_data does: .jsonl, .csv, .tsv, or tfds:NAME:SPLIT);
metrics: measures of tasks.MEASURES for the kind ('f1' of a classify or pair
task needs "positive", the label it scores); run_score: what a run keeps its
best evaluation by (default: the first the kind has, accuracy / pearson / f1);
fields: finetune's config.data.*_field settings. Paths are relative to the
suite file. What must stay true: every problem with the file is one
ConfigError naming the task and the key, before anything runs; the suite's
average is the mean of every task's score.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlm_jax.data import tfds_source
from mlm_jax.errors import ConfigError
from mlm_jax.evaluation import glue_data
from mlm_jax.evaluation import sweep as sweep_lib
from mlm_jax.evaluation import tasks as tasks_lib

_KEYS = {'name', 'kind', 'train', 'dev', 'metrics', 'positive', 'run_score', 'fields'}
_FIELDS = ('text_field', 'text_pair_field', 'label_field', 'tokens_field', 'tags_field')


def load(path: str) -> tuple[str, list[sweep_lib.SuiteTask]]:
  """(the suite's name, its tasks with their files); ConfigError for a bad file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'--suite={path}: no such file (a suite file, or glue, retrieval, '
                            'sts).')
  with open(path) as f:
    try:
      suite = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f'--suite={path}: not valid JSON ({e.msg}, line {e.lineno}).') from e
  if not isinstance(suite, dict) or not isinstance(suite.get('tasks'), list) or not suite['tasks']:
    raise ConfigError(f'--suite={path}: a suite file is an object with a non-empty "tasks" list.')
  root = os.path.dirname(os.path.abspath(path))
  out, seen = [], set()
  for i, entry in enumerate(suite['tasks']):
    task = _task(path, i, entry)
    if task.task.name in seen:
      raise ConfigError(f'--suite={path}: task {task.task.name!r} is named twice.')
    seen.add(task.task.name)
    out.append(_with_files(task, root))
  return str(suite.get('name') or os.path.splitext(os.path.basename(path))[0]), out


def _task(path: str, i: int, entry: Any) -> sweep_lib.SuiteTask:
  where = f'--suite={path} task {i}'
  if not isinstance(entry, dict):
    raise ConfigError(f'{where}: an object with {sorted(_KEYS)}.')
  unknown = sorted(set(entry) - _KEYS)
  missing = [k for k in ('name', 'kind', 'train', 'dev', 'metrics') if k not in entry]
  if unknown or missing:
    raise ConfigError(f'{where}: unknown keys {unknown}, missing {missing}; a task has '
                      f'{sorted(_KEYS)}.')
  name, kind = str(entry['name']), entry['kind']
  where = f'--suite={path} task {name!r}'
  if not name.replace('_', '').replace('-', '').isalnum():
    raise ConfigError(f'{where}: name it with letters, digits, - and _ (it names a directory).')
  metrics = entry['metrics']
  if isinstance(metrics, str):
    metrics = [metrics]
  fields = entry.get('fields', {})
  if not isinstance(fields, dict) or set(fields) - set(_FIELDS):
    raise ConfigError(f'{where}: "fields" maps some of {list(_FIELDS)} to column names.')
  run_score = entry.get('run_score') or tasks_lib.RUN_SCORES.get(kind, ('accuracy',))[0]
  task = tasks_lib.Task(name, kind, tuple(tasks_lib.Metric(m, 'dev', m) for m in metrics),
                        positive=entry.get('positive'), run_score=run_score, title=name)
  try:
    task.check()
  except ConfigError as e:
    raise ConfigError(f'--suite={path}: {e}') from None
  return sweep_lib.SuiteTask(task, {'train': entry['train'], 'dev': entry['dev']},
                             dict(fields))


def _with_files(st: sweep_lib.SuiteTask, root: str) -> sweep_lib.SuiteTask:
  """Paths made absolute (relative to the suite file), each named by its content's sha256."""
  files, digests = {}, {}
  for split, given in st.files.items():
    if tfds_source.is_spec(given):
      files[split], digests[split] = given, given   # A prepared dataset names itself.
      continue
    path = given if os.path.isabs(given) else os.path.join(root, given)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'suite task {st.task.name!r}: {split} file {path}: no such file.')
    files[split], digests[split] = path, glue_data.file_digest(path)
  return sweep_lib.SuiteTask(st.task, files, st.fields, digests)
