"""MDS directories (mosaicml-streaming's format) as corpora: data/mds_source.py.

The shards are written by streaming's own MDSWriter; mlm_jax reads them with numpy and
zstandard. mosaicml-streaming cannot be a dev dependency: every release requires
transformers<5, and mlm_jax requires transformers>=5. Where it is not installed, these tests
download its wheel alone (`pip download --no-deps`, from the index pip is configured with) into
the session's directory and import its writer from the wheel itself, a zip archive Python
imports from. Its writer runs with transformers 5 (streaming only imports it, for its
dataloader); the other modules it imports (brotli, python-snappy, zstd, xxhash, catalogue,
torch) are in the dev extra. Where the index cannot be reached, the tests are skipped and say
so.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mlm_jax.data import corpus
from mlm_jax.data import mds_source
from mlm_jax.data import packing
from mlm_jax.data import prepare
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import CorpusError
from tests.conftest import micro_config
from tests.test_tables import bucket  # noqa: F401  The gs:// fixture (a local directory).

DOCS = [re.sub(r'\n\s*\n', '\n', d) for d, _ in zip(corpus.stdlib_docstrings(), range(300))]


STREAMING = 'mosaicml-streaming==0.13.0'


@pytest.fixture(scope='module', autouse=True)
def streaming_wheel(tmp_path_factory):
  """mosaicml-streaming importable: installed, or its wheel downloaded and put on sys.path."""
  if importlib.util.find_spec('streaming') is not None:
    yield
    return
  directory = tmp_path_factory.mktemp('wheels')
  done = subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', '--quiet',
                         '--only-binary=:all:', '--dest', str(directory), STREAMING],
                        capture_output=True, text=True, timeout=300, check=False)
  wheels = sorted(directory.glob('*.whl'))
  if done.returncode or not wheels:
    why = (done.stderr.strip().splitlines() or ['no wheel'])[-1]
    pytest.skip(f'{STREAMING} writes these tests\' shards; pip could not download it: {why}')
  sys.path.insert(0, str(wheels[0]))
  yield
  sys.path.remove(str(wheels[0]))


def _streaming():
  """streaming's MDSWriter and merge_index, imported without streaming/__init__.py, which
  imports its vision datasets and with them torchvision (absent beside the CPU torch)."""
  if 'streaming' not in sys.modules:
    spec = importlib.util.find_spec('streaming')
    shell = types.ModuleType('streaming')
    shell.__spec__ = spec
    shell.__path__ = list(spec.submodule_search_locations)
    sys.modules['streaming'] = shell
  from streaming.base.format.mds.writer import MDSWriter  # pylint: disable=import-outside-toplevel
  from streaming.base.util import merge_index  # pylint: disable=import-outside-toplevel
  return MDSWriter, merge_index


def _write_mds(out, samples: list[dict], columns: dict, **kw) -> str:
  writer, _ = _streaming()
  with writer(columns=columns, out=str(out), size_limit=kw.pop('size_limit', 4000), **kw) as w:
    for sample in samples:
      w.write(sample)
  return str(out)


def _pieces(spec: str, **data) -> tuple[list, corpus.Tally]:
  """(first, piece) of every document of a config.data.corpus value, in order."""
  section = ml_collections.ConfigDict({'corpus': spec, 'document_split': 'blank_line',
                                       'text_key': 'text', 'tfds_name': '', 'ids_key': ''})
  section.update(data)
  c = corpus.resolve(section)
  tally = corpus.Tally()
  return [p for unit in c.units for p in c.pieces(unit, tally)], tally


def _prepare(corpus_spec: str, data_dir, **data):
  from mlm_jax.config import fields  # pylint: disable=import-outside-toplevel
  config = micro_config(corpus_spec, str(data_dir))
  config.data.num_workers = 1
  model_file = data.pop('model_file', '')
  config.data.update(data)
  config.tokenizer.model_file = model_file
  return prepare.prepare(*fields.data_request(config))


def _rows(data, split: str) -> np.ndarray:
  source = data.source(split)
  return source.read(np.arange(len(source)))


@pytest.fixture(scope='module')
def text_data(tmp_path_factory):
  """The documents as jsonl, prepared (it trains the tokenizer the ids are made with)."""
  tmp = tmp_path_factory.mktemp('text')
  (tmp / 'a.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in DOCS))
  return tmp, _prepare(str(tmp / 'a.jsonl'), tmp / 'data')


def _id_lists(data) -> list[np.ndarray]:
  """The documents tokenized as an encoder's tokenizer gives them: [CLS] ids [SEP], uint32."""
  tok = data.tokenizer
  s = tok.specials
  return [np.array([s.cls] + ids + [s.sep], np.uint32)
          for ids in tok.encode_documents([tok_lib.sanitize(d) for d in DOCS])]


