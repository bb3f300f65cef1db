"""Corpus sources (files, jsonl, gzip, tfds), bad input, and resumable parallel prepare."""

import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tracemalloc

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_jax.config import checks
from mlm_jax.config import fields
from mlm_jax.data import corpus
from mlm_jax.data import line_sample
from mlm_jax.data import packed_rows
from mlm_jax.data import packing
from mlm_jax.data import prepare
from mlm_jax.data import prepared as prepared_lib
from mlm_jax.data import tokenizer as tok
from mlm_jax.errors import ConfigError
from tests.conftest import Deferred
from tests.conftest import REPO
from tests.conftest import micro_config
from tests.conftest import write_config_file

tfds = Deferred('tensorflow_datasets')

# Real prose, one paragraph each (a blank line would split a document of a .txt file).
DOCS = [re.sub(r'\n\s*\n', '\n', d) for d, _ in zip(corpus.stdlib_docstrings(), range(400))]


def _rows(data: prepared_lib.PreparedData, split: str) -> np.ndarray:
  """A split's rows (its .npy shards); checked equal to the tfds export's where there is one."""
  dense = data.source(split)
  rows = dense.read(np.arange(len(dense)))
  if prepared_lib.has_tfds_export(data.data_dir):
    records = tfds.builder_from_directory(data.tfds_dir).as_data_source(split)
    np.testing.assert_array_equal(
        rows, np.stack([records[i]['input_ids'] for i in range(len(records))]))
  return rows


def _in_rows(data: prepared_lib.PreparedData, document: str) -> bool:
  """Whether a whole document's ids, with its [SEP], appear in the packed rows."""
  ids = np.array(data.tokenizer.encode([document])[0] + [data.tokenizer.specials.sep],
                 np.int32).tobytes()
  for split in ('train', 'validation'):
    stream = _rows(data, split)[:, 1:-1].tobytes()  # Row content without [CLS] and [SEP].
    at = stream.find(ids)
    while at >= 0:
      if at % 4 == 0:
        return True
      at = stream.find(ids, at + 1)
  return False


def _assert_same_data(a: prepared_lib.PreparedData, b: prepared_lib.PreparedData) -> None:
  """The same tokenizer and rows; byte for byte when both have the same number of shards."""
  assert a.tokenizer.spec()['pieces'] == b.tokenizer.spec()['pieces']
  files = {}
  for data in (a, b):
    root = pathlib.Path(data.data_dir)
    files[data.data_dir] = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob('*')
                            if p.is_file() and (p.name == 'tokenizer.model'
                                                or 'array_record' in p.name
                                                or p.parent.name == packed_rows.DENSE_DIR)}
  if files[a.data_dir].keys() == files[b.data_dir].keys():
    assert files[a.data_dir] == files[b.data_dir]
  for split in ('train', 'validation'):
    np.testing.assert_array_equal(_rows(a, split), _rows(b, split))  # Same rows, same order.
  np.testing.assert_array_equal(a.unigram_counts, b.unigram_counts)
  assert a.stats == b.stats


def _config(corpus_spec: str, data_dir, workers: int = 1, **data):
  config = micro_config(corpus_spec, str(data_dir))
  config.data.num_workers = workers
  for k, v in data.items():
    config.data[k] = v
  return config


def _documents(spec: str, document_split: str = 'blank_line',
               text_key: str = 'text') -> list[str]:
  """All documents of a config.data.corpus value, in order, each whole (its pieces joined)."""
  c = corpus.resolve(ml_collections.ConfigDict({'corpus': spec, 'document_split': document_split,
                                                'text_key': text_key, 'tfds_name': ''}))
  tally, docs = corpus.Tally(), []
  for unit in c.units:
    for first, piece in c.pieces(unit, tally):
      if first:
        docs.append([])
      docs[-1].append(piece)
  return [' '.join(pieces) for pieces in docs]


def test_user_files_split_into_documents(tmp_path):
  (tmp_path / 'a.txt').write_text('First doc\nline two.\n\n  \nSecond doc.\r\n\r\nThird.')
  (tmp_path / 'b.txt').write_text('Only doc.')
  docs = _documents(str(tmp_path / '*.txt'))
  assert docs == ['First doc\nline two.', 'Second doc.', 'Third.', 'Only doc.']
  docs = _documents(str(tmp_path), document_split='file')
  assert len(docs) == 2
  with pytest.raises(corpus.CorpusError, match='no such file'):
    _documents(str(tmp_path / 'missing.txt'))
  with pytest.raises(corpus.CorpusError, match='matches no files'):
    _documents(str(tmp_path / '*.jsonl'))


