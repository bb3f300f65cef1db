"""Embedding models end to end on a tiny BEIR-format set: contrastive training learns, its loss is
the whole global batch's on any mesh (and GradCache's equals it), sentence-transformers loads the
export with our vectors and, trained the same way, scores the same; bad input is one line."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from mlm_jax.data import corpus
from mlm_jax.embedding import config as config_lib
from mlm_jax.embedding import data as data_lib
from mlm_jax.embedding import inference
from mlm_jax.embedding import loop
from mlm_jax.embedding import model as embed_model
from mlm_jax.embedding import retrieval
from mlm_jax.embedding import run_dir
from mlm_jax.embedding import st_export
from mlm_jax.embedding import step as step_lib
from mlm_jax.embedding import suites
from mlm_jax.errors import CheckpointMismatchError
from mlm_jax.errors import ConfigError
from mlm_jax.finetuning.data import DataError
from mlm_jax.runtime import sharding
from tests.conftest import REPO
from tests.conftest import model_config


def _paragraphs(n: int) -> list[str]:
  """The first paragraphs of stdlib docstrings, 8 to 40 words each (distinct, in a fixed order)."""
  out, seen = [], set()
  for doc in corpus.stdlib_docstrings():
    text = ' '.join(doc.split('\n\n')[0].split())
    if 8 <= len(text.split()) <= 40 and text not in seen:
      seen.add(text)
      out.append(text)
      if len(out) == n:
        return out
  raise AssertionError('too few docstrings')


def _write_jsonl(path, rows) -> str:
  with open(path, 'w') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)
  return str(path)


def write_beir(directory, documents: list[str], train_fraction: float = 0.8, seed: int = 0) -> str:
  """A BEIR directory over `documents`: one keyword query per document (4 of its words, shuffled),
  the first `train_fraction` of them judged in qrels/train.tsv, the rest in qrels/test.tsv."""
  rng = np.random.default_rng(seed)
  os.makedirs(os.path.join(directory, 'qrels'), exist_ok=True)
  _write_jsonl(os.path.join(directory, 'corpus.jsonl'),
               [{'_id': f'd{i}', 'title': '', 'text': t} for i, t in enumerate(documents)])
  queries, cut = [], int(len(documents) * train_fraction)
  for split, ids in (('train', range(cut)), ('test', range(cut, len(documents)))):
    with open(os.path.join(directory, 'qrels', f'{split}.tsv'), 'w') as f:
      f.write('query-id\tcorpus-id\tscore\n')
      for i in ids:
        words = [w.strip('.,:;()`\'"') for w in documents[i].split() if len(w) > 3]
        picked = rng.choice(words, min(4, len(words)), replace=False)
        queries.append({'_id': f'q{i}', 'text': ' '.join(picked)})
        f.write(f'q{i}\td{i}\t1\n')
  _write_jsonl(os.path.join(directory, 'queries.jsonl'), queries)
  return str(directory)


# ------------------------------------------------------------ fast checks


@pytest.mark.parametrize('case', ['no positive', 'empty query', 'negatives not texts',
                                  'unknown document', 'unknown query', 'score not a number'])
def test_bad_input_names_file_line_and_field(case, tmp_path):
  pairs = [{'query': 'a query', 'positive': 'its document', 'negatives': ['another']}]
  if case in ('no positive', 'empty query', 'negatives not texts'):
    bad = {'no positive': {'query': 'a second query'},
           'empty query': {'query': ' ', 'positive': 'a document'},
           'negatives not texts': {'query': 'q', 'positive': 'p', 'negatives': [3]}}[case]
    path = _write_jsonl(tmp_path / 'pairs.jsonl', pairs + [bad])
    expected = {'no positive': r"pairs.jsonl line 2: field 'positive' is missing: every pair needs "
                               'a positive',
                'empty query': r"pairs.jsonl line 2: field 'query' is empty",
                'negatives not texts': r"pairs.jsonl line 2: field 'negatives' must be a list of "
                                       'non-empty texts'}[case]
  else:
    path = write_beir(tmp_path / 'beir', _paragraphs(10))
    row = {'unknown document': 'q0\tnowhere\t1', 'unknown query': 'q99\td0\t1',
           'score not a number': 'q0\td0\thigh'}[case]
    with open(os.path.join(path, 'qrels', 'train.tsv'), 'a') as f:
      f.write(row + '\n')
    expected = {'unknown document': r"train.tsv line 10: corpus-id 'nowhere' is not in "
                                    'corpus.jsonl',
                'unknown query': r"train.tsv line 10: query-id 'q99' is not in queries.jsonl",
                'score not a number': r"train.tsv line 10: score 'high' is not an integer"}[case]
  with pytest.raises(DataError, match=expected):
    data_lib.read_pairs(path)


def test_a_pair_file_without_a_positive_column_and_a_batch_below_two_are_refused(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  path = str(tmp_path / 'pairs.parquet')
  pq.write_table(pa.table({'query': ['a', 'b'], 'document': ['c', 'd']}), path)
  with pytest.raises(DataError, match=r"pairs.parquet: no column 'positive'"):
    data_lib.read_pairs(path)
  config = config_lib.get_config()
  config.train.batch_size = 1
  with pytest.raises(ConfigError, match=r'batch_size=1: a contrastive batch needs at least 2'):
    config_lib.check_config(config, 1)
  config.train.batch_size, config.train.mini_batch_size = 16, 12
  with pytest.raises(ConfigError, match=r'mini_batch_size=12 must divide'):
    config_lib.check_config(config, 4)


def test_parquet_pairs_read_as_jsonl_pairs_and_texts_are_stored_once(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  rows = [{'query': 'q1', 'positive': 'shared', 'negatives': ['n1', 'n2']},
          {'query': 'q2', 'positive': 'p2', 'negatives': ['shared']},
          {'query': 'q3', 'positive': 'p3', 'negatives': []}]
  jsonl = data_lib.read_pairs(_write_jsonl(tmp_path / 'pairs.jsonl', rows))
  path = str(tmp_path / 'pairs.parquet')
  pq.write_table(pa.Table.from_pylist(rows), path)
  assert data_lib.read_pairs(path) == jsonl
  texts, query, documents = data_lib.index_pairs(jsonl, None, 'query: ', 'passage: ')
  assert len(texts) == len(set(texts)) == 8        # 'passage: shared' once for its two uses.
  assert [texts[i] for i in query] == ['query: q1', 'query: q2', 'query: q3']
  assert documents[0, 0] == documents[1, 1] and texts[documents[0, 0]] == 'passage: shared'
  assert documents.shape == (3, 3) and list(documents[2, 1:]) == [-1, -1]   # Masked slots.
  _, _, one = data_lib.index_pairs(jsonl, 1)
  assert one.shape == (3, 2)


def test_pair_batches_are_the_same_global_batch_whatever_the_number_of_processes():
  pairs = data_lib.EncodedPairs(
      data_lib.Rows(np.arange(40 * 4, dtype=np.int32).reshape(40, 4), np.ones((40, 4), np.int32),
                    0),
      np.arange(20), np.stack([np.arange(20, 40), np.full(20, -1)], axis=1))
  whole = [next(data_lib.PairBatches(pairs, 8, seed=3, start_step=s)) for s in range(6)]
  halves = [data_lib.PairBatches(pairs, 8, seed=3, start_step=0, process_index=p,
                                 process_count=2) for p in range(2)]
  for batch in whole:
    parts = [next(h) for h in halves]
    for key in batch:
      np.testing.assert_array_equal(batch[key], np.concatenate([p[key] for p in parts]))
    assert batch['input_ids'].shape == (8, 3, 4)
    np.testing.assert_array_equal(batch['document_mask'], [[1, 0]] * 8)
  # 20 pairs, batches of 8: every pair once in the first 20 rows of the stream.
  firsts = np.concatenate([b['input_ids'][:, 0, 0] for b in whole])[:20] // 4
  assert sorted(firsts) == list(range(20))


@pytest.mark.parametrize('pooling', ['mean', 'cls', 'last'])
def test_pooling_reads_only_real_tokens(pooling):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 4)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.int32)
  got = np.asarray(embed_model.pool(x, mask, pooling))
  for row, length in enumerate(mask.sum(1)):
    want = {'mean': x[row, :length].mean(0), 'cls': x[row, 0], 'last': x[row, length - 1]}
    np.testing.assert_allclose(got[row], want[pooling], rtol=1e-6, atol=1e-6)


def test_search_on_the_mesh_is_exact_and_scores_are_trec_evals():
  rng = np.random.default_rng(1)
  corpus_vectors = rng.normal(size=(37, 6)).astype(np.float32)   # 37: not a multiple of 8.
  queries = rng.normal(size=(5, 6)).astype(np.float32)
  scores, rows = retrieval.search(queries, corpus_vectors, 10)
  cosine = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ (
      corpus_vectors / np.linalg.norm(corpus_vectors, axis=1, keepdims=True)).T
  np.testing.assert_array_equal(rows, np.argsort(-cosine, axis=1)[:, :10])
  np.testing.assert_allclose(scores, np.sort(cosine, axis=1)[:, ::-1][:, :10], atol=1e-6)
  assert retrieval.search(queries, corpus_vectors[:3], 10)[1].shape == (5, 3)
  # trec_eval's nDCG: graded gains over log2(rank + 1), the ideal from the judgements.
  judged = {'a': 2, 'b': 1, 'c': 0}
  ndcg = retrieval.ndcg_at(['x', 'b', 'a'], judged, 10)
  assert ndcg == pytest.approx((1 / np.log2(3) + 2 / np.log2(4)) / (2 + 1 / np.log2(3)))
  assert retrieval.ndcg_at(['b', 'x'], judged, 1) == pytest.approx(0.5)
  assert retrieval.recall_at(['c', 'a', 'x'], judged, 2) == 0.5   # 'c' is judged, not relevant.
  # A document whose id is the query's own is not retrieved (BEIR's ignore_identical_ids).
  same = retrieval.retrieval_scores(['d0'], corpus_vectors[:1], ['d0', 'd1'], corpus_vectors[:2],
                                    {'d0': {'d1': 1}})
  assert same['ndcg@10'] == 1.0 and same['recall@100'] == 1.0


# ------------------------------------------------ the loss on any mesh


def _step_once(mesh, chunks: int, batch: dict, model_cfg, loss, start=None) -> tuple:
  """(metrics, parameters after the step, the host state it started from): one train step on
  `mesh` in `chunks` chunks, from `start` (a host state; None: the build's own init)."""
  config = config_lib.get_config()
  config.train.batch_size = len(batch['input_ids'])
  config.train.mini_batch_size = config.train.batch_size // chunks if chunks > 1 else 0
  train = config_lib.plan(config.train, 64, model_cfg.hidden_size).train_section(config.train)
  built = step_lib.build(model_cfg, 'mean', loss, train, batch['input_ids'].shape[-1], 0, mesh)
  if start is None:
    start = jax.device_get(built.init_state())
  # The same start on every mesh, each array placed in this build's sharding (its init compiled
  # once, not once per mesh).
  leaves = jax.tree_util.tree_leaves(start)
  placed = [jax.device_put(x, a.sharding)
            for x, a in zip(leaves, jax.tree_util.tree_leaves(built.abstract_state))]
  state = jax.tree_util.tree_structure(built.abstract_state).unflatten(placed)
  state, metrics = built.train_step(state, sharding.to_global(batch, mesh), built.dropout_rng)
  return jax.device_get(metrics), jax.device_get(state.params), start


@pytest.mark.slow
def test_loss_on_8_devices_is_the_one_device_loss_and_gradcache_changes_nothing():
  """data 4 x fsdp 2 against one device, same global batch: every device scores its queries
  against every document of the batch. A learned temperature, the symmetric direction and a
  masked hard negative are on, so each path of the loss is in the comparison."""
  cfg = model_config(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
                     max_position_embeddings=16, dropout_rate=0.0, attention_dropout_rate=0.0)
  loss = config_lib.get_config().loss
  loss.learn_temperature, loss.symmetric = True, True
  rng = np.random.default_rng(0)
  b, g, t = 16, 3, 12
  lengths = rng.integers(3, t + 1, (b, g))
  mask = (np.arange(t) < lengths[..., None]).astype(np.int32)
  batch = {'input_ids': (rng.integers(5, 300, (b, g, t)) * mask).astype(np.int32),
           'attention_mask': mask, 'document_mask': np.ones((b, g - 1), np.float32)}
  batch['document_mask'][5, 1] = 0.0
  one, one_params, start = _step_once(sharding.make_mesh(1, jax.devices()[:1]), 1, batch, cfg,
                                      loss)
  mesh = sharding.make_mesh(2)
  assert dict(mesh.shape) == {'data': 4, 'fsdp': 2}
  eight, eight_params, _ = _step_once(mesh, 1, batch, cfg, loss, start)
  cached, cached_params, _ = _step_once(mesh, 2, batch, cfg, loss, start)
  # Negatives from this device only would give a much lower loss than all 47 others.
  assert one['loss'] > np.log(8)
  for other, params in ((eight, eight_params), (cached, cached_params)):
    for key in ('loss', 'grad_norm', 'correct_sum', 'logit_scale'):
      assert other[key] == pytest.approx(one[key], rel=1e-5), key
    for a, c in zip(jax.tree_util.tree_leaves(one_params), jax.tree_util.tree_leaves(params)):
      np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
  assert float(one_params['log_scale']) != pytest.approx(np.log(20.0))   # The scale learned.


# ------------------------------------------- end to end, with the peers


@pytest.fixture(scope='module')
def beir_run(tmp_path_factory):
  """(hf dir, BEIR dir, embed run): a random-weight one-layer BERT (published layout) trained 30
  steps of 32 pairs on 160 keyword queries, with E5's prompts and dropout off."""
  pytest.importorskip('transformers')
  torch = pytest.importorskip('torch')
  torch.set_num_threads(1)   # The peer's model is tiny: threads only contend with JAX's here.
  from tests import published
  root = tmp_path_factory.mktemp('embed')
  documents = _paragraphs(200)
  hf_dir = published.make_bert(str(root / 'hf'), documents + _paragraphs(400)[200:],
                               num_hidden_layers=1)
  beir = write_beir(root / 'beir', documents)
  config = config_lib.get_config()
  config.data.seq_len = 32
  config.data.query_prompt, config.data.document_prompt = 'query: ', 'passage: '
  config.model.dropout_rate = 0.0
  config.train.batch_size, config.train.num_steps = 32, 30
  config.train.learning_rate = 1e-3
  out = str(root / 'run')
  result = loop.embed(None, out, beir, config, hf_dir=hf_dir)
  assert result['step'] == 30
  return hf_dir, beir, out, config


@pytest.mark.slow
def test_trained_model_beats_its_start_and_sentence_transformers_agrees(beir_run, tmp_path):
  pytest.importorskip('sentence_transformers')
  _, beir, out, _ = beir_run
  results = suites.run_suite('retrieval', workdir=out, hf_dir=None, out_dir=str(tmp_path),
                             data=beir, compare='st')
  scores = results['scores']
  ours, before, peer = (scores[k]['ndcg@10'] for k in ('mlm_jax', 'before',
                                                       'sentence-transformers'))
  assert scores['mlm_jax']['queries'] == 40 and results['split'] == 'test'
  assert ours > before + 0.05, scores
  assert abs(ours - peer) <= 0.03, scores     # The same training: equal within seed noise.
  with open(tmp_path / 'results.md') as f:
    table = f.read()
  assert '| mlm_jax |' in table and '| sentence-transformers |' in table
  assert json.loads((tmp_path / 'results.json').read_text())['peer_protocol']['num_steps'] == 30


@pytest.mark.slow
def test_sentence_transformers_loads_the_export_and_encodes_our_vectors(beir_run, tmp_path):
  st = pytest.importorskip('sentence_transformers')
  _, _, out, _ = beir_run
  env = {**os.environ, 'PYTHONPATH': str(REPO), 'HF_HUB_OFFLINE': '1'}
  done = subprocess.run([sys.executable, '-m', 'mlm_jax.export', f'--workdir={out}',
                         f'--out={tmp_path / "st"}'], env=env, capture_output=True, text=True,
                        check=True)
  assert 'as a sentence-transformers directory' in done.stdout
  texts = _paragraphs(230)[200:] + ['one', 'a much longer text ' * 20]
  ours = inference.from_run(out)
  model = st.SentenceTransformer(str(tmp_path / 'st'), device='cpu')
  for prompt_name, prompt in ((None, ''), ('query', 'query: '), ('document', 'passage: ')):
    theirs = model.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)
    np.testing.assert_allclose(theirs, ours.embed(texts, prompt=prompt), atol=1e-5)


