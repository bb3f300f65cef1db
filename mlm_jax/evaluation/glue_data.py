"""GLUE's files in their three layouts, read, checked and written as the rows a fine-tuning reads.

  --data=DIR   a GLUE download directory in its original layout, the files
               google-research/bert's run_classifier.py reads:
               DIR/{CoLA,SST-2,MRPC,STS-B,QQP,MNLI,QNLI,RTE,WNLI}/{train,dev}.tsv
               (MNLI: dev_matched.tsv, dev_mismatched.tsv); tab-separated, no
               quoting (run_classifier's csv.reader(quotechar=None)); CoLA has
               no header and four cells (source, label, original label,
               sentence), every other file a header whose names pick the
               columns (TSV_LAYOUTS)
  --data=tfds  tfds's glue/* datasets prepared as array_record (read through
               finetuning/data.py, as finetune's tfds:NAME:SPLIT)
  --data=hf    the Hugging Face `datasets` cache of nyu-mll/glue (read offline:
               HF_DATASETS_OFFLINE; `datasets` is imported here only)

What must stay true: every layout gives the same rows, in the file's order,
with GLUE's label spellings (tasks.TFDS_HF_NAMES maps the class names of tfds
and Hugging Face); a problem stops the command with one line naming the file
(split) and the row (line, or record) before anything trains: a missing task
directory or file, a row whose cells are not the task's, a header without the
task's columns, an empty text, a label outside the task's set, an empty
split. No row is skipped. The rows are written as JSON lines under
OUT/data/TASK/SPLIT.jsonl, replaced only when their content changes, so a
finished cell's data stays byte for byte what it trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from mlm_jax.evaluation import tasks as tasks_lib
from mlm_jax.finetuning import data as data_lib

DataError = data_lib.DataError
LAYOUTS = ('tfds', 'hf')   # --data names one of these, or a GLUE download directory.


@dataclasses.dataclass(frozen=True)
class TsvLayout:
  """A task's files in a GLUE download: the folder, each split's file, which cells hold what.

  columns: the header's names for the texts and the label, or (headerless,
  CoLA) their positions among `cells` cells.
  """

  folder: str
  texts: tuple[str, ...] | tuple[int, ...]
  label: str | int
  cells: int | None = None           # Headerless files: the cells of every row.
  files: tuple[tuple[str, str], ...] = (('train', 'train.tsv'), ('dev', 'dev.tsv'))

  def file(self, split: str) -> str:
    return dict(self.files)[split]


TSV_LAYOUTS: dict[str, TsvLayout] = {
    'cola': TsvLayout('CoLA', (3,), 1, cells=4),
    'sst2': TsvLayout('SST-2', ('sentence',), 'label'),
    'mrpc': TsvLayout('MRPC', ('#1 String', '#2 String'), 'Quality'),
    'stsb': TsvLayout('STS-B', ('sentence1', 'sentence2'), 'score'),
    'qqp': TsvLayout('QQP', ('question1', 'question2'), 'is_duplicate'),
    'mnli': TsvLayout('MNLI', ('sentence1', 'sentence2'), 'gold_label',
                      files=(('train', 'train.tsv'), ('dev_matched', 'dev_matched.tsv'),
                             ('dev_mismatched', 'dev_mismatched.tsv'))),
    'qnli': TsvLayout('QNLI', ('question', 'sentence'), 'label'),
    'rte': TsvLayout('RTE', ('sentence1', 'sentence2'), 'label'),
    'wnli': TsvLayout('WNLI', ('sentence1', 'sentence2'), 'label'),
}
# The text features of tfds's glue/* and Hugging Face's nyu-mll/glue.
TFDS_HF_TEXTS = {'cola': ('sentence',), 'sst2': ('sentence',),
                 'mrpc': ('sentence1', 'sentence2'), 'stsb': ('sentence1', 'sentence2'),
                 'qqp': ('question1', 'question2'), 'mnli': ('premise', 'hypothesis'),
                 'qnli': ('question', 'sentence'), 'rte': ('sentence1', 'sentence2'),
                 'wnli': ('sentence1', 'sentence2')}


@dataclasses.dataclass(frozen=True)
class Row:
  """One example as read: where it is (for messages), its text(s), its label."""

  where: str      # 'DIR/CoLA/train.tsv line 3' or 'tfds:glue/cola:train record 3'.
  texts: tuple[str, ...]
  label: str | float


def describe(data: str) -> str:
  """What --data names, for messages and results.json."""
  if data == 'tfds':
    return 'tfds glue/* (array_record)'
  if data == 'hf':
    return 'the Hugging Face datasets cache of nyu-mll/glue'
  return f'the GLUE download directory {os.path.abspath(data)}'


def read_split(data: str, task: tasks_lib.Task, split: str,
               tfds_data_dir: str | None = None) -> list[Row]:
  """Every row of `task`'s `split` ('train', 'dev', 'dev_matched', ...) from `data` (a GLUE
  directory, 'tfds' or 'hf'), checked; DataError for the first problem."""
  if data == 'tfds':
    rows = _tfds_rows(task, split, tfds_data_dir)
  elif data == 'hf':
    rows = _hf_rows(task, split)
  else:
    rows = _tsv_rows(data, task, split)
  return list(rows)


# ----------------------------------------------------------- GLUE download


def _tsv_rows(root: str, task: tasks_lib.Task, split: str) -> Iterator[Row]:
  layout = TSV_LAYOUTS[task.name]
  folder = os.path.join(root, layout.folder)
  if not os.path.isdir(root):
    raise FileNotFoundError(f'--data={root}: no such directory (a GLUE download directory, '
                            "or 'tfds' or 'hf').")
  if not os.path.isdir(folder):
    names = ', '.join(name for _, name in layout.files)
    raise DataError(f'{folder}: no such directory; --data={root} must hold {task.title}\'s '
                    f'files there ({names}), as GLUE\'s download script writes them.')
  path = os.path.join(folder, layout.file(split))
  if not os.path.isfile(path):
    raise DataError(f'{path}: no such file; {task.title}\'s {split} split is read from it.')
  lines = enumerate(_lines(path), start=1)
  if layout.cells is None:
    header = next(lines, (1, ''))[1].split('\t')
    missing = [c for c in (*layout.texts, layout.label) if c not in header]
    if missing:
      raise DataError(f'{path} line 1: the header names the columns {header}, without '
                      f"{task.title}'s {missing}; is this {task.title}'s file?")
    cells = len(header)
    picks = tuple(header.index(c) for c in layout.texts), header.index(layout.label)
  else:
    cells, picks = layout.cells, (layout.texts, layout.label)
  count = 0
  for number, line in lines:
    if not line:
      continue
    values = line.split('\t')
    where = f'{path} line {number}'
    if len(values) != cells:
      what = 'the header names' if layout.cells is None else f'{task.title} rows have'
      raise DataError(f'{where}: {len(values)} cells, but {what} {cells}: not '
                      f"{task.title}'s columns (tab-separated, no quoting).")
    texts = tuple(values[i] for i in picks[0])
    for name, text in zip(layout.texts, texts):
      if not text.strip():
        raise DataError(f'{where}: column {name!r} (the text) is empty.')
    yield Row(where, texts, _label(task, values[picks[1]], where))
    count += 1
  if not count:
    raise DataError(f'{path} holds no rows{"" if layout.cells else " after its header"}: '
                    f"{task.title}'s {split} split is empty.")


def _lines(path: str) -> Iterator[str]:
  """The file's lines without their line ending; DataError naming a line that is not UTF-8."""
  with open(path, 'rb') as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = raw.decode('utf-8').rstrip('\r\n')
      except UnicodeDecodeError as e:
        raise DataError(f'{path} line {number}: not UTF-8 text ({e.reason} at byte {e.start} '
                        'of the line).') from e
      # A first line saved with a byte-order mark (as Windows tools write) reads as its names.
      yield line.removeprefix('\ufeff') if number == 1 else line