def test_validation_documents_never_appear_in_train(corpus_glob):
  docs = _documents(corpus_glob)
  val = [d for d in docs if packing.is_validation(tok.sanitize(d), 0.1, 0)]
  assert 0 < len(val) < len(docs) / 4
  assert not set(val) & {d for d in docs if not packing.is_validation(tok.sanitize(d), 0.1, 0)}


def test_every_file_kind_gives_the_same_documents(tmp_path):
  docs = DOCS[:6]
  (tmp_path / 'a.txt').write_text('\n\n'.join(docs[:2]))
  with gzip.open(tmp_path / 'b.txt.gz', 'wt') as f:
    f.write('\n\n'.join(docs[2:4]))
  lines = [json.dumps({'text': d, 'id': i}) for i, d in enumerate(docs[4:])]
  (tmp_path / 'sub').mkdir()
  (tmp_path / 'sub' / 'c.jsonl').write_text('\n'.join(lines[:1]) + '\n')
  with gzip.open(tmp_path / 'sub' / 'd.jsonl.gz', 'wt') as f:
    f.write('\n'.join(lines[1:]) + '\n')
  # A directory (recursive), a glob and a comma-separated list of them.
  assert _documents(str(tmp_path)) == docs
  assert _documents(f'{tmp_path}/*.txt*,{tmp_path}/sub/*.jsonl*') == docs
  assert _documents(str(tmp_path / 'sub' / 'c.jsonl')) == docs[4:5]
  # jsonl with another field name.
  (tmp_path / 'e.jsonl').write_text(json.dumps({'body': 'Body text.'}) + '\n')
  assert _documents(str(tmp_path / 'e.jsonl'), text_key='body') == ['Body text.']


def test_bad_inputs_are_used_or_skipped_and_counted(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'PIECE_CHARS', 100_000)
  d = tmp_path / 'in'
  d.mkdir()
  (d / 'good.txt').write_text('\n\n'.join(DOCS[:300]))
  (d / 'empty.txt').write_bytes(b'')
  (d / 'blank.txt').write_text(' \n\n\t\n')
  (d / 'image.txt').write_bytes(b'\x89PNG\r\n\x1a\n\0\0\0\rIHDR' + bytes(range(256)))
  (d / 'latin1.txt').write_bytes('Caf\xe9 cr\xe8me, na\xefve.\n'.encode('latin-1'))
  (d / 'windows.txt').write_bytes(b'First line.\r\nSecond line.\r\n\r\nNext document.\r\n')
  (d / 'long.txt').write_text(' '.join(DOCS[300:400]).replace('\n', ' ') * 10)
  (d / 'bad.jsonl').write_text('{"text": "A good record."}\nnot json\n{"title": "no text"}\n'
                               '[1, 2]\n{"text": 7}\n\n{"text": "Another good one."}\n')
  # Truncated gzip: the first paragraph is read before the error, the second is lost.
  text = '\n'.join(DOCS[:60]) + '\n\n' + '\n'.join(DOCS[60:300])
  (d / 'broken.txt.gz').write_bytes(gzip.compress(text.encode())[:-30])
  spec = f'{d}/*.txt,{d}/*.gz,{d}/bad.jsonl,{tmp_path}/missing.txt,{tmp_path}/*.md'
  data = prepare.prepare(*fields.data_request(_config(spec, tmp_path / 'data', val_fraction=0.2)))
  report = data.report
  counts = report['inputs']['counts']
  assert counts == {
      'files_used': 6,  # good, latin1, windows, long, bad.jsonl, broken (up to the break).
      'missing': 1, 'empty_glob': 1, 'empty_dir': 0, 'empty': 1, 'binary': 1, 'no_text': 1,
      'read_error': 1, 'not_json': 1, 'missing_key': 3, 'long_record': 0,
      'invalid_utf8_files': 1, 'invalid_utf8_bytes': 3, 'crlf_files': 1, 'long_documents': 1}
  reasons = {(os.path.basename(e['input']), e['reason'].split(' (')[0].split(':')[0])
             for e in report['inputs']['skipped']}
  assert reasons == {('missing.txt', 'no such file or directory'),
                     ('*.md', 'the glob matches no files'), ('empty.txt', 'empty file'),
                     ('image.txt', 'binary'), ('blank.txt', 'no text'),
                     ('broken.txt.gz', 'read error after 1 documents'),
                     ('bad.jsonl', 'line is not JSON'), ('bad.jsonl', "no string field 'text'")}
  missing_key = [e for e in report['inputs']['skipped'] if e['reason'].startswith('no string')]
  assert missing_key[0]['lines'] == [3, 4, 5]
  # The long line is one document (tokenized in pieces), so documents are exact.
  documents = data.stats['train']['documents'] + data.stats['validation']['documents']
  assert documents == 300 + 1 + 2 + 1 + 2 + 1  # good, latin1, windows, long, jsonl, broken.
  # Repaired text is in the rows: invalid bytes became U+FFFD, CRLF a newline.
  assert _in_rows(data, 'Caf\ufffd cr\ufffdme, na\ufffdve.')
  assert _in_rows(data, 'First line.\nSecond line.') and _in_rows(data, 'Next document.')
  assert _documents(str(d / 'windows.txt')) == ['First line.\nSecond line.',
                                                'Next document.']


