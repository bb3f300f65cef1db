"""Embedding data: (query, positive, negatives) pairs, BEIR directories, STS files; encoded rows.

Inputs, read whole (numpy only, like data/):

  pairs    .jsonl or .parquet rows {query, positive, negatives}: two texts and an
           optional list of hard negatives (one text is a list of one); the field
           names are config.data.*_field
  BEIR     a directory with corpus.jsonl ({_id, title, text}), queries.jsonl
           ({_id, text}) and qrels/<split>.tsv (query-id, corpus-id, score, after a
           header row): training pairs are the rows of score > 0, evaluation reads
           the whole corpus and the queries the split judges
  STS      .jsonl, .csv or .tsv rows of two texts (sentence1/sentence2 or another of
           fine-tuning's PAIR_FIELDS) and a number (score, else label)

What must stay true: a bad row (a pair without a positive, a qrels row
naming a query or document the directory does not have, a score that is not
a number) raises DataError naming the file, the line and the field, before
anything is built; no row is skipped. A document's text is BEIR's (title,
a space, text). Texts are encoded once each ([CLS] text [SEP], as
fine-tuning frames one text) into a table; a pair is indices into it, so a
document shared by many pairs costs one row.
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

from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import batches as batches_lib
from mlm_jax.finetuning import data as finetune_data
from mlm_jax.finetuning.data import DataError

# The files of a BEIR directory (BEIR's GenericDataLoader reads the same names).
CORPUS_FILE, QUERIES_FILE, QRELS_DIR = 'corpus.jsonl', 'queries.jsonl', 'qrels'


@dataclasses.dataclass(frozen=True)
class PairFields:
  """Which field of a jsonl or parquet row holds the query, the positive, the negatives."""

  query: str = 'query'
  positive: str = 'positive'
  negatives: str = 'negatives'

  @classmethod
  def from_config(cls, data: Any) -> PairFields:
    return cls(data['query_field'], data['positive_field'], data['negatives_field'])


@dataclasses.dataclass(frozen=True)
class Pair:
  """One training example: a query, its positive document and its hard negatives."""

  query: str
  positive: str
  negatives: tuple[str, ...] = ()


# ------------------------------------------------------------------ reading


def is_beir_dir(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, CORPUS_FILE))


def read_pairs(path: str, fields: PairFields = PairFields(), beir_split: str = 'train'
               ) -> list[Pair]:
  """The training pairs of a .jsonl or .parquet file, or of a BEIR directory's split."""
  if os.path.isdir(path):
    if not is_beir_dir(path):
      raise DataError(f'{path}: a directory of training pairs must be a BEIR directory '
                      f'({CORPUS_FILE}, {QUERIES_FILE}, {QRELS_DIR}/{beir_split}.tsv).')
    return Beir.read(path).pairs(beir_split)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no such file or directory.')
  if path.endswith('.parquet'):
    rows = _parquet_rows(path, fields)
  elif path.endswith('.jsonl'):
    rows = _jsonl_rows(path)
  else:
    raise DataError(f'{path}: unknown format; give a .jsonl or .parquet file of pairs, or a '
                    'BEIR directory.')
  pairs = [_pair(where, row, fields) for where, row in rows]
  if not pairs:
    raise DataError(f'{path}: no pairs.')
  return pairs


def _jsonl_rows(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
  with open(path, 'rb') as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise DataError(f'{path} line {number}: not UTF-8 text ({e.reason}).') from e
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f'{path} line {number}: not valid JSON ({e.msg}).') from e
      if not isinstance(row, dict):
        raise DataError(f'{path} line {number}: a JSON object is needed, not '
                        f'{type(row).__name__}.')
      yield f'{path} line {number}', row


def _parquet_rows(path: str, fields: PairFields) -> Iterator[tuple[str, dict[str, Any]]]:
  # pyarrow's home is data/arrow_source.py, which reads one text column as documents; a
  # pair is three columns, one of them a list, so they are read here, whole.
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  try:
    table = pq.read_table(path)
  except Exception as e:  # pylint: disable=broad-except  # ArrowInvalid and OSError alike.
    raise DataError(f'{path}: not a readable parquet file ({e}).') from e
  for name in (fields.query, fields.positive):
    if name not in table.column_names:
      raise DataError(f'{path}: no column {name!r} (a pair needs a query and a positive); its '
                      f'columns are {table.column_names}.')
  columns = [n for n in (fields.query, fields.positive, fields.negatives)
             if n in table.column_names]
  for i, row in enumerate(table.select(columns).to_pylist()):
    yield f'{path} row {i}', row


