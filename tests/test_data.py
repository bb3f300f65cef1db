"""Corpus, tokenizer, prepare and the input pipeline."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlm_jax.config import fields
from mlm_jax.data import corpus
from mlm_jax.data import line_sample
from mlm_jax.data import masking
from mlm_jax.data import packing
from mlm_jax.data import pipeline as input_pipeline
from mlm_jax.data import prepare
from mlm_jax.data import prepared as prepared_lib
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok
from tests.conftest import micro_config


def test_default_corpus_is_stdlib_docstrings_read_without_importing():
  code = ('import sys; before = set(sys.modules); from mlm_jax.data import corpus; '
          'docs = list(corpus.stdlib_docstrings()); '
          'new = set(sys.modules) - before; '
          'print(len(docs), sum(map(len, docs)), '
          "any(m in new for m in ('antigravity', 'this', 'tkinter', 'turtle', 'smtplib')))")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True).stdout.split()
  num_docs, num_chars, imported = int(out[0]), int(out[1]), out[2]
  assert num_docs > 5000
  assert num_chars > 1_000_000
  assert imported == 'False'


def test_default_corpus_is_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('MLM_JAX_CACHE', str(tmp_path))
  corpus._docstring_table.cache_clear()
  source = corpus.StdlibSource()
  files = source.files[:40]
  unit = corpus.Unit(files=files)
  parsed = [doc for path in files for doc in corpus.docstrings_of(path)]
  assert corpus._docstring_table(tuple(files), 'digest', build=False) is None
  table = corpus._docstring_table(tuple(files), 'digest', build=True)
  (kept,) = (tmp_path / 'corpus').iterdir()   # Written whole, no temporary file left.
  assert kept.name.endswith('-digest.json') and [d for f in files for d in table[f]] == parsed
  corpus._docstring_table.cache_clear()
  kept.write_text(json.dumps({f: ['from the cache'] for f in files}))
  assert corpus._docstring_table(tuple(files), 'digest', build=False)[files[0]] == [
      'from the cache']
  # The source reads the whole corpus's table: once kept, a unit's documents come from it.
  corpus._docstring_table.cache_clear()
  with open(corpus.docstring_cache(source.digest), 'w') as f:
    json.dump({path: [f'kept for {path}'] for path in source.files}, f)
  assert [doc for _, doc in source.read(unit, corpus.Tally())] == [f'kept for {p}' for p in files]
  corpus._docstring_table.cache_clear()


def test_tokenizer_special_ids_and_padded_vocab(prepared):
  _, data = prepared
  t = data.tokenizer
  assert t.specials == sp_tokenizer.SPECIALS
  assert [t.id_to_piece(i) for i in t.specials.ids] == list(tok.SPECIAL_TOKENS)
  assert t.encode(['a [MASK] b'])[0].count(t.specials.mask) == 1
  assert tok.padded_vocab_size(600) == 640 and tok.padded_vocab_size(640) == 640
  assert tok.sanitize('x [MASK] y [CLS]') == 'x MASK y CLS'


def test_rows_are_packed_full_sentences(prepared):
  config, data = prepared
  T = config.data.seq_len
  s = data.tokenizer.specials
  for split in ('train', 'validation'):
    source = data.source(split)
    rows = np.stack([source[i]['input_ids'] for i in range(len(source))])
    assert rows.shape == (data.stats[split]['rows'], T)
    assert np.all(rows[:, 0] == s.cls)
    is_pad = rows == s.pad
    # Only one row per split has padding, and its padding is a suffix.
    assert is_pad.any(axis=1).sum() <= 1
    last_real = T - 1 - np.argmax(~is_pad[:, ::-1], axis=1)
    assert np.all(rows[np.arange(len(rows)), last_real] == s.sep)
    assert is_pad.mean() < 0.01
    # Content = every document's tokens plus one [SEP] between documents.
    content = (~np.isin(rows, (s.pad, s.cls))).sum() - len(rows)
    stats = data.stats[split]
    assert content == stats['tokens'] + stats['documents'] - 1
  assert data.unigram_counts.sum() == data.stats['train']['tokens']
  assert data.stats['validation']['documents'] > 0


def test_a_data_dir_holds_its_rows_once_unless_the_tfds_export_is_asked_for(prepared):
  _, data = prepared
  assert sorted(os.listdir(data.data_dir)) == ['fingerprint.json', 'report.json', 'rows',
                                               'stats.json', 'tokenizer.model',
                                               'unigram_counts.npy']
  names = [name for _, _, files in os.walk(data.data_dir) for name in files]
  assert not [name for name in names if 'array_record' in name]


def test_prepare_is_reused_and_guards_other_data(prepared, tmp_path):
  config, data = prepared
  model_file = os.path.join(data.data_dir, 'tokenizer.model')
  mtime = os.stat(model_file).st_mtime_ns
  again = prepare.prepare(*fields.data_request(config))
  assert again.data_dir == data.data_dir
  assert os.stat(model_file).st_mtime_ns == mtime  # Not retrained.
  # What training's other processes do: read it, never prepare it.
  assert prepared_lib.load_prepared(*fields.data_request(config)).data_dir == data.data_dir
  with pytest.raises(prepared_lib.DataDirError, match='prepare it first'):
    prepared_lib.load_prepared(*fields.data_request(micro_config(config.data.corpus, str(tmp_path / 'none'))))
  # Same data dir, other settings: refused, nothing touched.
  other = micro_config(config.data.corpus, data.data_dir)
  other.tokenizer.vocab_size = 700
  with pytest.raises(prepared_lib.DataDirError, match='tokenizer'):
    prepare.prepare(*fields.data_request(other))
  assert os.stat(model_file).st_mtime_ns == mtime
  # A non-empty directory that is not ours: refused, its files kept.
  foreign = tmp_path / 'mine'
  foreign.mkdir()
  (foreign / 'notes.txt').write_text('keep me')
  with pytest.raises(prepared_lib.DataDirError, match='not empty'):
    prepare.prepare(*fields.data_request(micro_config(config.data.corpus, str(foreign))))
  assert (foreign / 'notes.txt').read_text() == 'keep me'


def test_empty_corpus_is_a_clear_error_and_leaves_no_partial_dir(tmp_path):
  (tmp_path / 'empty.txt').write_text('\n\n   \n')
  data_dir = tmp_path / 'data'
  config = micro_config(str(tmp_path / 'empty.txt'), str(data_dir))
  with pytest.raises((corpus.CorpusError, RuntimeError), match='no usable text|empty|Vocabulary'):
    prepare.prepare(*fields.data_request(config))
  assert not data_dir.exists()
  assert not [p for p in os.listdir(tmp_path) if 'partial' in p]


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_pipeline_same_global_batch_for_any_process_count(prepared):
  config, data = prepared
  source = data.source('train')
  m = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  kwargs = dict(global_batch=8, seed=3)
  single = _take(input_pipeline.train_batches(source, m, **kwargs), 5)
  again = _take(input_pipeline.train_batches(source, m, **kwargs), 5)
  parts = [_take(input_pipeline.train_batches(source, m, process_index=p, process_count=2,
                                              **kwargs), 5) for p in range(2)]
  resumed = _take(input_pipeline.train_batches(source, m, start_step=3, **kwargs), 2)
  for s in range(5):
    for key in single[s]:
      np.testing.assert_array_equal(single[s][key], again[s][key])
      np.testing.assert_array_equal(single[s][key],
                                    np.concatenate([parts[0][s][key], parts[1][s][key]]))
  for key in single[3]:
    np.testing.assert_array_equal(single[3][key], resumed[0][key])
    np.testing.assert_array_equal(single[4][key], resumed[1][key])
  other_seed = _take(input_pipeline.train_batches(source, m, global_batch=8, seed=4), 1)
  assert not np.array_equal(single[0]['input_ids'], other_seed[0]['input_ids'])


def test_pipeline_covers_an_epoch_then_reshuffles(prepared):
  config, data = prepared
  source = data.source('train')
  n = len(source)
  m = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  m = masking.Masker(1, 1e-9, 0.0, 0.0, m.replacement_probs, mode='token', span_p=m.span_p,
                     span_max=m.span_max, specials=m.specials)  # Masks 1 token, keeps it.
  it = input_pipeline.train_batches(source, m, global_batch=1, seed=0)
  epoch1 = [next(it)['input_ids'][0].tobytes() for _ in range(n)]
  epoch2 = [next(it)['input_ids'][0].tobytes() for _ in range(n)]
  all_rows = [source[i]['input_ids'].tobytes() for i in range(n)]
  assert sorted(epoch1) == sorted(all_rows) == sorted(epoch2)
  assert epoch1 != epoch2


def test_eval_batches_pad_with_weightless_rows(prepared):
  config, data = prepared
  source = data.source('validation')
  m = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  batches = list(input_pipeline.eval_batches(source, m, global_batch=8, mask_seed=1))
  assert len(batches) == -(-len(source) // 8)
  total_rows = sum(int((b['attention_mask'].sum(axis=1) > 0).sum()) for b in batches)
  assert total_rows == len(source)
  again = list(input_pipeline.eval_batches(source, m, global_batch=8, mask_seed=1))
  for a, b in zip(batches, again):
    np.testing.assert_array_equal(a['masked_positions'], b['masked_positions'])
  assert json.loads(json.dumps(data.stats))  # Serialisable report.


def test_an_existing_tokenizer_is_used_instead_of_training_one(prepared, tmp_path):
  config, data = prepared
  other = micro_config(config.data.corpus, str(tmp_path / 'data'))
  other.tokenizer.model_file = os.path.join(data.data_dir, 'tokenizer.model')
  other.tokenizer.vocab_size = 9999  # Ignored: the model file decides.
  reused = prepare.prepare(*fields.data_request(other))
  assert reused.data_dir != data.data_dir
  assert reused.tokenizer.model_proto == data.tokenizer.model_proto
  # Keyed by the file's sha256 under the name earlier versions gave it: their data dirs stay.
  with open(other.tokenizer.model_file, 'rb') as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  assert prepared_lib.fingerprint(fields.rows_key(other.data), other.tokenizer)['tokenizer'] == {
      'model_file_sha256': digest}
  np.testing.assert_array_equal(reused.unigram_counts, data.unigram_counts)


def _long_document() -> str:
  """~20 kB of sentences on one line; the word 'zorbleflux' only in its last ~2 kB."""
  body = [f'Sentence {i} of the long document talks about the weather and the sea.'
          for i in range(260)]
  tail = [f'The zorbleflux number {i} glows at night.' for i in range(60)]
  return ' '.join(body + tail)


def test_tokenizer_training_sees_all_of_a_long_line(tmp_path, monkeypatch):
  long_doc = _long_document()
  assert len(long_doc.encode()) > 4 * line_sample.MAX_SENTENCE_BYTES
  assert 'zorbleflux' not in long_doc[:-2500]
  short_docs = [d.replace('\n\n', '\n') for d, _ in zip(corpus.stdlib_docstrings(), range(150))]
  (tmp_path / 'a.txt').write_text('\n\n'.join(short_docs[:75] + [long_doc] + short_docs[75:]))
  config = micro_config(str(tmp_path / 'a.txt'), str(tmp_path / 'data'))
  config.data.num_workers = 1
  # BPE: on a corpus this small, unigram keeps few whole words of any frequency.
  config.tokenizer.model_type = 'bpe'
  assert not packing.is_validation(long_doc, config.data.val_fraction, config.data.split_seed)
  fed = []
  train = sp_tokenizer.spm.SentencePieceTrainer.train

  def recording_train(sentence_iterator, **kwargs):
    fed.extend(sentence_iterator)
    return train(sentence_iterator=iter(fed), **kwargs)

  monkeypatch.setattr(sp_tokenizer.spm.SentencePieceTrainer, 'train', recording_train)
  data = prepare.prepare(*fields.data_request(config))
  assert all(len(s.encode()) <= line_sample.MAX_SENTENCE_BYTES for s in fed)
  pieces = [s for s in fed if 'long document' in s or 'zorbleflux' in s]
  assert len(pieces) > 4 and ''.join(pieces) == long_doc
  # Cut at sentence ends.
  assert all(p.endswith('. ') for p in pieces[:-1])
  assert '\u2581zorbleflux' in data.tokenizer.pieces()
  info = data.report['tokenizer']
  assert info['lines_split'] == 1 and info['capped_sentences'] == 0
  assert info['bytes_sampled'] == info['bytes_seen']


def test_a_line_without_spaces_is_split_between_characters():
  rng = np.random.default_rng(0)
  chars = np.array(list('a\u00e9\u65e5\U0001F600'))  # 1, 2, 3 and 4 bytes in UTF-8.
  line = ''.join(rng.choice(chars, 8000))
  pieces = line_sample.split_line(line)
  sizes = [len(p.encode()) for p in pieces]
  assert ''.join(pieces) == line
  assert max(sizes) <= line_sample.MAX_SENTENCE_BYTES
  # Each cut is at the last character boundary that fits.
  assert all(s > line_sample.MAX_SENTENCE_BYTES - 4 for s in sizes[:-1])
  assert min(sizes[:-1]) < line_sample.MAX_SENTENCE_BYTES


def test_sentences_sentencepiece_would_skip_are_counted():
  sample, info = line_sample.sample_lines(['kept', 'a \u2047 b'], 10, seed=0)
  assert sample == ['kept']
  assert (info['reserved_sentences'], info['reserved_bytes']) == (1, len('a \u2047 b'.encode()))


def test_rows_serialize_to_the_bytes_of_tfds_feature_encoding():
  from mlm_jax.data import tfds_export  # pylint: disable=import-outside-toplevel  # imports tfds
  spec = tfds_export.features(16)
  rng = np.random.default_rng(0)
  for row in [np.zeros(16, np.int32), rng.integers(0, 2**31 - 1, 16).astype(np.int32),
              rng.integers(0, 300, 16).astype(np.int32)]:
    assert tfds_export.serialize_row(row) == spec.serialize_example({'input_ids': row})
