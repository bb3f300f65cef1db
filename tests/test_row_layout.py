"""config.data.row_layout='document_chunks': one chunk of one document per row, padded (Ettin's
rows), against a transcription of Ettin's chunker and the packed rows of the same corpus."""

import json
import os

import numpy as np
import pytest

from tests.conftest import micro_config
from tests.conftest import run_training
from mlm_jax.config import fields
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import packed_rows
from mlm_jax.data import packing
from mlm_jax.data import prepare
from mlm_jax.data import prepare_report
from mlm_jax.errors import ConfigError

ETTIN = packing.RowLayout('document_chunks', min_tokens=512, drop_tokens=128)


def ettin_chunk_instance(tokens, chunk_size, min_chunk_size, always_skip_size, randint):
  """JHU-CLSP/ettin-encoder-vs-decoder's pretraining/data_processing/src/sampling/
  split_dataset_into_chunks_individual.py, chunk_instance, as run for Ettin's data (backfill,
  backfill_no_duplicates; its special tokens and prefix-space re-encoding left out: the row's
  [CLS] and [SEP] are added here around every chunk), with np.random.randint given."""
  chunks = []
  chunk_size_for_cls_eos = chunk_size - 2
  initial_chunks = np.array_split(tokens, np.arange(chunk_size_for_cls_eos, len(tokens),
                                                    chunk_size_for_cls_eos))
  for i, chunk in enumerate(initial_chunks):
    if len(chunk) < always_skip_size and i != 0:
      continue
    if len(chunk) < min_chunk_size:
      if chunks:
        prev_chunk = chunks[-1]
        random_tokens_needed = randint(0, chunk_size_for_cls_eos - len(chunk))
        if random_tokens_needed:
          backfilled_chunk = np.concatenate([prev_chunk[-random_tokens_needed:], chunk])
          chunks[-1] = prev_chunk[:-random_tokens_needed]
        else:
          backfilled_chunk = chunk
        chunks.append(backfilled_chunk)
      elif i == 0:
        chunks.append(chunk)
    else:
      chunks.append(chunk)
  return chunks


def _ettin_rows(ids, content, layout, seed):
  """Ettin's chunks of one document, its random share drawn by our hash."""
  randint = lambda lo, hi: packing.backfill_share(ids, content - hi, content, seed)
  return ettin_chunk_instance(ids, content + 2, layout.min_tokens, layout.drop_tokens, randint)


@pytest.mark.parametrize('length', [1, 5, 127, 1022, 1023, 1022 + 127, 1022 + 128, 1022 + 300,
                                    1022 + 511, 1022 + 512, 3 * 1022 + 200, 4 * 1022])
def test_chunks_follow_ettin(length):
  ids = np.arange(length, dtype=np.int32) + 7
  doc, start, end = packing.chunk_bounds(np.array([length]), 1022, ETTIN, 3, lambda d: ids)
  assert doc.tolist() == [0] * len(doc)
  theirs = _ettin_rows(ids, 1022, ETTIN, 3)
  assert [ids[a:b].tolist() for a, b in zip(start, end)] == [c.tolist() for c in theirs]
  rows, kept = packing.chunk_rows(np.array([length]), 1022, ETTIN)
  assert rows.tolist() == [len(theirs)] and kept.tolist() == [sum(map(len, theirs))]


def test_documents_are_chunked_together_as_each_alone():
  rng = np.random.default_rng(1)
  docs = [rng.integers(5, 1000, n).astype(np.int32) for n in rng.integers(1, 5000, 60)]
  doc, start, end = packing.chunk_bounds(np.array([len(d) for d in docs]), 1022, ETTIN, 9,
                                         lambda d: docs[d])
  together = [docs[d][a:b].tolist() for d, a, b in zip(doc, start, end)]
  assert together == [c.tolist() for d in docs for c in _ettin_rows(d, 1022, ETTIN, 9)]


def test_backfill_share_is_spread():
  """The share a short last chunk takes: uniform over [0, content - its length) across
  documents, as Ettin's np.random.randint, and fixed for a document."""
  rng = np.random.default_rng(0)
  shares = []
  for _ in range(400):
    ids = rng.integers(5, 1000, 1022 + 200).astype(np.int32)
    shares.append(packing.backfill_share(ids, 200, 1022, seed=0))
    assert packing.backfill_share(ids, 200, 1022, seed=0) == shares[-1]
  shares = np.asarray(shares)
  assert shares.min() >= 0 and shares.max() < 822
  # Deciles of a uniform draw on [0, 822): each within 5 percentage points.
  counts = np.histogram(shares, bins=10, range=(0, 822))[0]
  assert np.all(np.abs(counts / 400 - 0.1) < 0.05), counts


def _split_rows(data_dir: str, split: str) -> np.ndarray:
  return packed_rows.DenseRows(packed_rows.split_paths(data_dir, split)).read(
      np.arange(len(packed_rows.DenseRows(packed_rows.split_paths(data_dir, split)))))


def _documents(rows: np.ndarray, sep: int, pad: int) -> list[np.ndarray]:
  """The documents of packed rows, in order: their content laid end to end, cut at [SEP]."""
  stream = rows[:, 1:-1].ravel()
  stream = stream[stream != pad]
  return [d[:-1] if d[-1] == sep else d
          for d in np.split(stream, np.flatnonzero(stream == sep) + 1) if len(d)]