def test_a_100_mb_line_streams_in_bounded_memory(tmp_path):
  path = tmp_path / 'huge.txt'
  word = b'lorem ipsum dolor sit amet '
  with open(path, 'wb') as f:
    f.write(word * (100_000_000 // len(word)))
  assert path.stat().st_size > 99_000_000
  tracemalloc.start()
  c = corpus.resolve(_config(str(path), tmp_path / 'x').data)  # Looks for places to cut.
  assert [u.byte_range for u in c.units] == [None]              # None: no line end at all.
  assert tracemalloc.get_traced_memory()[1] < 3 * (1 << 20)
  tracemalloc.reset_peak()
  tally = corpus.Tally()
  pieces = chars = 0
  for first, piece in c.pieces(c.units[0], tally):
    assert first == (pieces == 0) and len(piece) <= corpus.PIECE_CHARS
    pieces += 1
    chars += len(piece) + 1
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  assert chars == path.stat().st_size  # Cut at spaces: nothing lost.
  least = -(-chars // corpus.PIECE_CHARS)  # Cut at the last space before each 1 MiB.
  assert least <= pieces <= least + 1
  assert peak < 12 * corpus.PIECE_CHARS  # ~12 MB, not 100 MB.
  assert tally.counts['long_documents'] == 1 and tally.counts['files_used'] == 1


def test_a_corpus_with_nothing_usable_is_an_error_before_training(tmp_path):
  (tmp_path / 'empty.txt').write_bytes(b'')
  (tmp_path / 'bin.txt').write_bytes(b'\0\1\2')
  (tmp_path / 'keys.jsonl').write_text('{"body": "x"}\n')
  data_dir = tmp_path / 'data'
  with pytest.raises(corpus.CorpusError, match=r'no usable text.*3 inputs skipped.*binary'):
    prepare.prepare(*fields.data_request(_config(str(tmp_path / '*'), data_dir)))
  assert not os.path.exists(data_dir) and not os.path.exists(f'{data_dir}.partial')
  # Names that give no file at all fail the config check, before any work.
  config = _config(f'{tmp_path}/none.txt,{tmp_path}/*.md', data_dir)
  with pytest.raises(ConfigError, match=r"none.txt': no such file.*\*.md': the glob"):
    checks.validate(config)
  config = _config(str(tmp_path / '*'), data_dir, tfds_name='wikipedia')
  with pytest.raises(ConfigError, match='both set'):
    checks.validate(config)
  config = _config(str(tmp_path / '*'), data_dir, num_workers=-1)
  with pytest.raises(ConfigError, match='num_workers'):
    checks.validate(config)


def test_tokenizer_trains_on_a_bounded_sample_of_lines(tmp_path):
  lines = [f'line {i}' for i in range(10_000)] + ['x' * 5000]
  sample, info = line_sample.sample_lines(iter(lines), 100, seed=0)
  # The long line is two sentences (5000 bytes > MAX_SENTENCE_BYTES), not dropped.
  assert {k: info[k] for k in ('lines_seen', 'lines_split', 'sentences_seen', 'sentences_sampled',
                               'capped_sentences')} == {
      'lines_seen': 10_001, 'lines_split': 1, 'sentences_seen': 10_002, 'sentences_sampled': 100,
      'capped_sentences': 9_902}
  assert info['bytes_sampled'] + info['capped_bytes'] == info['bytes_seen']
  ids = [int(s.split()[1]) for s in sample if s.startswith('line ')]
  assert ids == sorted(ids) and 2000 < np.mean(ids) < 8000  # In order, spread over all.
  assert line_sample.sample_lines(iter(lines), 100, seed=0)[0] == sample
  assert line_sample.sample_lines(iter(lines[:50]), 100, seed=0)[0] == lines[:50]
  config = _config(str(tmp_path / '*.txt'), tmp_path / 'data')
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS))
  config.tokenizer.max_sentences = 500
  report = prepare.prepare(*fields.data_request(config)).report['tokenizer']
  assert report['sentences_sampled'] == 500 < report['sentences_seen']


def _prepare_in_subprocess(config_code: str, patch: str = '') -> subprocess.CompletedProcess:
  code = (f'import sys; sys.path.insert(0, {str(REPO)!r})\n'
          'import os, signal\n'
          'from mlm_jax.config import fields\n'
          'from mlm_jax.data import corpus, packing, prepare, sp_tokenizer\n'
          'from tests.conftest import micro_config\n'
          'corpus.UNIT_BYTES = 1  # One unit per file,\n'
          'corpus._cuts = lambda *args: []  # none cut into byte ranges.\n'
          'prepare.SHARD_BYTES = 4 * 32 * 40  # 40 rows per shard.\n'
          f'{patch}\n'
          'if __name__ == "__main__":\n'
          f'  config = {config_code}\n'
          '  config.data.num_workers = 1\n'
          '  prepare.prepare(*fields.data_request(config))\n')
  return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        timeout=120)