@pytest.mark.slow
def test_a_rerun_resumes_from_the_last_checkpoint_identically(beir_run, tmp_path):
  hf_dir, beir, out, config = beir_run
  copy = str(tmp_path / 'resumed')
  shutil.copytree(out, copy)
  shutil.rmtree(os.path.join(copy, 'checkpoints', '30'))   # As if stopped after step 24.
  assert loop.embed(None, copy, beir, config, hf_dir=hf_dir)['step'] == 30
  with open(os.path.join(copy, 'metrics.jsonl')) as f:
    assert [json.loads(line)['step'] for line in f][-2:] == [30, 30]
  first, again = run_dir.load(out), run_dir.load(copy)
  for a, b in zip(jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(again.params)):
    np.testing.assert_array_equal(a, b)
  other = config.copy_and_resolve_references()
  other.model.pooling = 'cls'
  with pytest.raises(CheckpointMismatchError,
                     match=r"trained with pooling='mean', but this run has pooling='cls'"):
    loop.embed(None, copy, beir, other, hf_dir=hf_dir)


@pytest.mark.slow
def test_sts_spearman_rises_with_training(beir_run, tmp_path):
  hf_dir, beir, out, _ = beir_run
  documents = _paragraphs(200)
  queries = {row['_id']: row['text'] for row in map(json.loads, open(os.path.join(
      beir, 'queries.jsonl')))}
  rng = np.random.default_rng(5)
  rows = []
  for i in range(160, 200):   # Test queries: with their document (1) or another's (0).
    j = i if i % 2 else int(rng.integers(160, 200))
    rows.append({'sentence1': queries[f'q{i}'], 'sentence2': documents[j], 'score': float(i == j)})
  path = _write_jsonl(tmp_path / 'sts.jsonl', rows)
  results = suites.run_suite('sts', workdir=out, hf_dir=None, out_dir=str(tmp_path / 'res'),
                             data=path, compare=None)
  assert results['scores']['mlm_jax']['spearman'] > results['scores']['before']['spearman']
  untrained = suites.run_suite('sts', workdir=None, hf_dir=hf_dir, out_dir=str(tmp_path / 'hf'),
                               data=path, compare=None)
  assert list(untrained['scores']) == ['mlm_jax']   # An encoder alone: its mean-pooled vectors.