def test_mds_text_and_ids_prepare_as_jsonl_text_and_parquet_ids(text_data, tmp_path, monkeypatch):
  tmp, text = text_data
  # Text: the same rows as the jsonl, shards read in several units.
  mds_text = _write_mds(tmp_path / 'text', [{'text': d, 'id': i} for i, d in enumerate(DOCS)],
                        {'text': 'str', 'id': 'int'})
  assert len(mds_source.read_index(mds_text)) > 10
  monkeypatch.setattr(corpus, 'UNIT_BYTES', 20_000)
  assert len(corpus.resolve(ml_collections.ConfigDict({
      'corpus': mds_text, 'document_split': 'blank_line', 'text_key': 'text', 'tfds_name': '',
      'ids_key': ''})).units) > 3
  from_mds = _prepare(mds_text, tmp_path / 'd-text')
  assert from_mds.tokenizer.spec()['pieces'] == text.tokenizer.spec()['pieces']
  for split in ('train', 'validation'):
    np.testing.assert_array_equal(_rows(from_mds, split), _rows(text, split))
  # Token ids (ndarray:uint32, ModernBERT's input_ids), plain and zstd with hashes: the same
  # rows as the same ids from a parquet file (the pre-tokenized path of data/arrow_source.py).
  ids = _id_lists(text)
  model_file = os.path.join(text.data_dir, 'tokenizer.model')
  pq.write_table(pa.table({'input_ids': pa.array([x.tolist() for x in ids],
                                                 pa.list_(pa.int32()))}), tmp_path / 'ids.parquet')
  reference = _prepare(str(tmp_path / 'ids.parquet'), tmp_path / 'd-parquet',
                       ids_key='input_ids', model_file=model_file)
  for name, kw in (('plain', {}), ('zstd', {'compression': 'zstd', 'hashes': ['sha1', 'xxh64']})):
    mds_ids = _write_mds(tmp_path / name, [{'input_ids': x, 'text': 'unused'} for x in ids],
                         {'input_ids': 'ndarray:uint32', 'text': 'str'}, **kw)
    suffix = '.mds.zstd' if name == 'zstd' else '.mds'
    assert all(f.endswith(suffix) for f in os.listdir(mds_ids) if f.startswith('shard.'))
    got = _prepare(mds_ids, tmp_path / f'd-{name}', ids_key='input_ids', model_file=model_file)
    assert got.report['tokenizer']['trained'] is False
    for split in ('train', 'validation'):
      np.testing.assert_array_equal(_rows(got, split), _rows(reference, split), err_msg=name)
    assert got.stats == reference.stats


def test_a_merged_index_a_glob_of_indexes_and_a_mixture_by_temperature(text_data, tmp_path):
  """Directories merged by streaming's merge_index (shards in sub-directories), a glob of
  index.json files, and MDS directories as mixture members: each member's train tokens (what
  config.data.temperature draws by) are its documents' tokens."""
  _, text = text_data
  _, merge_index = _streaming()
  ids = _id_lists(text)
  half = len(ids) // 2
  for part, chunk in (('part0', ids[:half]), ('part1', ids[half:])):
    _write_mds(tmp_path / 'root' / part, [{'input_ids': x} for x in chunk],
               {'input_ids': 'ndarray:uint32'}, compression='zstd')
  merge_index(str(tmp_path / 'root'), keep_local=True)
  merged = mds_source.read_index(str(tmp_path / 'root'))
  assert merged[0]['zip_data']['basename'].startswith('part0/')
  expected = [x.astype(np.int64) for x in ids]
  for spec in (str(tmp_path / 'root'), str(tmp_path / 'root' / '*' / 'index.json')):
    pieces, tally = _pieces(spec, ids_key='input_ids')
    assert all(first for first, _ in pieces) and len(pieces) == len(ids)
    for (_, got), want in zip(pieces, expected):
      np.testing.assert_array_equal(got.ids, want)
    assert tally.counts['files_used'] == (1 if spec.endswith('root') else 2)
  model_file = os.path.join(text.data_dir, 'tokenizer.model')
  config = micro_config('', str(tmp_path / 'd-mix'))
  config.data.update({'num_workers': 1, 'ids_key': 'input_ids', 'temperature': 2.0, 'sources': (
      {'corpus': str(tmp_path / 'root' / 'part0'), 'name': 'a'},
      {'corpus': str(tmp_path / 'root' / 'part1'), 'name': 'b'})})
  config.tokenizer.model_file = model_file
  from mlm_jax.config import fields  # pylint: disable=import-outside-toplevel
  from mlm_jax.training import mixture_run  # pylint: disable=import-outside-toplevel
  data = prepare.prepare(*fields.data_request(config))
  fraction, seed = config.data.val_fraction, config.data.split_seed
  # A document's tokens and split are its ids between the [CLS] and [SEP] packing drops.
  want = [sum(len(x) - 2 for x in chunk if not packing.is_validation(
      corpus.sources_lib.Ids(x[1:-1].astype(np.int64), ''), fraction, seed))
          for chunk in (ids[:half], ids[half:])]
  assert mixture_run.train_tokens(data) == want