@pytest.mark.slow
def test_interrupted_prepare_resumes_to_the_same_dataset_for_any_worker_count(
    tmp_path, monkeypatch):
  src = tmp_path / 'src'
  src.mkdir()
  for i in range(8):
    (src / f'part{i}.txt').write_text('\n\n'.join(DOCS[i * 50:(i + 1) * 50]))
  spec = str(src / '*.txt')
  data_dir = tmp_path / 'killed'
  config_code = f'micro_config({spec!r}, {str(data_dir)!r})'
  # Run 1: SIGKILL in the middle of the 4th unit (its temporary dir half written).
  kill_in_unit_4 = (
      'calls = []\n'
      'encode = sp_tokenizer.SentencePieceTokenizer.encode_documents\n'
      'def dying_encode(self, *a, **k):\n'
      '  calls.append(1)\n'
      '  if len(calls) == 4: os.kill(os.getpid(), signal.SIGKILL)\n'
      '  return encode(self, *a, **k)\n'
      'sp_tokenizer.SentencePieceTokenizer.encode_documents = dying_encode\n')
  run = _prepare_in_subprocess(config_code, kill_in_unit_4)
  assert run.returncode == -9, run.stderr
  partial = f'{data_dir}.partial'
  assert sorted(os.listdir(f'{partial}/units'))[:3] == ['000000', '000001', '000002']
  assert not os.path.exists(data_dir)
  # Run 2: SIGKILL after the first shard of rows is written.
  kill_after_shard_1 = (
      'write = packing.write_shard\n'
      'def dying_write(*a):\n'
      '  write(*a)\n'
      '  os.kill(os.getpid(), signal.SIGKILL)\n'
      'packing.write_shard = dying_write\n')
  run = _prepare_in_subprocess(config_code, kill_after_shard_1)
  assert run.returncode == -9, run.stderr
  assert len(os.listdir(f'{partial}/units')) == 8
  assert not os.path.exists(data_dir)
  # Run 3, here: finishes from what runs 1 and 2 left.
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 1)
  monkeypatch.setattr(corpus, '_cuts', lambda *args: [])
  monkeypatch.setattr(prepare, 'SHARD_BYTES', 4 * 32 * 40)
  resumed = prepare.prepare(*fields.data_request(_config(spec, data_dir, workers=2)))
  work = resumed.report['work']
  assert (work['units'], work['units_reused'], work['shards_reused']) == (8, 8, 1)
  assert work['shards'] > 3
  assert not os.path.exists(partial)
  assert sorted(os.listdir(data_dir)) == ['fingerprint.json', 'report.json', 'rows',
                                          'stats.json', 'tokenizer.model',
                                          'unigram_counts.npy']
  # Clean prepares elsewhere: 2 workers with the same units, 1 worker with one unit.
  clean = prepare.prepare(*fields.data_request(_config(spec, tmp_path / 'clean2', workers=2)))
  _assert_same_data(resumed, clean)
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 1 << 30)
  monkeypatch.setattr(prepare, 'SHARD_BYTES', 1 << 26)
  one = prepare.prepare(*fields.data_request(_config(spec, tmp_path / 'clean1', workers=1)))
  assert one.report['work']['units'] == 1 and one.report['work']['shards'] == 2
  _assert_same_data(resumed, one)


def test_an_unfinished_prepare_of_other_settings_is_replaced_and_a_foreign_one_kept(tmp_path):
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS))
  config = _config(str(tmp_path / 'a.txt'), tmp_path / 'data')
  partial = tmp_path / 'data.partial'
  partial.mkdir()
  (partial / 'partial.json').write_text('{"format": 0}')
  (partial / 'units').mkdir()
  prepare.prepare(*fields.data_request(config))
  assert not partial.exists()
  foreign = tmp_path / 'other.partial'
  foreign.mkdir()
  (foreign / 'mine.txt').write_text('keep me')
  with pytest.raises(prepared_lib.DataDirError, match='not an unfinished mlm_jax prepare'):
    prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.txt'), tmp_path / 'other')))
  assert (foreign / 'mine.txt').read_text() == 'keep me'