@pytest.mark.slow
def test_command_prints_one_error_line_and_exits_2(beir_run, tmp_path):
  hf_dir, beir, _, _ = beir_run
  env = {**os.environ, 'PYTHONPATH': str(REPO), 'HF_HUB_OFFLINE': '1'}
  done = subprocess.run([sys.executable, '-m', 'mlm_jax.embed', f'--hf_dir={hf_dir}',
                         f'--out={tmp_path / "o"}', f'--train_data={beir}',
                         '--config.train.batch_size=1'], env=env, capture_output=True, text=True)
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines()[-1] == (
      'error: config.train.batch_size=1: a contrastive batch needs at least 2 pairs (the '
      'negatives of a pair are the other pairs of its batch).')


@pytest.mark.slow
def test_a_modernbert_exports_with_our_vectors(tmp_path):
  """ModernBERT's layout (rotary positions, local attention, no biases), [CLS] pooling."""
  st = pytest.importorskip('sentence_transformers')
  pytest.importorskip('transformers')
  from mlm_jax.finetuning import pretrained as pretrained_lib
  from tests import published
  texts = _paragraphs(120)
  hf_dir = published.make_modernbert(str(tmp_path / 'hf'), texts)
  encoder = inference.from_pretrained(pretrained_lib.from_hf_dir(hf_dir), 'cls', seq_len=24,
                                      query_prompt='query: ')
  st_export.write(str(tmp_path / 'st'), encoder.encoder, encoder.model_cfg, encoder.tokenizer,
                  pooling='cls', seq_len=24, query_prompt='query: ')
  model = st.SentenceTransformer(str(tmp_path / 'st'), device='cpu')
  sample = texts[:20] + ['x']
  np.testing.assert_allclose(model.encode(sample, prompt_name='query', convert_to_numpy=True),
                             encoder.embed_queries(sample), atol=1e-5)
