"""Parquet files, datasets directories, pre-tokenized ids and bucket URLs as corpora."""

import json
import os
import subprocess
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from etils.epath import backend
from fsspec.implementations import dirfs
from fsspec.implementations import local

from mlm_jax.config import checks
from mlm_jax.config import fields
from mlm_jax.data import arrow_source
from mlm_jax.data import corpus
from mlm_jax.data import masking
from mlm_jax.data import packing
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import prepared as prepared_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from tests.conftest import Deferred
from tests.conftest import REPO
from tests.conftest import write_config_file
from tests.test_sources import DOCS
from tests.test_sources import _assert_same_data
from tests.test_sources import _config
from tests.test_sources import _documents

datasets = Deferred('datasets')


def _write_jsonl(path, docs):
  path.write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))


def test_a_parquet_file_reads_row_groups_as_units_and_names_bad_rows(tmp_path, monkeypatch):
  texts = DOCS[:50]
  table = pa.table({'id': list(range(50)), 'text': texts})
  pq.write_table(table, tmp_path / 'a.parquet', row_group_size=8)
  assert _documents(str(tmp_path / 'a.parquet')) == texts
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 1)       # One row group per unit.
  c = corpus.resolve(_config(str(tmp_path / 'a.parquet'), tmp_path / 'x').data)
  assert [(u.kind, u.start, u.stop) for u in c.units] == [
      ('row_groups', g, g + 1) for g in range(7)]
  assert _documents(str(tmp_path / 'a.parquet')) == texts   # The same documents in units.
  # Nulls are skipped and named by row; invalid UTF-8 in a binary column is replaced.
  values = [d.encode() for d in texts[:5]] + [None, b'caf\xe9 cr\xe8me', None]
  pq.write_table(pa.table({'text': pa.array(values, pa.binary())}), tmp_path / 'b.parquet',
                 row_group_size=4)
  c = corpus.resolve(_config(str(tmp_path / 'b.parquet'), tmp_path / 'x').data)
  tally = corpus.Tally()
  docs = [piece for unit in c.units for _, piece in c.pieces(unit, tally)]
  assert docs == texts[:5] + ['caf\ufffd cr\ufffdme']
  assert tally.counts['null_value'] == 2 and tally.counts['invalid_utf8_bytes'] == 2
  nulls = [e for e in tally.skipped if e['reason'].startswith('null')]
  assert [row for e in nulls for row in e['rows']] == [5, 7]
  assert all('b.parquet (row groups' in e['input'] for e in nulls)