def test_an_unfinished_prepare_of_an_earlier_version_continues(tmp_path, monkeypatch):
  # Earlier versions named stage 1's sampling report tokenizer.json.
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS[:100]))
  config = _config(str(tmp_path / 'a.txt'), tmp_path / 'data')

  def stop(*args):
    raise KeyboardInterrupt

  with monkeypatch.context() as m:
    m.setattr(packing, 'tokenize_unit', stop)
    with pytest.raises(KeyboardInterrupt):
      prepare.prepare(*fields.data_request(config))
  partial = tmp_path / 'data.partial'
  info = json.loads((partial / 'tokenizer_sample.json').read_text())
  (partial / 'tokenizer_sample.json').rename(partial / 'tokenizer.json')
  data = prepare.prepare(*fields.data_request(config))
  assert data.report['tokenizer'] == info and info['trained']
  assert not {'tokenizer.json', 'tokenizer_sample.json'} & set(os.listdir(data.data_dir))
  _assert_same_data(data, prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.txt'), tmp_path / 'clean'))))


def _write_tfds_text_dataset(data_dir) -> list[str]:
  """ShortTexts prepared on disk as array_record."""
  tfds.disable_progress_bar()
  from tests import tfds_datasets  # pylint: disable=import-outside-toplevel
  tfds_datasets.ShortTexts(data_dir=str(data_dir)).download_and_prepare(file_format='array_record')
  return DOCS[:200]


@pytest.mark.slow
def test_a_tfds_dataset_on_disk_is_a_corpus(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'TFDS_RECORDS_PER_UNIT', 50)  # 3 units for 2 workers.
  texts = _write_tfds_text_dataset(tmp_path / 'tfds')
  config = _config('', tmp_path / 'data', workers=2, tfds_name='short_texts',
                   tfds_data_dir=str(tmp_path / 'tfds'), split='train[:150]', val_fraction=0.2)
  checks.validate(config)
  data = prepare.prepare(*fields.data_request(config))
  stats = data.stats
  assert stats['train']['documents'] + stats['validation']['documents'] == 150
  assert data.report['corpus'] == "config.data.tfds_name='short_texts'"
  assert data.report['work']['workers'] == 2 and data.report['work']['units'] == 3
  fp = json.loads((tmp_path / 'data' / 'fingerprint.json').read_text())
  assert fp['corpus']['split'] == 'train[:150]' and fp['corpus']['records'] == 150
  decoded = data.tokenizer.decode(_rows(data, 'train')[0][1:8])
  assert any(decoded.split()[0] in t for t in texts)
  # A missing feature, dataset or split: clear errors naming the option.
  with pytest.raises(corpus.CorpusError, match="text_key='body'.*features are"):
    corpus.resolve(_config('', tmp_path / 'x', tfds_name='short_texts', text_key='body',
                           tfds_data_dir=str(tmp_path / 'tfds')).data)
  with pytest.raises(corpus.CorpusError, match="tfds_name='nope'.*tfds build nope"):
    corpus.resolve(_config('', tmp_path / 'x', tfds_name='nope',
                           tfds_data_dir=str(tmp_path / 'tfds')).data)
  # The same dataset in tfrecord format (TensorFlow needed to read it): the fix is named.
  tfrecord_dir = tmp_path / 'tfrecord'
  shutil.copytree(tmp_path / 'tfds', tfrecord_dir)
  info_path = next(tfrecord_dir.glob('short_texts/1.0.0/dataset_info.json'))
  info = json.loads(info_path.read_text())
  info['fileFormat'] = 'tfrecord'
  info_path.write_text(json.dumps(info))
  with pytest.raises(corpus.CorpusError, match='tfrecord.*--file_format=array_record'):
    corpus.resolve(_config('', tmp_path / 'x', tfds_name='short_texts',
                           tfds_data_dir=str(tfrecord_dir)).data)


def test_a_registered_tfds_dataset_mocked_without_tensorflow(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'TFDS_RECORDS_PER_UNIT', 100)  # 3 units for 2 workers.
  from tensorflow_datasets.text import wikipedia  # noqa: F401  Registers the builder.
  name = 'wikipedia/20230601.en'
  with tfds.testing.mock_data(num_examples=300, policy=tfds.testing.MockPolicy.USE_CODE):
    records = tfds.data_source(name, split='train')
    texts = [records[i]['text'] for i in range(len(records))]
    config = _config('', tmp_path / 'data', workers=2, tfds_name=name, val_fraction=0.2)
    data = prepare.prepare(*fields.data_request(config))
  assert 'tensorflow' not in sys.modules  # Read without TensorFlow, in 2 spawned workers.
  stats = data.stats
  assert stats['train']['documents'] + stats['validation']['documents'] == sum(
      1 for t in texts if t.strip())
  assert data.unigram_counts.sum() == stats['train']['tokens'] > 0
  assert data.report['inputs']['counts']['files_used'] == 0
  assert data.report['work']['workers'] == 2 and data.report['work']['units'] == 3


def _all_pieces(c: corpus.Corpus) -> tuple[list[tuple[bool, str]], corpus.Tally]:
  tally = corpus.Tally()
  return [p for unit in c.units for p in c.pieces(unit, tally)], tally


@pytest.mark.parametrize('name', ['big.txt', 'big.jsonl'])
def test_a_big_file_is_cut_into_byte_ranges_that_read_as_the_whole(tmp_path, monkeypatch, name):
  # Paragraphs separated by blank lines holding spaces, tabs and CRLF, invalid
  # UTF-8, multi-byte characters and lines longer than a piece.
  monkeypatch.setattr(corpus, 'PIECE_CHARS', 256)
  rng = np.random.default_rng(0)
  path = tmp_path / name
  with open(path, 'wb') as f:
    for i, doc in enumerate(DOCS[:200]):
      text = doc.replace('\n', ' ') + (' é ü' * int(rng.integers(0, 200)))
      if name.endswith('.jsonl'):
        f.write(json.dumps({'text': text}).encode() + b'\n')
        continue
      f.write(text.encode() + (b'\xff\xfe' if i % 17 == 0 else b''))
      f.write([b'\n\n', b'\n \t\n\n', b'\r\n\r\n', b'\n   \n'][i % 4])
  size = path.stat().st_size
  config = _config(str(path), tmp_path / 'x')
  whole = corpus.resolve(config.data)
  assert [u.byte_range for u in whole.units] == [None]
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 4096)
  cut = corpus.resolve(config.data)
  ranges = [u.byte_range for u in cut.units]
  assert len(ranges) > 10 and ranges[0][0] == 0 and ranges[-1][1] == size
  assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))   # A partition of the file.
  with open(path, 'rb') as f:
    data = f.read()
  for _, stop in ranges[:-1]:                                     # Each cut follows a boundary.
    assert data[stop - 1:stop] == b'\n'
    if name.endswith('.txt'):
      assert re.search(rb'\n[ \t\r\f\v]*\n$', data[:stop])
  whole_pieces, whole_tally = _all_pieces(whole)
  cut_pieces, cut_tally = _all_pieces(cut)
  assert cut_pieces == whole_pieces
  counts = whole_tally.counts
  assert counts['files_used'] == cut_tally.counts['files_used'] == 1
  assert counts['invalid_utf8_bytes'] == cut_tally.counts['invalid_utf8_bytes']
  assert counts['long_documents'] == cut_tally.counts['long_documents'] > 0