def _text(where: str, row: dict[str, Any], name: str, need: str) -> str:
  """row[name], a non-empty text; else DataError saying what needs it (`need`)."""
  value = row.get(name)
  if value is None or (isinstance(value, str) and not value.strip()):
    missing = 'missing' if value is None else 'empty'
    raise DataError(f'{where}: field {name!r} is {missing}: {need}.')
  if not isinstance(value, str):
    raise DataError(f'{where}: field {name!r} must be a text, not {type(value).__name__}.')
  return value


def _pair(where: str, row: dict[str, Any], fields: PairFields) -> Pair:
  query = _text(where, row, fields.query, 'every pair needs a query '
                '(config.data.query_field names the field)')
  positive = _text(where, row, fields.positive, 'every pair needs a positive '
                   '(config.data.positive_field names the field)')
  negatives = row.get(fields.negatives)
  if negatives is None:
    negatives = []
  elif isinstance(negatives, str):
    negatives = [negatives]
  if not isinstance(negatives, (list, tuple)) or not all(
      isinstance(n, str) and n.strip() for n in negatives):
    raise DataError(f'{where}: field {fields.negatives!r} must be a list of non-empty texts '
                    '(the hard negatives), or one text.')
  return Pair(query, positive, tuple(negatives))


@dataclasses.dataclass(frozen=True)
class Beir:
  """A BEIR directory read: document and query texts by id; qrels read per split."""

  path: str
  corpus: dict[str, str]      # id -> title + ' ' + text (BEIR's join), in file order.
  queries: dict[str, str]     # id -> text.

  @classmethod
  def read(cls, path: str) -> Beir:
    if not is_beir_dir(path):
      raise FileNotFoundError(f'{path}: not a BEIR directory (no {CORPUS_FILE}).')
    corpus = {}
    for where, row in _jsonl_rows(os.path.join(path, CORPUS_FILE)):
      doc_id = _id(where, row)
      title, text = row.get('title') or '', row.get('text') or ''
      if not isinstance(title, str) or not isinstance(text, str):
        raise DataError(f"{where}: 'title' and 'text' must be texts.")
      if doc_id in corpus:
        raise DataError(f'{where}: document id {doc_id!r} appears twice.')
      corpus[doc_id] = f'{title} {text}'.strip()
    queries = {}
    for where, row in _jsonl_rows(os.path.join(path, QUERIES_FILE)):
      query_id = _id(where, row)
      queries[query_id] = _text(where, row, 'text', 'a query needs its text')
    if not corpus:
      raise DataError(f'{os.path.join(path, CORPUS_FILE)}: no documents.')
    return cls(path, corpus, queries)

  def qrels(self, split: str) -> dict[str, dict[str, int]]:
    """{query id: {document id: score}} of qrels/<split>.tsv, every id checked."""
    path = os.path.join(self.path, QRELS_DIR, f'{split}.tsv')
    if not os.path.isfile(path):
      there = sorted(os.listdir(os.path.join(self.path, QRELS_DIR))) if os.path.isdir(
          os.path.join(self.path, QRELS_DIR)) else []
      raise FileNotFoundError(f'{path}: no such file (the qrels of split {split!r}; there: '
                              f'{there}).')
    out: dict[str, dict[str, int]] = {}
    with open(path, encoding='utf-8', newline='') as f:
      reader = csv.reader(f, delimiter='\t')
      next(reader, None)   # The header row (query-id, corpus-id, score), as BEIR skips it.
      for row in reader:
        where = f'{path} line {reader.line_num}'
        if not row:
          continue
        if len(row) != 3:
          raise DataError(f'{where}: {len(row)} cells; a qrels row is query-id, corpus-id, '
                          'score.')
        query_id, doc_id, score = row
        if query_id not in self.queries:
          raise DataError(f'{where}: query-id {query_id!r} is not in {QUERIES_FILE}.')
        if doc_id not in self.corpus:
          raise DataError(f'{where}: corpus-id {doc_id!r} is not in {CORPUS_FILE}.')
        try:
          out.setdefault(query_id, {})[doc_id] = int(score)
        except ValueError as e:
          raise DataError(f'{where}: score {score!r} is not an integer.') from e
    if not out:
      raise DataError(f'{path}: no judgements.')
    return out

  def pairs(self, split: str) -> list[Pair]:
    """(query, relevant document) for every qrels row of score > 0, in file order."""
    pairs = [Pair(self.queries[q], self.corpus[d])
             for q, docs in self.qrels(split).items() for d, score in docs.items() if score > 0]
    if not pairs:
      raise DataError(f'{self.path}: qrels/{split}.tsv judges no document relevant (score > 0).')
    return pairs