def test_bad_mds_input_is_one_line_naming_the_file(tmp_path):
  samples = [{'input_ids': np.arange(3 + i, dtype=np.uint32)} for i in range(60)]
  plain = _write_mds(tmp_path / 'plain', samples, {'input_ids': 'ndarray:uint32'},
                     hashes=['sha1'], size_limit=200)
  shards = mds_source.read_index(plain)
  assert len(shards) > 3
  first = os.path.join(plain, shards[1]['raw_data']['basename'])
  # A shard whose bytes no longer match the hash its index gives: found where it is read.
  data = bytearray(open(first, 'rb').read())
  data[-1] ^= 0xFF
  open(first, 'wb').write(bytes(data))
  with pytest.raises(CorpusError, match=r'shard.00001.mds does not match its sha1') as raised:
    _pieces(plain, ids_key='input_ids')
  assert '\n' not in str(raised.value)
  # A shard the index names and the directory lacks: found before anything is read.
  os.remove(first)
  with pytest.raises(CorpusError, match=r'names shard 1, .*shard.00001.mds, which is missing'):
    corpus.resolve(ml_collections.ConfigDict({
        'corpus': plain, 'document_split': 'blank_line', 'text_key': 'text', 'tfds_name': '',
        'ids_key': 'input_ids'}))
  # A truncated zstd shard (no hashes to catch it first), a missing column, a broken index.
  packed = _write_mds(tmp_path / 'zstd', samples, {'input_ids': 'ndarray:uint32'},
                      compression='zstd', size_limit=200)
  zshard = os.path.join(packed, mds_source.read_index(packed)[0]['zip_data']['basename'])
  data = open(zshard, 'rb').read()
  open(zshard, 'wb').write(data[:len(data) // 2])
  for call, words in (
      (lambda: _pieces(packed, ids_key='input_ids'), 'shard.00000.mds.zstd does not decompress'),
      (lambda: _pieces(packed, ids_key='tokens'), "no column config.data.ids_key='tokens'"),
      (lambda: _pieces(packed), "no column config.data.text_key='text'; its columns are "
                                "{'input_ids': 'ndarray:uint32'}")):
    with pytest.raises(CorpusError, match=None) as raised:
      call()
    assert words in str(raised.value) and '\n' not in str(raised.value), str(raised.value)
  with open(os.path.join(packed, 'index.json'), 'w') as f:
    f.write('{"version": 2, "shards": ')
  with pytest.raises(CorpusError, match=r'index.json is not an MDS index \(JSONDecodeError'):
    _pieces(packed, ids_key='input_ids')


def test_an_mds_directory_at_a_bucket_url(bucket):
  """gs://... served from a local directory through fsspec (tests/test_tables.py's bucket)."""
  _write_mds(bucket / 'mds', [{'text': d} for d in DOCS[:40]], {'text': 'str'},
             compression='zstd', hashes=['sha1'])
  pieces, tally = _pieces('gs://bucket/mds')
  assert [p for _, p in pieces] == [p for _, p in _pieces(str(bucket / 'mds'))[0]]
  assert len([first for first, _ in pieces if first]) == 40 and tally.counts['files_used'] == 1