def _label(task: tasks_lib.Task, value: Any, where: str) -> str | float:
  """The row's label in GLUE's spelling (a float in STS-B's range for regress)."""
  if task.labels is None:
    try:
      x = float(value)
    except (TypeError, ValueError):
      x = math.nan
    low, high = tasks_lib.STSB_RANGE
    if not (math.isfinite(x) and low <= x <= high):
      raise DataError(f'{where}: label {value!r} is not a similarity score in [{low:g}, '
                      f'{high:g}].')
    return x
  label = str(value).strip()
  if label not in task.labels:
    raise DataError(f"{where}: label {value!r} is none of {task.title}'s labels "
                    f'{list(task.labels)}.')
  return label


# ---------------------------------------------------- tfds and Hugging Face


def _class_name(task: tasks_lib.Task, value: Any, where: str) -> str | float:
  """A tfds / Hugging Face label (its class name, or a float for STS-B) in GLUE's spelling."""
  if task.labels is None:
    return _label(task, value, where)
  names = tasks_lib.TFDS_HF_NAMES[task.name]
  if value not in names:
    raise DataError(f"{where}: label {value!r} is none of {task.title}'s classes "
                    f'{list(names)} (an unlabelled split, as GLUE\'s test splits are?).')
  return names[value]


def _tfds_rows(task: tasks_lib.Task, split: str, data_dir: str | None) -> Iterator[Row]:
  spec = f'tfds:glue/{task.name}:{tasks_lib.TFDS_HF_SPLITS[split]}'
  kind = 'pair' if len(TFDS_HF_TEXTS[task.name]) == 2 else 'classify'
  texts = TFDS_HF_TEXTS[task.name]
  fields = data_lib.Fields(text=texts[0], text_pair=texts[1] if len(texts) == 2 else None)
  if task.labels is None:
    kind = 'regress'   # STS-B: read as a pair (finetuning/data.py's regress pairs).
  examples = data_lib.read_examples(spec, kind, fields=fields, tfds_data_dir=data_dir)
  for e in examples:
    where = data_lib.location(spec, e.line)
    yield Row(where, e.texts, _class_name(task, e.label, where))