def _id(where: str, row: dict[str, Any]) -> str:
  value = row.get('_id')
  if value is None or str(value) == '':
    raise DataError(f"{where}: field '_id' is missing.")
  return str(value)


@dataclasses.dataclass(frozen=True)
class StsPairs:
  """Sentence pairs with a gold similarity: texts a and b [N], scores [N]."""

  a: list[str]
  b: list[str]
  scores: np.ndarray


def read_sts(path: str) -> StsPairs:
  """Two texts (the first of fine-tuning's PAIR_FIELDS a row has) and a score ('score', else
  'label') per row of a .jsonl, .csv or .tsv file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file.')
  if path.endswith('.jsonl'):
    rows = list(_jsonl_rows(path))
  elif path.endswith(('.csv', '.tsv')):
    with open(path, encoding='utf-8', newline='') as f:
      reader = csv.DictReader(f, delimiter='\t' if path.endswith('.tsv') else ',',
                              quoting=csv.QUOTE_NONE if path.endswith('.tsv') else
                              csv.QUOTE_MINIMAL)
      rows = [(f'{path} line {reader.line_num}', row) for row in reader]
  else:
    raise DataError(f'{path}: unknown format; give a .jsonl, .csv or .tsv file of sentence '
                    'pairs with a score.')
  a, b, scores = [], [], []
  for where, row in rows:
    names = next((p for p in finetune_data.PAIR_FIELDS if p[0] in row and p[1] in row), None)
    if names is None:
      raise DataError(f'{where}: no pair of texts (fields {finetune_data.PAIR_FIELDS[2]} or '
                      f'another of {list(finetune_data.PAIR_FIELDS)}).')
    score_field = 'score' if 'score' in row else 'label'
    try:
      score = float(row.get(score_field))
    except (TypeError, ValueError) as e:
      raise DataError(f"{where}: field {score_field!r} is not a number ('score' or 'label' "
                      'holds the gold similarity).') from e
    if not math.isfinite(score):
      raise DataError(f'{where}: field {score_field!r} is {score}.')
    a.append(_text(where, row, names[0], 'a sentence pair needs two texts'))
    b.append(_text(where, row, names[1], 'a sentence pair needs two texts'))
    scores.append(score)
  if not a:
    raise DataError(f'{path}: no sentence pairs.')
  return StsPairs(a, b, np.asarray(scores, np.float64))


# ----------------------------------------------------------------- encoding


@dataclasses.dataclass(frozen=True)
class Rows:
  """Texts as rows of one length T: ids and attention mask [N, T] int32; rows cut to fit."""

  input_ids: np.ndarray
  attention_mask: np.ndarray
  truncated: int

  def __len__(self) -> int:
    return len(self.input_ids)

  def longest(self) -> int:
    return int(self.attention_mask.sum(axis=1).max(initial=0))

  def trimmed(self, seq_len: int) -> Rows:
    """The same rows in `seq_len` positions; only padding may be cut."""
    if seq_len < self.longest():
      raise ValueError(f'trimming to {seq_len} positions would cut rows of {self.longest()}.')
    return Rows(self.input_ids[:, :seq_len], self.attention_mask[:, :seq_len], self.truncated)

  def encoded(self) -> finetune_data.Encoded:
    """As fine-tuning's Encoded (one segment, no targets), for its batched inference."""
    n = len(self)
    return finetune_data.Encoded(self.input_ids, np.zeros_like(self.input_ids),
                                 self.attention_mask, np.zeros(n, np.int32),
                                 np.ones(n, np.float32), self.truncated)