def test_an_unreadable_parquet_or_arrow_file_is_one_line_naming_it(tmp_path, monkeypatch):
  """Not a parquet file, a truncated one, a damaged row group, an Arrow file that is not Arrow:
  each stops the prepare with one line naming the file (and the row group), never a traceback."""
  docs = DOCS[:30]
  pq.write_table(pa.table({'text': docs}), tmp_path / 'good.parquet', row_group_size=10)
  good = (tmp_path / 'good.parquet').read_bytes()
  (tmp_path / 'text.parquet').write_text('\n\n'.join(docs))
  (tmp_path / 'truncated.parquet').write_bytes(good[:len(good) // 2] + good[-8:])
  damaged = bytearray(good)
  column = pq.ParquetFile(tmp_path / 'good.parquet').metadata.row_group(1).column(0)
  damaged[column.data_page_offset + 8:column.data_page_offset + 200] = b'\xab' * 192
  (tmp_path / 'damaged.parquet').write_bytes(bytes(damaged))
  datasets.Dataset.from_dict({'text': docs}).save_to_disk(str(tmp_path / 'ds'))
  arrow_file = next((tmp_path / 'ds').glob('*.arrow'))
  arrow_file.write_bytes(b'not an Arrow stream, ' * 20)
  for name, match in (('text.parquet', 'text.parquet cannot be read as a parquet file'),
                      ('truncated.parquet', 'truncated.parquet cannot be read as a parquet'),
                      ('ds', f'{arrow_file.name} cannot be read as an Arrow stream file')):
    with pytest.raises(corpus.CorpusError, match=match) as raised:
      corpus.resolve(_config(str(tmp_path / name), tmp_path / 'x').data)
    assert '\n' not in str(raised.value) and 'remove it from the corpus' in str(raised.value)
  # The footer reads; the damage is found where the rows are read, in a worker.
  c = corpus.resolve(_config(str(tmp_path / 'damaged.parquet'), tmp_path / 'x').data)
  with pytest.raises(corpus.CorpusError, match=r'damaged.parquet \(row group 1\) cannot be read'):
    for unit in c.units:
      list(c.pieces(unit, corpus.Tally()))


@pytest.mark.slow
def test_the_prepare_command_names_a_file_that_is_not_parquet_in_one_line(tmp_path):
  (tmp_path / 'a.parquet').write_text('\n\n'.join(DOCS[:30]))
  config_file = write_config_file(tmp_path / 'c.py', str(tmp_path / 'a.parquet'),
                                  str(tmp_path / 'data'))
  run = subprocess.run([sys.executable, '-m', 'mlm_jax.prepare', f'--config={config_file}'],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 2, run.stderr[-2000:]
  assert 'Traceback' not in run.stderr
  errors = [line for line in run.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and f'{tmp_path}/a.parquet cannot be read as a parquet' in errors[0]


def test_a_missing_or_wrong_column_is_one_line_listing_the_columns(tmp_path):
  pq.write_table(pa.table({'id': [1, 2], 'body': ['a', 'b'], 'ids': [[5, 6], [7]]}),
                 tmp_path / 'a.parquet')
  config = _config(str(tmp_path / 'a.parquet'), tmp_path / 'x')
  with pytest.raises(ConfigError,
                     match=r"no column config.data.text_key='text'; its columns are \['id', "
                           r"'body', 'ids'\]"):
    checks.validate(config)
  config.data.text_key = 'id'
  with pytest.raises(ConfigError, match="column 'id' holds int64, not text"):
    checks.validate(config)
  config.data.text_key = 'body'
  checks.validate(config)
  # Token ids need the tokenizer they were made with.
  config.data.ids_key = 'body'
  with pytest.raises(ConfigError, match="'body' holds string, not lists of integer"):
    checks.validate(config)
  config.data.ids_key = 'ids'
  with pytest.raises(ConfigError, match='tokenizer.model_file'):
    checks.validate(config)
  config.tokenizer.model_file = 'tokenizer.json'
  for corpus_spec, tfds_name in (('', ''), ('', 'wikipedia')):
    config.data.corpus, config.data.tfds_name = corpus_spec, tfds_name
    with pytest.raises(ConfigError, match=r"ids_key='ids' reads token ids from "
                                                     r'parquet files or datasets directories'):
      checks.validate(config, check_paths=True)
  # A DatasetDict directory: name one split.
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': ['a']})}).save_to_disk(
      str(tmp_path / 'dd'))
  with pytest.raises(ConfigError, match=r'DatasetDict.*dd/train'):
    checks.validate(_config(str(tmp_path / 'dd'), tmp_path / 'x'))


@pytest.mark.slow
def test_parquet_arrow_and_jsonl_prepare_to_the_same_data_dir(tmp_path, monkeypatch):
  _write_jsonl(tmp_path / 'a.jsonl', DOCS)
  pq.write_table(pa.table({'text': DOCS, 'n': list(range(len(DOCS)))}), tmp_path / 'a.parquet',
                 row_group_size=25)
  datasets.Dataset.from_dict({'text': DOCS}).save_to_disk(str(tmp_path / 'ds'),
                                                          max_shard_size='40KB')
  assert len(arrow_source.data_files(str(tmp_path / 'ds'))) > 2
  jsonl = prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.jsonl'), tmp_path / 'd-jsonl')))
  arrow = prepare.prepare(*fields.data_request(_config(str(tmp_path / 'ds'), tmp_path / 'd-arrow')))
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 16 << 10)     # 16 row groups: many units.
  one = prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.parquet'), tmp_path / 'd-1')))
  two = prepare.prepare(*fields.data_request(_config(str(tmp_path / 'a.parquet'), tmp_path / 'd-2', workers=2)))
  assert one.report['work']['units'] > 3 and two.report['work']['workers'] == 2
  for data in (arrow, one, two):
    _assert_same_data(jsonl, data)
    assert data.report['inputs']['counts']['files_used'] >= 1
  assert one.report['tokenizer'] == two.report['tokenizer'] == jsonl.report['tokenizer']


def _ids_table(tokenizer: tok_lib.Tokenizer, docs: list[str]) -> pa.Table:
  """The documents tokenized as prepare would, with [CLS] ... [SEP] as encoders add them."""
  s = tokenizer.specials
  ids = [[s.cls] + i + [s.sep] for i in tokenizer.encode_documents(
      [tok_lib.sanitize(d) for d in docs])]
  return pa.table({'input_ids': pa.array(ids, pa.list_(pa.int32()))})


@pytest.mark.slow
def test_pretokenized_ids_train_the_same_batches_as_text_tokenized_here(prepared, tmp_path):
  config, data = prepared
  model_file = os.path.join(data.data_dir, 'tokenizer.model')
  tokenizer = data.tokenizer
  # Held-out documents are drawn by a hash of the text, or of the ids: keep the documents
  # both draw alike, so that the two splits hold the same documents.
  fraction, seed = config.data.val_fraction, config.data.split_seed
  docs = [d for d in DOCS if packing.is_validation(tok_lib.sanitize(d), fraction, seed)
          == packing.is_validation(corpus.sources_lib.Ids(
              np.asarray(tokenizer.encode_documents([tok_lib.sanitize(d)])[0]), ''),
              fraction, seed)]
  assert len(docs) > 300
  pq.write_table(pa.table({'text': docs}), tmp_path / 'text.parquet')
  pq.write_table(_ids_table(tokenizer, docs), tmp_path / 'ids.parquet', row_group_size=50)
  text_config = _config(str(tmp_path / 'text.parquet'), tmp_path / 'd-text', workers=2)
  ids_config = _config(str(tmp_path / 'ids.parquet'), tmp_path / 'd-ids', workers=2,
                       ids_key='input_ids')
  text_config.tokenizer.model_file = ids_config.tokenizer.model_file = model_file
  text = prepare.prepare(*fields.data_request(text_config))
  checks.validate(ids_config)
  ids = prepare.prepare(*fields.data_request(ids_config))
  assert ids.report['tokenizer']['trained'] is False
  masker = masking.make_masker(config.masking, tokenizer, data.unigram_counts)
  batches = [pipeline.train_batches(d.source('train'), masker, global_batch=8, seed=1)
             for d in (text, ids)]
  for _ in range(10):
    a, b = next(batches[0]), next(batches[1])
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  np.testing.assert_array_equal(text.source('validation').read(np.arange(3)),
                                ids.source('validation').read(np.arange(3)))
  # An id outside the vocabulary stops the prepare, naming the row.
  bad = _ids_table(tokenizer, docs[:30]).to_pylist()
  bad[17]['input_ids'][3] = tokenizer.vocab_size + 5
  pq.write_table(pa.Table.from_pylist(bad, _ids_table(tokenizer, docs[:1]).schema),
                 tmp_path / 'bad.parquet')
  bad_config = _config(str(tmp_path / 'bad.parquet'), tmp_path / 'd-bad', ids_key='input_ids')
  bad_config.tokenizer.model_file = model_file
  with pytest.raises(corpus.CorpusError, match=r'bad.parquet row 17: token id \d+ is outside'):
    prepare.prepare(*fields.data_request(bad_config))
  assert not (tmp_path / 'd-bad').exists()


class _Bucket(dirfs.DirFileSystem):
  """gs://BUCKET/PATH served from a local directory: a bucket URL that resolves here, through
  fsspec as gcsfs would serve it (paths listed without the scheme)."""

  root = ''
  protocol = ('gs', 'gcs')

  def __init__(self, **kwargs):
    del kwargs  # gcsfs's options.
    super().__init__(path=self.root, fs=local.LocalFileSystem())

  @classmethod
  def _strip_protocol(cls, path):
    path = path[0] if isinstance(path, list) else path
    return str(path).split('://', 1)[-1].lstrip('/')

  def _join(self, path):
    return super()._join(self._strip_protocol(path) if isinstance(path, str) else path)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """gs://bucket/... served from tmp_path/bucket/ for the test."""
  (tmp_path / 'bucket').mkdir()
  monkeypatch.setattr(_Bucket, 'root', str(tmp_path))
  for protocol in _Bucket.protocol:
    fsspec.register_implementation(protocol, _Bucket, clobber=True)
  _Bucket.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  yield tmp_path / 'bucket'
  _Bucket.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access


def test_a_bucket_url_reads_through_the_one_opener(bucket, tmp_path):
  (bucket / 'corpus').mkdir()
  _write_jsonl(bucket / 'corpus' / 'a.jsonl', DOCS[:20])
  pq.write_table(pa.table({'text': DOCS[20:40]}), bucket / 'corpus' / 'b.parquet',
                 row_group_size=7)
  assert _documents('gs://bucket/corpus/*') == DOCS[:40]
  assert _documents('gs://bucket/corpus/b.parquet') == DOCS[20:40]
  c = corpus.resolve(_config('gs://bucket/corpus', tmp_path / 'x').data)
  assert c.description['files'] == 2
  assert c.units[0].files[0].startswith('gs://bucket/corpus/')


@pytest.mark.slow
def test_a_data_dir_at_a_bucket_url_is_prepared_once_and_read_from_a_local_copy(
    bucket, tmp_path, monkeypatch):
  pq.write_table(pa.table({'text': DOCS}), bucket / 'a.parquet', row_group_size=50)
  monkeypatch.setenv('MLM_JAX_CACHE', str(tmp_path / 'cache'))
  config = _config('gs://bucket/a.parquet', 'gs://bucket/data')
  first = prepare.prepare(*fields.data_request(config))
  assert (bucket / 'data' / 'fingerprint.json').exists()
  local = prepare.prepare(*fields.data_request(_config(str(bucket / 'a.parquet'), tmp_path / 'plain')))
  assert sorted(os.listdir(bucket / 'data')) == sorted(os.listdir(local.data_dir))
  # Another machine (an empty cache) reads it from the URL: copied down, not prepared again.
  monkeypatch.setenv('MLM_JAX_CACHE', str(tmp_path / 'cache2'))
  again = prepare.prepare(*fields.data_request(config))
  assert again.data_dir.startswith(str(tmp_path / 'cache2'))
  for data in (again, first):
    np.testing.assert_array_equal(data.source('train').read(np.arange(20)),
                                  local.source('train').read(np.arange(20)))
  # Training's other processes read it without preparing: through their own copy.
  monkeypatch.setenv('MLM_JAX_CACHE', str(tmp_path / 'cache3'))
  read = prepared_lib.load_prepared(*fields.data_request(config))
  assert read.data_dir.startswith(str(tmp_path / 'cache3'))
  # The tfds export asked for later: made from the copy's rows, copied up, nothing prepared.
  config.data.tfds_export = True
  exported = prepare.prepare(*fields.data_request(config))
  assert exported.data_dir == read.data_dir and prepared_lib.has_tfds_export(read.data_dir)
  assert (bucket / 'data' / 'tfds' / 'mlm_rows' / '1.0.0' / 'dataset_info.json').exists()
  assert not (tmp_path / 'cache3' / 'data').exists()
  other = _config('gs://bucket/a.parquet', 'gs://bucket/data')
  other.tokenizer.vocab_size = 700
  with pytest.raises(prepared_lib.DataDirError, match='other settings'):
    prepare.prepare(*fields.data_request(other))
