"""A split of a tfds dataset prepared on disk, read without TensorFlow.

tfds's array_record data sources give random access to a split's records as
numpy values with no TensorFlow installed; a split prepared as tfrecord
needs TensorFlow and is refused, naming the commands that convert it.
Pretraining reads one text feature of a split as its corpus (corpus.py,
`config.data.tfds_name`); fine-tuning and predict read labelled records
named on the command line as

  tfds:NAME:SPLIT         e.g. tfds:glue/sst2:train, tfds:glue/sst2:validation[:50%]

NAME as tfds spells it (with a `:VERSION` of digits and dots if wanted),
SPLIT in tfds's slicing syntax. `rows` gives a split's records as a
.jsonl file's rows are: str for text, int and float for numbers, lists for
sequences, and a ClassLabel's name for its integer.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np

PREFIX = 'tfds:'
DEFAULT_DATA_DIR = 'the default tfds data dir (~/tensorflow_datasets or $TFDS_DATA_DIR)'
# tfds:NAME[:VERSION][:SPLIT]; a split expression may hold colons (train[:10%]).
_SPEC = re.compile(r'tfds:(?P<name>[^:]*(?::\d+(?:\.\d+)*)?)(?::(?P<split>.*))?', re.DOTALL)
# Records read per call to the data source (one call reads them in parallel).
_READ_BATCH = 1024


class TfdsError(ValueError):
  """A tfds dataset or split that cannot be read as named; the message names the fix."""


def is_spec(name: str) -> bool:
  """Whether a data option names a tfds split (tfds:...) rather than a file."""
  return name.startswith(PREFIX)


def parse_spec(spec: str) -> tuple[str, str]:
  """'tfds:NAME:SPLIT' -> (NAME, SPLIT); TfdsError naming the syntax when a part is missing."""
  match = _SPEC.fullmatch(spec)
  name, split = (match['name'], match['split']) if match else ('', None)
  example = f'{PREFIX}{name or "glue/sst2"}:train'
  if not name:
    raise TfdsError(f'{spec!r} names no dataset; write tfds:NAME:SPLIT, e.g. {example}.')
  if not split:
    raise TfdsError(f'{spec!r} names no split; write tfds:NAME:SPLIT, e.g. {example}.')
  return name, split


def open_split(name: str, split: str, data_dir: str | None, what: str,
               data_dir_field: str) -> Any:
  """tfds's random-access source of `split` of dataset `name` prepared in `data_dir`.

  what: how the user named the split (a config field, a flag), and
  data_dir_field: the setting that moves the data dir; both for messages.
  """
  import tensorflow_datasets as tfds  # Only tfds data pays for the import.
  data_dir = os.path.expanduser(data_dir) if data_dir else None
  where = data_dir or DEFAULT_DATA_DIR
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except NotImplementedError as e:
    raise TfdsError(
        f'{what} is prepared in {where} in a format that needs TensorFlow to read (tfrecord); '
        f'mlm_jax reads array_record. Prepare it again with `tfds build {name} '
        '--file_format=array_record`, or convert it once (with TensorFlow installed) with '
        '`tfds convert_format --dataset_dir=DIR --out_file_format=array_record`. '
        f'({str(e).splitlines()[0]})') from None
  except Exception as e:  # tfds raises many kinds for a missing dataset or split.
    detail = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
    splits = _prepared_splits(tfds, name, data_dir)
    if splits:   # The dataset is there: the split expression is what is wrong.
      raise TfdsError(f'{what}: {name} in {where} has no split {split!r} ({detail}); its splits '
                      f'are {splits}, sliced as tfds does (train[:10%]).') from None
    raise TfdsError(
        f'{what}: no such dataset or split prepared in {where} ({detail}). Prepare it with '
        f'`tfds build {name} --file_format=array_record`, or set {data_dir_field} to where it '
        'is.') from None


def _prepared_splits(tfds: Any, name: str, data_dir: str | None) -> list[str]:
  """The split names of dataset `name` prepared in `data_dir`; [] if it is not there."""
  try:
    return sorted(tfds.builder(name, data_dir=data_dir).info.splits.keys())
  except Exception:  # pylint: disable=broad-except  Not there, in whatever way tfds says so.
    return []


@dataclasses.dataclass(frozen=True)
class Split:
  """An opened split: its source and what kind of value each feature holds."""

  spec: str
  source: Any
  # Feature -> 'text', 'class' (ClassLabel), 'number', a list of one of these
  # ('list of text', ...), or 'other' (images, nested dicts: not read here).
  kinds: dict[str, str]
  class_names: dict[str, list[str]]   # ClassLabel features (or lists of them) -> their names.

  def __len__(self) -> int:
    return len(self.source)

  def features_of_kind(self, kind: str) -> list[str]:
    return [name for name, k in self.kinds.items() if k == kind]


def open_spec(spec: str, data_dir: str | None, data_dir_field: str) -> Split:
  """The split that `spec` (tfds:NAME:SPLIT) names, opened; TfdsError naming the fix."""
  name, split = parse_spec(spec)
  source = open_split(name, split, data_dir, spec, data_dir_field)
  kinds, class_names = {}, {}
  for feature, connector in source.dataset_info.features.items():
    kinds[feature], names = _kind(connector)
    if names is not None:
      class_names[feature] = names
  return Split(spec, source, kinds, class_names)


def _kind(connector: Any) -> tuple[str, list[str] | None]:
  """(kind, class names or None) of a feature connector (see Split.kinds)."""
  import tensorflow_datasets as tfds
  features = tfds.features
  if isinstance(connector, features.Sequence):
    kind, names = _kind(connector.feature)
    return ('other' if kind.startswith(('list', 'other')) else f'list of {kind}'), names
  if isinstance(connector, features.ClassLabel):
    return 'class', list(connector.names)
  if isinstance(connector, features.Text):
    return 'text', None
  if isinstance(connector, features.Tensor) and connector.shape == ():
    dtype = np.dtype(connector.np_dtype)
    if dtype.kind in 'iuf':
      return 'number', None
    if dtype.kind in 'SUO':   # tf.string scalars that are not Text features.
      return 'text', None
  return 'other', None


def rows(split: Split, fields: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
  """(record index, {field: value}) for every record, `fields` only, as Python values.

  A ClassLabel's integer becomes its name; one that is no class (-1: an
  unlabelled split, as GLUE's test splits are) raises TfdsError.
  """
  for start in range(0, len(split.source), _READ_BATCH):
    indices = list(range(start, min(start + _READ_BATCH, len(split.source))))
    for index, record in zip(indices, split.source.__getitems__(indices)):
      yield index, {f: _python(split, index, f, record[f]) for f in fields if f in record}


def _python(split: Split, index: int, field: str, value: Any) -> Any:
  """A record's numpy value as the JSON value a .jsonl row would hold."""
  if isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, (bytes, str)):
    return [_python(split, index, field, v) for v in value]
  if isinstance(value, bytes):
    try:
      return value.decode('utf-8')
    except UnicodeDecodeError as e:
      raise TfdsError(f'{split.spec} record {index}: field {field!r} is not UTF-8 text '
                      f'({e.reason} at byte {e.start}).') from None
  if isinstance(value, np.generic):
    value = value.item()
  names = split.class_names.get(field)
  if names is not None and isinstance(value, int):
    if not 0 <= value < len(names):
      raise TfdsError(
          f'{split.spec} record {index}: field {field!r} is {value}, which is none of the '
          f"dataset's {len(names)} classes (an unlabelled split, as GLUE's test splits are): "
          'train and evaluate on a labelled split.')
    return names[value]
  return value
