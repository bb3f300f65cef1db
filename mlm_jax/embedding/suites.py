"""The retrieval and STS suites: an embedding model scored on a data set, beside its peers.

`run_suite` is what `python -m mlm_jax.evaluate --suite=retrieval|sts` (and
`python -m mlm_jax.embed --evaluate=...`) call. The model is an embed run's
OUT (`workdir` holding embedding.json), or the mean-pooled encoder of a
pretraining run (`workdir`) or a Hugging Face checkpoint (`hf_dir`). Rows of
the results, each scored by the same code on the same texts:

  before                an embed run's starting encoder, mean pooling, the run's
                        prompts and row length: what contrastive training added
  mlm_jax               the model itself
  sentence-transformers with compare='st' (an embed run only): st_peer.py's
                        model, trained by sentence-transformers on the same data,
                        batches, pooling, temperature and schedule

  retrieval  `data` a BEIR directory; its qrels/test.tsv (else dev.tsv) judge
             the queries; the whole corpus is encoded in sharded batches and
             searched exactly on the mesh (retrieval.py): nDCG@10, recall@100
  sts        `data` a file of sentence pairs with gold scores (data.read_sts):
             Spearman's rho of the cosines (and Pearson's r); both texts get
             the query prompt, as E5 prompts symmetric tasks

Writes OUT/results.json (the scores, the models, the data, the peer's
protocol) and OUT/results.md (the table), and returns the results. A
finished peer is reused by a rerun (st_peer.train).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from mlm_jax.embedding import data as data_lib
from mlm_jax.embedding import inference
from mlm_jax.embedding import retrieval
from mlm_jax.embedding import run_dir
from mlm_jax.embedding import st_peer
from mlm_jax.errors import ConfigError
from mlm_jax.finetuning import pretrained as pretrained_lib
from mlm_jax.runtime import sharding

SUITES = ('retrieval', 'sts')
COMPARES = ('st',)
# The qrels splits a retrieval suite scores, the first a directory has.
EVAL_SPLITS = ('test', 'dev')
# Column names of the results, in the order the table shows them.
BEFORE, OURS, PEER = 'before', 'mlm_jax', 'sentence-transformers'
# Texts -> vectors [N, d] for one row of the results; `prompt` is put before each text.
Embed = Callable[[list[str], str], np.ndarray]


def run_suite(suite: str, *, workdir: str | None, hf_dir: str | None, out_dir: str, data: str,
              compare: str | None) -> dict[str, Any]:
  """Scores the model on `data` (see the module doc); writes OUT/results.json and .md."""
  if suite not in SUITES:
    raise ConfigError(f'--suite={suite!r}: the embedding suites are {", ".join(SUITES)}.')
  if compare is not None and compare not in COMPARES:
    raise ConfigError(f'--compare={compare!r}: embedding suites compare with {COMPARES[0]!r} '
                      '(sentence-transformers).')
  embed_run = run_dir.is_embed_run(workdir)
  if compare == 'st' and not embed_run:
    raise ConfigError('--compare=st trains the sentence-transformers peer of an embed run: give '
                      '--workdir=OUT of `python -m mlm_jax.embed`.')
  if not data:
    raise ConfigError(f'--suite={suite} scores on --data: a BEIR directory (retrieval) or a '
                      'file of scored sentence pairs (sts).')
  if not os.path.exists(data):
    raise FileNotFoundError(f'--data={data}: no such file or directory.')
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  mesh = sharding.make_mesh()
  batch = _batch_size(workdir if embed_run else None, mesh.devices.size)
  ours = inference.load(workdir, hf_dir)
  rows: dict[str, tuple[str, Embed, str, str]] = {}   # name -> (model, embed, prompts)
  if embed_run:
    start = _start(ours, run_dir.read_record(workdir))
    if start is not None:
      rows[BEFORE] = (start.description, _ours(start, batch, mesh), ours.query_prompt,
                      ours.document_prompt)
  rows[OURS] = (ours.description, _ours(ours, batch, mesh), ours.query_prompt,
                ours.document_prompt)
  protocol = None
  if compare == 'st':
    protocol = st_peer.protocol(workdir)
    peer_path = st_peer.train(workdir, os.path.join(out_dir, 'sentence_transformers'))
    rows[PEER] = (f'sentence-transformers, trained in {peer_path}',
                  _peer(st_peer.encoder(peer_path), batch), ours.query_prompt,
                  ours.document_prompt)
  score = _retrieval if suite == 'retrieval' else _sts
  results = {'suite': suite, 'data': os.path.abspath(data), **score(data, rows, mesh),
             'models': {name: row[0] for name, row in rows.items()}}
  if protocol is not None:
    results['peer_protocol'] = protocol
  if jax.process_index() == 0:
    _write(out_dir, results)
  return results


# ------------------------------------------------------------------ suites


def _retrieval(data: str, rows: dict[str, tuple], mesh) -> dict[str, Any]:
  beir = data_lib.Beir.read(data)
  qrels_dir = os.path.join(data, data_lib.QRELS_DIR)
  split = next((s for s in EVAL_SPLITS if os.path.isfile(os.path.join(qrels_dir, f'{s}.tsv'))),
               None)
  if split is None:
    raise FileNotFoundError(f'{qrels_dir}: no {" or ".join(s + ".tsv" for s in EVAL_SPLITS)} to '
                            'score retrieval with.')
  qrels = beir.qrels(split)
  query_ids = list(qrels)
  doc_ids = list(beir.corpus)
  scores = {}
  for name, (_, embed, query_prompt, document_prompt) in rows.items():
    start = time.perf_counter()
    documents = embed(list(beir.corpus.values()), document_prompt)
    queries = embed([beir.queries[q] for q in query_ids], query_prompt)
    scores[name] = retrieval.retrieval_scores(query_ids, queries, doc_ids, documents, qrels,
                                              mesh)
    scores[name]['seconds'] = time.perf_counter() - start
    logging.info('%s: %s', name, scores[name])
  return {'split': split, 'documents': len(doc_ids), 'scores': scores}


def _sts(data: str, rows: dict[str, tuple], mesh) -> dict[str, Any]:
  del mesh  # The cosines are computed on the host.
  pairs = data_lib.read_sts(data)
  scores = {}
  for name, (_, embed, query_prompt, _) in rows.items():
    start = time.perf_counter()
    scores[name] = retrieval.sts_scores(embed(pairs.a, query_prompt),
                                        embed(pairs.b, query_prompt), pairs.scores)
    scores[name]['seconds'] = time.perf_counter() - start
    logging.info('%s: %s', name, scores[name])
  return {'scores': scores}


# ---------------------------------------------------------------- helpers


def _batch_size(embed_run: str | None, devices: int) -> int:
  """The run's config.eval.batch_size, else 64; a multiple of the devices."""
  size = run_dir.read_config(embed_run)['eval']['batch_size'] if embed_run else 64
  return -(-size // devices) * devices


def _ours(encoder: inference.TextEncoder, batch: int, mesh) -> Embed:
  return lambda texts, prompt: encoder.embed(texts, batch, mesh, prompt)


def _peer(model: Any, batch: int) -> Embed:
  def embed(texts: list[str], prompt: str) -> np.ndarray:
    return np.asarray(model.encode(texts, prompt=prompt or None, batch_size=batch,
                                   convert_to_numpy=True), np.float32)
  return embed


def _start(trained: inference.TextEncoder,
           record: dict[str, Any]) -> inference.TextEncoder | None:
  """The encoder the run started from (mean pooling, the run's row length and prompts), or
  None with a warning where it can no longer be read."""
  source = record['pretrained']
  try:
    start = pretrained_lib.load(source.get('workdir'), source.get('hf_dir'))
  except (ConfigError, FileNotFoundError) as e:
    logging.warning('The model the run started from (%s) does not read (%s): no "before" row.',
                    source, e)
    return None
  return inference.from_pretrained(start, 'mean', trained.seq_len, trained.query_prompt,
                                   trained.document_prompt)


_LABELS = {'ndcg@10': 'nDCG@10', 'recall@100': 'recall@100', 'spearman': 'Spearman',
           'pearson': 'Pearson'}


def _write(out_dir: str, results: dict[str, Any]) -> None:
  """OUT/results.json and OUT/results.md (a row per model, a column per score)."""
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  metrics = [m for m in _LABELS if m in next(iter(results['scores'].values()))]
  where = results['data']
  if results['suite'] == 'retrieval':
    first = next(iter(results['scores'].values()))
    where += (f" (qrels {results['split']}: {first['queries']} queries, "
              f"{results['documents']} documents)")
  lines = [f"# {results['suite']}: {where}", '',
           '| model | ' + ' | '.join(_LABELS[m] for m in metrics) + ' |',
           '| --- |' + ' --- |' * len(metrics)]
  for name, scores in results['scores'].items():
    lines.append(f'| {name} | ' + ' | '.join(f'{scores[m]:.4f}' for m in metrics) + ' |')
  lines += [''] + [f'- {name}: {model}' for name, model in results['models'].items()]
  if 'peer_protocol' in results:
    p = results['peer_protocol']
    lines.append(f"- the peer: {p['num_steps']} steps of {p['batch_size']} pairs, temperature "
                 f"{p['temperature']}" + (' (learned in mlm_jax, fixed in the peer)'
                                          if p['learned_temperature_here'] else '')
                 + f", {p['pooling']} pooling, peak learning rate {p['learning_rate']:.3g}")
  with open(os.path.join(out_dir, 'results.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
