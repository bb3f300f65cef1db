"""Fine-tuning data: reading labelled files or tfds splits, checking every row, encoding them.

Files are JSON lines (.jsonl), CSV (.csv) or TSV (.tsv) with a header row;
`tfds:NAME:SPLIT` names a split of a tfds dataset prepared on disk in
array_record format (data/tfds_source.py), whose features are read as a
.jsonl row's fields (a ClassLabel as its name). The fields each task reads,
under these names unless `Fields` (config.data.*_field) names others:

  classify   text, label (a string or an integer)
  regress    text, label (a number); or a pair's two texts as for pair (STS-B's
             sentence1, sentence2), encoded as a pair
  pair       text_a, text_b (or another pair of PAIR_FIELDS), label; encoded
             [CLS] a [SEP] b [SEP], segment 0 up to the first [SEP], 1 after
             (RoBERTa: <s> a </s></s> b </s>, one segment; see RowFormat)
  tag        tokens, tags: lists of equal length (JSON lines or tfds only);
             each word is encoded on its own (as after a space) and its first
             piece carries its tag

A tfds split without a 'text' feature gives its only text feature for
classify and regress (a regress split with a pair of PAIR_FIELDS and no
'text' reads the pair). Every problem (a missing or empty field, a label the
training file does not have, a pair without a side, tag lists of other
lengths, no rows at all, a tfds dataset, split or feature that is not there)
raises DataError naming the file (split), the line (record) and the field,
before anything is built; no row is skipped. Texts longer than the sequence
length are truncated and counted (`Encoded.truncated`). Numpy only, like data/.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlm_jax.errors import ConfigError
from mlm_jax.data import corpus
from mlm_jax.data import tfds_source
from mlm_jax.data import tokenizer as tok_lib

TASKS = ('classify', 'pair', 'regress', 'tag')
# Tasks whose output is one label per input (softmax over labels).
CLASSIFICATION_TASKS = ('classify', 'pair')
# Tasks that read a pair of texts: pair always, regress where a row has one (STS-B).
PAIRED_TASKS = ('pair', 'regress')
# Field names of a pair's two texts, unless config.data.text_field and text_pair_field
# name them: the first pair a row (a tfds split's features) uses wins. After ours and
# Hugging Face's, GLUE's (MRPC, RTE, WNLI; QQP; MNLI; QNLI), so that its tfds splits
# need no field names.
PAIR_FIELDS = (('text_a', 'text_b'), ('text', 'text_pair'), ('sentence1', 'sentence2'),
               ('question1', 'question2'), ('premise', 'hypothesis'), ('question', 'sentence'))
_FORMATS = {'.jsonl': 'jsonl', '.csv': 'csv', '.tsv': 'tsv'}
Label = str | int


class DataError(corpus.CorpusError):
  """A fine-tuning file cannot be used as it is; the message names file, line and field."""


@dataclasses.dataclass(frozen=True)
class Fields:
  """Which field of a row (a column, a JSON key, a tfds feature) holds each input of a task.

  text None: 'text' (in a tfds split without one, its only text feature).
  For pair, text and text_pair name the first and second text; both None:
  the first of PAIR_FIELDS that a row uses.
  """

  text: str | None = None
  text_pair: str | None = None
  label: str = 'label'
  tokens: str = 'tokens'
  tags: str = 'tags'

  @classmethod
  def from_config(cls, data: Any) -> Fields:
    """From config.data (or its dict): the `<name>_field` settings, defaults where unset."""
    given = {f.name: data.get(f'{f.name}_field') for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in given.items() if value is not None})

  def check(self, task: str) -> None:
    """ConfigError for names the task cannot use as given."""
    if task == 'pair' and (self.text is None) != (self.text_pair is None):
      missing = 'text_pair_field' if self.text_pair is None else 'text_field'
      raise ConfigError(f"task 'pair' reads two texts, and only one is named: set "
                        f'config.data.{missing} too (or neither, for the usual names).')
    if task not in PAIRED_TASKS and self.text_pair is not None:
      raise ConfigError(f"config.data.text_pair_field={self.text_pair!r} is for tasks 'pair' "
                        f"and 'regress' only, not {task!r}.")
    if task == 'regress' and self.text_pair is not None and self.text is None:
      raise ConfigError("task 'regress' with config.data.text_pair_field reads a pair: name its "
                        'first text with config.data.text_field too.')


@dataclasses.dataclass(frozen=True)
class Example:
  """One row: where it is, its text(s) (two for pair; the words for tag) and its label.

  line: the line of a file, or the index of a tfds split's record.
  """

  line: int
  texts: tuple[str, ...]
  # Label (classify, pair), float (regress), list of tags (tag); None: unlabelled.
  label: Any = None


# ------------------------------------------------------------------ reading


def _rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
  """(line number, row as a dict) of a .jsonl, .csv or .tsv file."""
  fmt = _FORMATS.get(os.path.splitext(path)[1].lower())
  if fmt is None:
    raise DataError(f'{path}: unknown format; name it .jsonl, .csv or .tsv.')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file.')
  lines = _lines(path)
  if fmt == 'jsonl':
    for number, line in enumerate(lines, start=1):
      if line.strip():
        yield number, _json_object(path, number, line)
    return
  reader = csv.DictReader(lines, delimiter='\t' if fmt == 'tsv' else ',')
  for row in reader:
    if None in row:   # More cells than the header names: a quoting problem, most likely.
      raise DataError(f'{path} line {reader.line_num}: {len(row) - 1 + len(row[None])} '
                      f'cells, but the header names {len(reader.fieldnames)} columns.')
    yield reader.line_num, row


def _lines(path: str) -> Iterator[str]:
  """The file's lines as text, line endings kept (as csv wants them); DataError naming the first
  line that is not UTF-8 (a text-mode read fails without saying where)."""
  with open(path, 'rb') as f:
    for number, line in enumerate(f, start=1):
      try:
        yield line.decode('utf-8')
      except UnicodeDecodeError as e:
        raise DataError(f'{path} line {number}: not UTF-8 text ({e.reason} at byte {e.start} '
                        'of the line).') from e


def _json_object(path: str, number: int, line: str) -> dict[str, Any]:
  try:
    row = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f'{path} line {number}: not valid JSON ({e.msg}).') from e
  if not isinstance(row, dict):
    raise DataError(f'{path} line {number}: a JSON object is needed, not {type(row).__name__}.')
  return row


def _field(path: str, number: int, row: dict[str, Any], name: str) -> Any:
  """row[name], neither missing nor empty."""
  value = row.get(name)
  if value is None:
    raise DataError(f'{location(path, number)}: field {name!r} is missing.')
  if (isinstance(value, str) and not value.strip()) or (isinstance(value, list) and not value):
    raise DataError(f'{location(path, number)}: field {name!r} is empty.')
  return value


def _text(path: str, number: int, row: dict[str, Any], name: str) -> str:
  value = _field(path, number, row, name)
  if not isinstance(value, str):
    raise DataError(f'{location(path, number)}: field {name!r} must be a string, not '
                    f'{type(value).__name__}.')
  return value


def _class_label(path: str, number: int, value: Any, name: str = 'label') -> Label:
  if isinstance(value, bool) or not isinstance(value, (str, int)):
    raise DataError(f'{location(path, number)}: field {name!r} must be a string or an integer, '
                    f'not {value!r}.')
  if isinstance(value, str) and not value.strip():
    raise DataError(f'{location(path, number)}: field {name!r} is empty.')
  return value.strip() if isinstance(value, str) else value


def _number(path: str, number: int, value: Any, name: str) -> float:
  try:
    x = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    x = math.nan
  if not math.isfinite(x):
    raise DataError(f"{location(path, number)}: field {name!r} must be a finite number for task "
                    f"'regress', not {value!r}.")
  return x


def _pair_fields(fields: Fields) -> tuple[tuple[str, str], ...]:
  return ((fields.text, fields.text_pair),) if fields.text else PAIR_FIELDS


def _pair_texts(path: str, number: int, row: dict[str, Any], fields: Fields) -> tuple[str, str]:
  pairs = _pair_fields(fields)
  for first, second in pairs:
    if first in row or second in row:
      return _text(path, number, row, first), _text(path, number, row, second)
  names = ' or '.join(f'{a!r} and {b!r}' for a, b in pairs)
  raise DataError(f'{location(path, number)}: fields {names} are missing (name others with '
                  'config.data.text_field and text_pair_field).')


def _tag_example(path: str, number: int, row: dict[str, Any], labelled: bool,
                 fields: Fields) -> Example:
  tokens, tags_name = fields.tokens, fields.tags
  words = _field(path, number, row, tokens)
  if not isinstance(words, list):
    raise DataError(f'{location(path, number)}: field {tokens!r} must be a list of words.')
  for i, word in enumerate(words):
    if not isinstance(word, str) or not word.strip():
      raise DataError(f'{location(path, number)}: field {tokens!r} item {i} must be a non-empty '
                      f'word, not {word!r}.')
  if not labelled:
    return Example(number, tuple(words))
  tags = _field(path, number, row, tags_name)
  if not isinstance(tags, list) or len(tags) != len(words):
    size = len(tags) if isinstance(tags, list) else type(tags).__name__
    raise DataError(f'{location(path, number)}: field {tags_name!r} must be a list of '
                    f'{len(words)} tags, one per item of {tokens!r}; it has {size}.')
  return Example(number, tuple(words), [_class_label(path, number, t, f'{tags_name}[{i}]')
                                        for i, t in enumerate(tags)])


def _regress_pair(row: dict[str, Any], fields: Fields) -> bool:
  """Whether a regress row is a pair: its fields named as one, else no 'text' but a pair of
  PAIR_FIELDS (STS-B's sentence1, sentence2)."""
  if fields.text_pair is not None:
    return True
  if fields.text is not None or 'text' in row:
    return False
  return any(first in row or second in row for first, second in PAIR_FIELDS)


def _example(path: str, task: str, number: int, row: dict[str, Any], labelled: bool,
             fields: Fields) -> Example:
  if task == 'tag':
    return _tag_example(path, number, row, labelled, fields)
  if task == 'pair' or (task == 'regress' and _regress_pair(row, fields)):
    texts = _pair_texts(path, number, row, fields)
  else:
    texts = (_text(path, number, row, fields.text or 'text'),)
  if not labelled:
    return Example(number, texts)
  value = _field(path, number, row, fields.label)
  if task == 'regress':
    return Example(number, texts, _number(path, number, value, fields.label))
  return Example(number, texts, _class_label(path, number, value, fields.label))


def read_examples(path: str, task: str, labelled: bool = True, fields: Fields = Fields(),
                  tfds_data_dir: str | None = None) -> list[Example]:
  """Every row of `path` (a file, or tfds:NAME:SPLIT) as an Example.

  DataError for the first bad row or an empty file or split; tfds_data_dir:
  where tfds datasets are prepared (None: tfds's default).
  """
  if task not in TASKS:
    raise DataError(f'unknown task {task!r}: use {", ".join(TASKS)}.')
  fields.check(task)
  if tfds_source.is_spec(path):
    fields, rows = _tfds_rows(path, task, labelled, fields, tfds_data_dir)
  elif task == 'tag' and not path.lower().endswith('.jsonl'):
    raise DataError(f"{path}: task 'tag' reads JSON lines (.jsonl) or a tfds split, with "
                    f'{fields.tokens!r} and {fields.tags!r} lists.')
  else:
    rows = _rows(path)
  examples = [_example(path, task, number, row, labelled, fields) for number, row in rows]
  if not examples:
    raise DataError(f'{path} holds no examples.')
  return examples


def location(path: str, number: int) -> str:
  """'FILE line N', or 'tfds:NAME:SPLIT record N' (N: the record's index in the split)."""
  return f'{path} {"record" if tfds_source.is_spec(path) else "line"} {number}'


def _tfds_rows(spec: str, task: str, labelled: bool, fields: Fields, data_dir: str | None
               ) -> tuple[Fields, Iterator[tuple[int, dict[str, Any]]]]:
  """(the fields read, named as the split's features; its records as rows).

  The split is opened and its features matched to the task's fields here,
  before any record is read; DataError naming the fix for either.
  """
  try:
    split = tfds_source.open_spec(spec, data_dir, 'config.data.tfds_data_dir')
  except tfds_source.TfdsError as e:
    raise DataError(str(e)) from None
  if task == 'tag':
    names = [_feature(split, fields.tokens, 'tokens_field')]
    names += [_feature(split, fields.tags, 'tags_field')] if labelled else []
  else:
    if task == 'pair' or (task == 'regress' and _regress_pair(dict(split.kinds), fields)):
      fields = dataclasses.replace(fields, **_tfds_pair(split, fields))
      names = [fields.text, fields.text_pair]
    else:
      fields = dataclasses.replace(fields, text=_tfds_text(split, fields))
      names = [fields.text]
    names += [_feature(split, fields.label, 'label_field')] if labelled else []

  def rows() -> Iterator[tuple[int, dict[str, Any]]]:
    try:
      yield from tfds_source.rows(split, names)
    except tfds_source.TfdsError as e:
      raise DataError(str(e)) from None

  return fields, rows()


def _feature(split: tfds_source.Split, name: str, setting: str) -> str:
  """`name`, a feature of `split` (DataError naming the split's features and the setting if not)."""
  if name not in split.kinds:
    raise DataError(f'{split.spec} has no feature {name!r} (config.data.{setting}); its features '
                    f'are {sorted(split.kinds)}.')
  return name


def _tfds_text(split: tfds_source.Split, fields: Fields) -> str:
  """The feature holding the text: the one named, else 'text', else the only text feature."""
  if fields.text is not None or 'text' in split.kinds:
    return _feature(split, fields.text or 'text', 'text_field')
  texts = split.features_of_kind('text')
  if len(texts) != 1:
    raise DataError(f"{split.spec} has no feature 'text' and {len(texts)} text features "
                    f'{sorted(texts)}: name the one to read with config.data.text_field '
                    f'(its features are {sorted(split.kinds)}).')
  return texts[0]


def _tfds_pair(split: tfds_source.Split, fields: Fields) -> dict[str, str]:
  """{'text': first, 'text_pair': second}: the pair named, else the first of PAIR_FIELDS there."""
  for first, second in _pair_fields(fields):
    if first in split.kinds and second in split.kinds:
      return {'text': first, 'text_pair': second}
  if fields.text:
    return {'text': _feature(split, fields.text, 'text_field'),
            'text_pair': _feature(split, fields.text_pair, 'text_pair_field')}
  raise DataError(f'{split.spec} has none of the pairs of features {list(PAIR_FIELDS)}: name '
                  'its two texts with config.data.text_field and config.data.text_pair_field '
                  f'(its features are {sorted(split.kinds)}).')


# ------------------------------------------------------------------- labels


def _label_key(label: Label) -> tuple[bool, Any]:
  return isinstance(label, str), label   # Integers first, in order; then strings.


def infer_labels(examples: Sequence[Example], task: str) -> list[Label] | None:
  """The sorted labels (tags) of a training file; None for 'regress'."""
  if task == 'regress':
    return None
  seen = {t for e in examples for t in e.label} if task == 'tag' else {e.label for e in examples}
  return sorted(seen, key=_label_key)


def check_labels(examples: Sequence[Example], labels: Sequence[Label] | None, task: str,
                 path: str, fields: Fields = Fields()) -> None:
  """DataError for the first label (tag) of `path` that `labels` (the training file's) lacks."""
  if labels is None:
    return
  known = set(labels)
  for e in examples:
    values = enumerate(e.label) if task == 'tag' else [(None, e.label)]
    for i, value in values:
      if value not in known:
        name = fields.label if i is None else f'{fields.tags}[{i}]'
        raise DataError(f'{location(path, e.line)}: field {name!r} is {value!r}, which the '
                        f'training file does not have (it has {list(labels)}).')


# ----------------------------------------------------------------- encoding


@dataclasses.dataclass
class Encoded:
  """A file's rows as arrays of one sequence length T (N rows).

  input_ids, segment_ids, attention_mask [N, T] int32; targets [N] (int32
  label index, or float32 for regress) or [N, T] int32 (tag: the tag index at
  each word's first piece); weights [N] or [N, T] float32 (0: no target).
  word_starts: tag only, each row's position of each word's first piece (-1:
  cut off by truncation). truncated: rows longer than T, cut to fit.
  """

  input_ids: np.ndarray
  segment_ids: np.ndarray
  attention_mask: np.ndarray
  targets: np.ndarray
  weights: np.ndarray
  truncated: int
  word_starts: list[np.ndarray] | None = None

  def __len__(self) -> int:
    return len(self.input_ids)

  def arrays(self) -> dict[str, np.ndarray]:
    return {'input_ids': self.input_ids, 'segment_ids': self.segment_ids,
            'attention_mask': self.attention_mask, 'targets': self.targets,
            'weights': self.weights}

  def longest(self) -> int:
    """Positions the longest row fills (its [CLS] and [SEP]s included)."""
    return int(self.attention_mask.sum(axis=1).max(initial=0))

  def trimmed(self, seq_len: int) -> Encoded:
    """The same rows in `seq_len` positions; only padding may be cut (seq_len >= longest())."""
    if seq_len < self.longest():
      raise ValueError(f'trimming to {seq_len} positions would cut rows of {self.longest()}.')
    per_position = self.targets.ndim == 2
    return dataclasses.replace(
        self, input_ids=self.input_ids[:, :seq_len], segment_ids=self.segment_ids[:, :seq_len],
        attention_mask=self.attention_mask[:, :seq_len],
        targets=self.targets[:, :seq_len] if per_position else self.targets,
        weights=self.weights[:, :seq_len] if per_position else self.weights)


def _pair_lengths(a: int, b: int, budget: int) -> tuple[int, int]:
  """Pieces kept of a pair's texts: the longer is cut first (Hugging Face's 'longest_first')."""
  if a + b <= budget:
    return a, b
  short = min(a, b)
  if short <= budget // 2:
    return (a, budget - a) if a == short else (budget - b, b)
  return budget - budget // 2, budget // 2   # Both cut; a tie takes from the second first.


@dataclasses.dataclass(frozen=True)
class RowFormat:
  """How a row frames its text(s): the tokenizer's special ids and the model family's pair form.

  single  [CLS] a [SEP] padded with [PAD] (the ids of the tokenizer's roles:
          <s>, </s>, <pad> for RoBERTa);
  pair    [CLS] a [SEP] b [SEP], or [CLS] a [SEP] [SEP] b [SEP] with
          `pair_separators` 2 (RoBERTa's form). Segment 1 from b on when the
          model has token types (`segments`), else every position is 0.
  """

  specials: tok_lib.Specials
  pair_separators: int = 1
  segments: bool = True

  @classmethod
  def for_model(cls, specials: tok_lib.Specials, variant: str,
                type_vocab_size: int) -> RowFormat:
    """The rows an encoder of `variant` with `type_vocab_size` token types was pretrained on."""
    return cls(specials, pair_separators=2 if variant == 'roberta' else 1,
               segments=type_vocab_size > 1)


def sequence_rows(pieces: Sequence[Sequence[Sequence[int]]], seq_len: int,
                  fmt: RowFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """Each row's texts (1 or 2 lists of ids) -> [N, T] ids, segments, attention mask; rows cut."""
  s = fmt.specials
  ids = np.full((len(pieces), seq_len), s.pad, np.int32)
  segments = np.zeros((len(pieces), seq_len), np.int32)
  mask = np.zeros((len(pieces), seq_len), np.int32)
  truncated = 0
  for r, texts in enumerate(pieces):
    if len(texts) == 1:
      keep = (min(len(texts[0]), seq_len - 2),)
    else:
      keep = _pair_lengths(len(texts[0]), len(texts[1]), seq_len - 2 - fmt.pair_separators)
    truncated += any(k < len(t) for k, t in zip(keep, texts))
    row = [s.cls, *texts[0][:keep[0]], s.sep]
    if len(texts) == 2:   # Segment 1: the second text and its [SEP].
      row += [s.sep] * (fmt.pair_separators - 1)
      second = len(row)
      row += [*texts[1][:keep[1]], s.sep]
      if fmt.segments:
        segments[r, second:len(row)] = 1
    ids[r, :len(row)] = row
    mask[r, :len(row)] = 1
  return ids, segments, mask, truncated


def _tag_rows(words: Sequence[Sequence[Sequence[int]]], tags: Sequence[np.ndarray] | None,
              seq_len: int, specials: tok_lib.Specials
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray], int]:
  """Each row's words (as ids) -> ids, mask, targets, weights [N, T], word starts, rows cut."""
  n = len(words)
  ids = np.full((n, seq_len), specials.pad, np.int32)
  mask = np.zeros((n, seq_len), np.int32)
  targets = np.zeros((n, seq_len), np.int32)
  weights = np.zeros((n, seq_len), np.float32)
  starts, truncated = [], 0
  for r, row_words in enumerate(words):
    lengths = np.array([len(w) for w in row_words])
    first = 1 + np.concatenate([[0], np.cumsum(lengths)[:-1]])       # Position of each word.
    flat = [i for w in row_words for i in w][:seq_len - 2]
    ids[r, :len(flat) + 2] = [specials.cls, *flat, specials.sep]
    mask[r, :len(flat) + 2] = 1
    kept = first <= len(flat)
    truncated += len(flat) < lengths.sum()
    starts.append(np.where(kept, first, -1))
    if tags is not None:
      targets[r, first[kept]] = tags[r][kept]
      weights[r, first[kept]] = 1.0
  return ids, mask, targets, weights, starts, truncated


def encode(examples: Sequence[Example], task: str, tokenizer: tok_lib.Tokenizer, seq_len: int,
           labels: Sequence[Label] | None = None, path: str = '',
           fields: Fields = Fields(), row_format: RowFormat | None = None) -> Encoded:
  """Examples -> arrays of length `seq_len` ([CLS] ... [SEP] (b [SEP])); targets when labelled.

  `labels`: the training file's labels (their index is the target); None
  for regress and for unlabelled examples. `path`, `fields`: where the
  examples were read, for messages. `row_format`: how rows are framed (None:
  the tokenizer's specials, BERT's pair form with token types). Texts are
  corpus text: a special token's spelling in them is plain text.
  """
  fmt = row_format or RowFormat(tokenizer.specials)
  index = {label: i for i, label in enumerate(labels or ())}
  labelled = bool(examples) and examples[0].label is not None
  if task == 'tag':
    # Each word as it reads inside a sentence: after a space (byte-level BPE
    # spells that 'Ġword'; sentencepiece and WordPiece drop the space).
    words = _encode_nested(tokenizer, [[' ' + w for w in e.texts] for e in examples])
    _check_words(examples, words, path, fields.tokens)
    tags = [np.array([index[t] for t in e.label], np.int32) for e in examples] if labelled else None
    ids, mask, targets, weights, starts, truncated = _tag_rows(words, tags, seq_len,
                                                               fmt.specials)
    return Encoded(ids, np.zeros_like(ids), mask, targets, weights, truncated, starts)
  pieces = _encode_nested(tokenizer, [e.texts for e in examples])
  ids, segments, mask, truncated = sequence_rows(pieces, seq_len, fmt)
  if not labelled:
    targets = np.zeros(len(examples), np.float32 if task == 'regress' else np.int32)
  elif task == 'regress':
    targets = np.array([e.label for e in examples], np.float32)
  else:
    targets = np.array([index[e.label] for e in examples], np.int32)
  return Encoded(ids, segments, mask, targets,
                 np.full(len(examples), float(labelled), np.float32), truncated)


def _check_words(examples: Sequence[Example], words: Sequence[Sequence[Sequence[int]]],
                 path: str, field: str) -> None:
  """DataError for a word the tokenizer turns into no piece at all (it could carry no tag)."""
  for e, row in zip(examples, words):
    for i, ids in enumerate(row):
      if not ids:
        raise DataError(f'{location(path, e.line)}: field {field!r} item {i} ({e.texts[i]!r}) '
                        'has no piece in the tokenizer.')


def _encode_nested(tokenizer: tok_lib.Tokenizer,
                   groups: Sequence[Sequence[str]]) -> list[list[list[int]]]:
  """Ids of every text of every group, in one call to the tokenizer."""
  flat = tokenizer.encode_documents([tok_lib.sanitize(t) for g in groups for t in g])
  out, i = [], 0
  for g in groups:
    out.append(flat[i:i + len(g)])
    i += len(g)
  return out


def describe_truncation(encoded: Encoded, path: str, seq_len: int) -> str:
  """'' or the line that says how many rows of `path` were cut to `seq_len` pieces."""
  if not encoded.truncated:
    return ''
  return (f'{path}: {encoded.truncated} of {len(encoded)} rows are longer than seq_len={seq_len} '
          'pieces and were truncated (raise --config.data.seq_len to keep more).')