def encode_texts(texts: Sequence[str], tokenizer: tok_lib.Tokenizer, seq_len: int,
                 row_format: finetune_data.RowFormat) -> Rows:
  """[CLS] text [SEP] of each text (truncated to `seq_len` pieces), padded: fine-tuning's rows."""
  pieces = tokenizer.encode_documents([tok_lib.sanitize(t) for t in texts])
  ids, _, mask, truncated = finetune_data.sequence_rows([[p] for p in pieces], seq_len,
                                                        row_format)
  return Rows(ids, mask, truncated)


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
  """Training pairs as indices into one table of encoded texts.

  rows: the table (queries with the query prompt, documents with the
  document prompt; each distinct text once). query [N]: each pair's query
  row. documents [N, 1 + K]: its positive's row, then its K hard negatives'
  (-1: none, masked out of the loss).
  """

  rows: Rows
  query: np.ndarray
  documents: np.ndarray

  def __len__(self) -> int:
    return len(self.query)

  @property
  def num_negatives(self) -> int:
    return self.documents.shape[1] - 1


def index_pairs(pairs: Sequence[Pair], num_negatives: int | None, query_prompt: str = '',
                document_prompt: str = '') -> tuple[list[str], np.ndarray, np.ndarray]:
  """(distinct prompted texts, query [N], documents [N, 1 + K]) with K = `num_negatives`, or
  the most any pair has; a pair with fewer has -1 in the missing slots."""
  k = max(len(p.negatives) for p in pairs) if num_negatives is None else num_negatives
  table: dict[str, int] = {}

  def row(text: str) -> int:
    return table.setdefault(text, len(table))

  query = np.array([row(query_prompt + p.query) for p in pairs], np.int64)
  documents = np.full((len(pairs), 1 + k), -1, np.int64)
  for i, p in enumerate(pairs):
    documents[i, 0] = row(document_prompt + p.positive)
    for j, negative in enumerate(p.negatives[:k]):
      documents[i, 1 + j] = row(document_prompt + negative)
  return list(table), query, documents


class PairBatches:
  """Iterator over this process's pairs of each global batch, from `start_step` on.

  The order is fine-tuning's (batches.TrainBatches): epoch e's a permutation
  drawn from (seed, e), so step s sees the same pairs whatever the number of
  processes, and a resumed run continues the same stream. A batch is
  input_ids, attention_mask [b, 2 + K, T] int32 (the query, the positive, the
  negatives) and document_mask [b, 1 + K] float32 (1: a real document).
  """

  def __init__(self, pairs: EncodedPairs, global_batch: int, seed: int, start_step: int = 0,
               process_index: int = 0, process_count: int = 1):
    self._pairs = pairs
    # TrainBatches orders by the length of its 'input_ids': here the pairs' indices.
    self._order = batches_lib.TrainBatches({'input_ids': np.arange(len(pairs))}, global_batch,
                                           seed, start_step, process_index, process_count)
    self._step = start_step

  def pair_indices(self, step: int) -> np.ndarray:
    """[b] the pairs of this process's share of step `step`."""
    return self._order.rows(step)

  def batch(self, index: np.ndarray) -> dict[str, np.ndarray]:
    p = self._pairs
    rows = np.concatenate([p.query[index, None], p.documents[index]], axis=1)   # [b, 2 + K]
    real = rows >= 0
    rows = np.where(real, rows, 0)    # A masked slot reads row 0, whose vector is ignored.
    return {'input_ids': p.rows.input_ids[rows], 'attention_mask': p.rows.attention_mask[rows],
            'document_mask': real[:, 1:].astype(np.float32)}

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    index = self.pair_indices(self._step)
    self._step += 1
    return self.batch(index)

  def close(self) -> None:
    """Nothing to stop (no worker processes); here so the loop treats every input alike."""