def test_a_big_file_prepares_to_the_same_rows_in_ranges_and_whole(tmp_path, monkeypatch):
  path = tmp_path / 'one.txt'
  path.write_text('\n\n'.join(DOCS))
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 1 << 30)
  whole = prepare.prepare(*fields.data_request(_config(str(path), tmp_path / 'whole', workers=1)))
  assert whole.report['work']['units'] == 1
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 16 << 10)
  ranges = prepare.prepare(*fields.data_request(_config(str(path), tmp_path / 'ranges', workers=2)))
  assert ranges.report['work']['units'] > 5
  _assert_same_data(whole, ranges)


def test_a_file_with_no_newline_stays_one_range_read_in_pieces(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 1 << 16)
  path = tmp_path / 'flat.txt'
  path.write_bytes(b'lorem ipsum dolor sit amet ' * 40_000)   # 1 MiB, no line end.
  c = corpus.resolve(_config(str(path), tmp_path / 'x').data)
  assert [u.byte_range for u in c.units] == [None]             # No boundary to cut at.
  pieces, tally = _all_pieces(c)
  assert [first for first, _ in pieces].count(True) == 1
  assert max(len(p) for _, p in pieces) <= corpus.PIECE_CHARS
  assert tally.counts['long_documents'] == 1


def test_a_capped_tokenizer_sample_is_the_same_for_any_worker_count(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 16 << 10)    # One file in byte ranges.
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS))
  prepared = []
  for workers in (1, 2):
    config = _config(str(tmp_path / 'a.txt'), tmp_path / f'w{workers}', workers=workers)
    config.tokenizer.max_sentences = 500
    prepared.append(prepare.prepare(*fields.data_request(config)))
  one, two = prepared
  assert one.report['work']['units'] > 5 and two.report['work']['workers'] == 2
  info = one.report['tokenizer']
  assert info['sentences_sampled'] == 500 < info['sentences_seen']
  assert info == two.report['tokenizer']
  _assert_same_data(one, two)