def test_prepared_chunks_are_the_packed_documents_chunked(prepared, corpus_glob, tmp_path,
                                                         monkeypatch):
  """The same corpus, tokenizer and split prepared both ways: every document of the packed rows
  comes back as Ettin's chunks of it, one a row ([CLS] chunk [SEP], then [PAD]), in document
  order, over units of 20 kB and shards of 40 rows; the stats and unigram counts count the
  rows' ids; masking never selects padding."""
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 20_000)
  monkeypatch.setattr(prepare, 'SHARD_BYTES', 4 * 32 * 40)
  config, packed = prepared
  chunked_config = micro_config(corpus_glob, str(tmp_path / 'chunks'))
  chunked_config.tokenizer.model_file = os.path.join(packed.data_dir, 'tokenizer.model')
  layout = packing.RowLayout('document_chunks', min_tokens=12, drop_tokens=4)
  chunked_config.data.row_layout = layout.kind
  chunked_config.data.chunk_min_tokens = layout.min_tokens
  chunked_config.data.chunk_drop_tokens = layout.drop_tokens
  chunked_config.data.num_workers = 1
  chunked = prepare.prepare(*fields.data_request(chunked_config))
  assert chunked.report['work']['units'] > 4 and chunked.report['work']['shards'] > 20
  s = packed.tokenizer.specials
  t = config.data.seq_len
  for split in ('train', 'validation'):
    docs = _documents(_split_rows(packed.data_dir, split), s.sep, s.pad)
    expected = [np.concatenate([[s.cls], chunk, [s.sep], [s.pad] * (t - 2 - len(chunk))])
                for doc in docs for chunk in _ettin_rows(doc, t - 2, layout, config.data.split_seed)]
    rows = _split_rows(chunked.data_dir, split)
    np.testing.assert_array_equal(rows, np.asarray(expected))
    stats = chunked.stats[split]
    lengths = np.array([len(d) for d in docs])
    kept = packing.chunk_rows(lengths, t - 2, layout)[1].sum()
    assert stats['documents'] == len(docs) and stats['rows'] == len(rows)
    assert stats['tokens'] == lengths.sum() and stats['dropped_tokens'] == lengths.sum() - kept
    assert stats['padding_fraction'] == pytest.approx((rows == s.pad).mean())
    assert 0.1 < stats['padding_fraction'] < 0.9  # The corpus has short and long documents.
    assert stats['dropped_tokens'] > 0
    if split == 'train':
      counts = np.bincount(rows.ravel(), minlength=len(chunked.unigram_counts))
      counts[list(s.never_masked)] = 0
      np.testing.assert_array_equal(chunked.unigram_counts, counts)
  lines = prepare_report.format_report(chunked.report, chunked.data_dir).splitlines()
  train = chunked.stats['train']
  assert (f'  train: {train["documents"]:,} documents, {train["tokens"]:,} tokens, '
          f'{train["rows"]:,} rows, padding {train["padding_fraction"]:.4%}, '
          f'{train["dropped_tokens"]:,} tokens of short last chunks dropped') in lines
  masker = masking.make_masker(config.masking, chunked.tokenizer, chunked.unigram_counts)
  rows = _split_rows(chunked.data_dir, 'train')[:64]
  batch = masker(rows, seed=0, step=0, rows=np.arange(64))
  real = (rows != s.pad) & (rows != s.cls) & (rows != s.sep)
  chosen = np.take_along_axis(real, batch['masked_positions'], axis=1)
  assert np.all(chosen[batch['masked_weights'] > 0])
  np.testing.assert_array_equal(batch['masked_weights'].sum(axis=1),
                                masker.num_selected(real.sum(axis=1)))
  np.testing.assert_array_equal(batch['attention_mask'], rows != s.pad)
  # The layout enters a chunked data dir's fingerprint only: packed ones keep their names.
  with open(os.path.join(packed.data_dir, 'fingerprint.json')) as f:
    assert 'rows' not in json.load(f)
  with open(os.path.join(chunked.data_dir, 'fingerprint.json')) as f:
    assert json.load(f)['rows'] == {'row_layout': 'document_chunks', 'chunk_min_tokens': 12,
                                    'chunk_drop_tokens': 4}


@pytest.mark.parametrize('overrides, message', [
    (dict(row_layout='chunks'), "config.data.row_layout='chunks': use 'packed' or "
                                "'document_chunks'"),
    (dict(chunk_min_tokens=12), "acts on document chunks only"),
    (dict(row_layout='document_chunks', chunk_drop_tokens=31), 'must be in [0, '
                                                               'config.data.seq_len - 2 = 30]'),
])
def test_bad_layouts_are_refused(corpus_glob, tmp_path, overrides, message):
  config = micro_config(corpus_glob, str(tmp_path))
  config.data.update(overrides)
  with pytest.raises(ConfigError) as e:
    prepare.check_config(config.data)
  assert message in str(e.value)


def test_a_run_trains_on_document_chunks(prepared, corpus_glob, tmp_path):
  """The trainer reads chunked rows as it reads packed ones; its token count leaves their
  padding out (tokens_seen below rows x T), and the loss falls over a few steps."""
  config = micro_config(corpus_glob, str(tmp_path / 'chunks'))
  config.tokenizer.model_file = os.path.join(prepared[1].data_dir, 'tokenizer.model')
  config.data.row_layout = 'document_chunks'
  config.train.num_steps, config.train.eval_every, config.train.checkpoint_every = 8, 8, 8
  workdir = str(tmp_path / 'run')
  run_training(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [2, 4, 6, 8]
  assert all(np.isfinite(r['loss']) for r in train) and train[-1]['loss'] < train[0]['loss']
  for r in train:
    assert 0 < r['tokens_seen'] < r['planned_tokens'] == r['step'] * 16 * 32
  assert np.isfinite(records[-1]['eval_loss']) and records[-1]['eval_num_masked'] > 0