def _hf_split(task: tasks_lib.Task, split: str) -> Any:
  """nyu-mll/glue's split from the `datasets` cache (never the network)."""
  os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  try:
    import datasets  # pylint: disable=import-outside-toplevel  # the dev extra; only here
  except ImportError as e:
    raise ImportError('--data=hf reads the Hugging Face datasets cache with the `datasets` '
                      "package: pip install datasets (or '.[dev]').") from e
  name = tasks_lib.TFDS_HF_SPLITS[split]
  try:
    return datasets.load_dataset('nyu-mll/glue', task.name, split=name)
  except Exception as e:  # datasets raises many kinds for a cache that lacks the split.
    raise DataError(f'nyu-mll/glue {task.name} {name}: not in the Hugging Face datasets cache '
                    f'({type(e).__name__}: {str(e)[:200]}). Load it once where the hub is '
                    f"reachable: datasets.load_dataset('nyu-mll/glue', '{task.name}').") from None


def _hf_rows(task: tasks_lib.Task, split: str) -> Iterator[Row]:
  dataset = _hf_split(task, split)
  spec = f'nyu-mll/glue {task.name} {tasks_lib.TFDS_HF_SPLITS[split]}'
  columns = TFDS_HF_TEXTS[task.name]
  missing = [c for c in (*columns, 'label') if c not in dataset.column_names]
  if missing:
    raise DataError(f'{spec} has no column(s) {missing}; its columns are '
                    f'{dataset.column_names}.')
  feature = dataset.features['label']
  names = getattr(feature, 'names', None)
  count = 0
  for index, record in enumerate(dataset):
    where = f'{spec} record {index}'
    for c in columns:
      if not isinstance(record[c], str) or not record[c].strip():
        raise DataError(f'{where}: column {c!r} (the text) is empty.')
    value = record['label']
    if names is not None:
      value = names[value] if 0 <= value < len(names) else value
    yield Row(where, tuple(record[c] for c in columns), _class_name(task, value, where))
    count += 1
  if not count:
    raise DataError(f"{spec} holds no rows: {task.title}'s {split} split is empty.")


# --------------------------------------------------------------- writing


def as_record(task: tasks_lib.Task, row: Row) -> dict[str, Any]:
  """A row as finetuning/data.py reads it: text (one text) or text_a, text_b; label."""
  if len(row.texts) == 1:
    return {'text': row.texts[0], 'label': row.label}
  return {'text_a': row.texts[0], 'text_b': row.texts[1], 'label': row.label}


def subsample(rows: list[Row], most: int | None, seed: int = 0) -> list[Row]:
  """At most `most` rows (None: all), drawn by `seed` and kept in the file's order."""
  if most is None or len(rows) <= most:
    return rows
  keep = np.sort(np.random.default_rng(seed).permutation(len(rows))[:most])
  return [rows[i] for i in keep]


def _serialized(task: tasks_lib.Task, rows: list[Row]) -> bytes:
  return ''.join(json.dumps(as_record(task, r), ensure_ascii=False) + '\n'
                 for r in rows).encode('utf-8')


def rows_digest(task: tasks_lib.Task, rows: list[Row]) -> str:
  """sha256 of the JSON lines write_rows writes for `rows`."""
  return hashlib.sha256(_serialized(task, rows)).hexdigest()


def write_rows(path: str, task: tasks_lib.Task, rows: list[Row]) -> str:
  """Writes `rows` as JSON lines at `path` unless it already holds them; returns their sha256.

  The file is replaced whole (a temporary file, then a rename), never half written.
  """
  data = _serialized(task, rows)
  digest = hashlib.sha256(data).hexdigest()
  if os.path.exists(path) and file_digest(path) == digest:
    return digest
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)
  return digest


def file_digest(path: str) -> str:
  """sha256 of a file's bytes."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()