@pytest.mark.slow
def test_the_prepare_command_prepares_once_and_reports(tmp_path):
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS[:200]))
  data_dir = tmp_path / 'data'
  config_file = write_config_file(tmp_path / 'c.py', str(tmp_path / 'a.txt'), str(data_dir),
                                  other={'data.num_workers': 2})
  cmd = [sys.executable, '-m', 'mlm_jax.prepare', f'--config={config_file}']
  first = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-2000:]
  assert 'Prepared ' in first.stdout and f'Data dir: {data_dir}' in first.stdout
  assert (data_dir / 'fingerprint.json').exists() and (data_dir / packed_rows.DENSE_DIR).is_dir()
  assert not list(data_dir.rglob('*array_record*'))  # One row format unless asked.
  rows = {p: p.stat().st_mtime_ns for p in (data_dir / packed_rows.DENSE_DIR).iterdir()}
  again = subprocess.run(cmd + ['--tfds_export'], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
  assert again.returncode == 0 and 'Prepared ' not in again.stdout   # Reused, not redone,
  assert f'tfds export: {data_dir}' in again.stdout                  # the export added
  assert rows == {p: p.stat().st_mtime_ns for p in (data_dir / packed_rows.DENSE_DIR).iterdir()}
  assert prepared_lib.has_tfds_export(str(data_dir))
  _rows(prepared_lib.load(str(data_dir)), 'train')                       # from the same rows.
  bad = subprocess.run(cmd + ['--config.data.num_workers=-1'], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode == 2 and 'num_workers' in bad.stderr


def test_a_gz_file_that_is_not_gzip_or_is_cut_short_is_skipped_and_counted(tmp_path):
  """Skipped, named in the report, and the rest of the corpus read (a longer file cut short keeps
  what reads before the break: test_bad_inputs_are_used_or_skipped_and_counted)."""
  (tmp_path / 'plain.txt.gz').write_text('Plain text, never compressed.\n')
  (tmp_path / 'cut.txt.gz').write_bytes(gzip.compress('\n\n'.join(DOCS[:40]).encode())[:-30])
  (tmp_path / 'good.txt').write_text('\n\n'.join(DOCS[40:80]))
  c = corpus.resolve(_config(f'{tmp_path}/*.gz,{tmp_path}/good.txt', tmp_path / 'x').data)
  tally = corpus.Tally()
  docs = [piece for unit in c.units for first, piece in c.pieces(unit, tally) if first]
  assert docs == [d.strip() for d in DOCS[40:80]]
  assert tally.counts['read_error'] == 2 and tally.counts['files_used'] == 1
  reasons = {os.path.basename(e['input']): e['reason'] for e in tally.skipped}
  assert reasons['plain.txt.gz'].startswith('cannot read: Not a gzipped file')
  assert 'Compressed file ended before the end-of-stream marker' in reasons['cut.txt.gz']


def test_a_file_that_vanishes_after_its_first_range_is_reported_per_range(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 4096)
  path = tmp_path / 'big.txt'
  path.write_text('\n\n'.join(DOCS[:100]))
  c = corpus.resolve(_config(str(path), tmp_path / 'x').data)
  assert len(c.units) > 3
  tally = corpus.Tally()
  assert list(c.pieces(c.units[0], tally))
  path.unlink()
  for unit in c.units[1:]:
    assert not list(c.pieces(unit, tally))
  assert tally.counts['read_error'] == len(c.units) - 1
  assert all('bytes' in s['input'] and 'cannot read' in s['reason'] for s in tally.skipped)


@pytest.mark.slow
def test_apache_beam_prepares_the_same_dataset_as_local_workers(tmp_path, monkeypatch):
  pytest.importorskip('apache_beam')
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 16 << 10)    # One file in byte ranges,
  monkeypatch.setattr(prepare, 'SHARD_BYTES', 4 * 32 * 40)  # several shards of rows.
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS))
  (tmp_path / 'b.txt').write_text('\n\n'.join(DOCS[:40]))
  pq.write_table(pa.table({'text': DOCS[40:200]}), tmp_path / 'c.parquet', row_group_size=20)
  spec = f'{tmp_path}/*.txt,{tmp_path}/c.parquet'        # Row groups are units too.
  # With the tfds export, its tasks run on Beam too.
  local = prepare.prepare(*fields.data_request(_config(spec, tmp_path / 'local', workers=2, tfds_export=True)))
  beam_options = ['--runner=DirectRunner', '--direct_num_workers=2',
                  '--direct_running_mode=multi_processing']
  beam = prepare.prepare(*fields.data_request(_config(spec, tmp_path / 'beam', tfds_export=True)), beam_options)
  assert prepared_lib.has_tfds_export(beam.data_dir)
  work = beam.report['work']
  assert work['units'] > 5 and work['shards'] > 3 and work['beam_options'] == beam_options
  assert beam.report['tokenizer'] == local.report['tokenizer']
  assert beam.report['inputs'] == local.report['inputs']
  _assert_same_data(local, beam)
  assert sorted(os.listdir(tmp_path / 'beam')) == sorted(os.listdir(tmp_path / 'local'))


@pytest.mark.slow
def test_prepare_with_beam_options_of_an_unknown_runner_stops_before_any_work(tmp_path):
  pytest.importorskip('apache_beam')
  (tmp_path / 'a.txt').write_text('\n\n'.join(DOCS[:20]))
  config_file = write_config_file(tmp_path / 'c.py', str(tmp_path / 'a.txt'),
                                  str(tmp_path / 'data'))
  bad = subprocess.run([sys.executable, '-m', 'mlm_jax.prepare', f'--config={config_file}',
                        '--beam_options=--runner=NoSuchRunner'], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode == 2, bad.stderr[-2000:]
  assert 'error: --beam_options: Unexpected pipeline runner: NoSuchRunner' in bad.stderr
  assert not (tmp_path / 'data').exists() and not (tmp_path / 'data.partial').exists()


def test_a_unit_read_ahead_tokenizes_as_one_read_from_the_corpus(tmp_path):
  """packing.read_unit (stage 2's reading, done while the tokenizer trains) keeps what
  tokenize_unit needs: the same ids, documents, splits and input tally, repaired bytes
  included; its file is gone once the unit is done."""
  src = tmp_path / 'src'
  src.mkdir()
  text = '\n\n'.join(DOCS[:120]).encode()
  (src / 'a.txt').write_bytes(text[:5000] + b'\xff\xfe' + text[5000:])
  config = _config(str(src / '*.txt'), tmp_path / 'data', val_fraction=0.2)
  data = prepare.prepare(*fields.data_request(config))
  source = corpus.resolve(config.data)
  packing.init_worker(source, os.path.join(data.data_dir, 'tokenizer.model'),
                      config.data.val_fraction, config.data.split_seed, config.data.seq_len, False)
  direct, ahead = tmp_path / 'direct', tmp_path / 'ahead'
  for d in (direct, ahead):
    d.mkdir()
  unit = source.units[0]
  packing.tokenize_unit(0, unit, str(direct))
  packing.read_unit(0, unit, str(ahead))
  assert os.path.exists(packing.split_path(str(ahead), 0))
  packing.tokenize_unit(0, unit, str(ahead))
  assert sorted(os.listdir(ahead)) == ['000000']
  a, b = direct / '000000', ahead / '000000'
  assert (a / 'ids.bin').read_bytes() == (b / 'ids.bin').read_bytes()
  with np.load(a / 'docs.npz') as x, np.load(b / 'docs.npz') as y:
    for key in ('lengths', 'is_val'):
      np.testing.assert_array_equal(x[key], y[key])
    assert x['is_val'].any() and not x['is_val'].all()
  tally = json.loads((a / 'tally.json').read_text())
  assert tally == json.loads((b / 'tally.json').read_text())
  assert tally['counts']['invalid_utf8_bytes'] == 2


def test_work_meanwhile_is_dropped_or_finished_and_its_errors_left_to_the_stage(tmp_path):
  """Pool.meanwhile: an in-process pool runs nothing ahead; a pool of workers runs the
  tasks while the caller works, and a task that fails there raises nothing."""
  units_dir = tmp_path / 'units'
  units_dir.mkdir()
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'a.txt').write_text('\n\n'.join(DOCS[:20]))
  config = _config(str(src / '*.txt'), tmp_path / 'data')
  source = corpus.resolve(config.data)
  args = (source, str(tmp_path / 'tokenizer.model'), 0.1, 0, 32, False)
  # One task at a time beside this process, in order: the failing one (its directory
  # is gone) runs first.
  tasks = [(1, source.units[0], str(tmp_path / 'gone')), (0, source.units[0], str(units_dir))]
  with packing.Pool(1, args) as pool, pool.meanwhile(packing.read_unit, tasks):
    assert not os.listdir(units_dir)  # Nothing runs beside this process...
  assert not os.listdir(units_dir)    # ...nor when it is done.
  with packing.Pool(2, args) as pool:
    with pool.meanwhile(packing.read_unit, tasks):
      deadline = time.monotonic() + 60
      while not os.path.exists(packing.split_path(str(units_dir), 0)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
  # The failed task raised nothing here; the other was read.
  assert sorted(os.listdir(units_dir)) == ['000000.read.npz']
