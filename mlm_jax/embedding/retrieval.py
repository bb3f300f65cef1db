"""Exact nearest-neighbour search on the mesh, and BEIR's retrieval and STS scores.

Search: the corpus vectors [N, d] are normalised and split by rows over
every device (padded to a multiple of them, padding never found); a block
of queries is scored against each device's rows and each device keeps its
own top k, then the devices' k-lists are merged into the global top k. No
device holds more than its share of the corpus and of the [Q, N] scores.
The result is exact (cosine, ties broken by the lower corpus row).

Scores, as BEIR computes them with pytrec_eval (trec_eval's definitions):

  nDCG@k     gains are the qrels scores (graded), discounted by log2(rank + 1);
             the ideal ordering is the query's qrels sorted by score
  recall@k   relevant (score > 0) documents in the top k / relevant documents

averaged over the queries the qrels judge; a document whose id is the
query's own is not retrieved (BEIR's ignore_identical_ids, for sets such as
Quora where queries are also documents). STS: Spearman's rho (and Pearson's
r) between the cosine of each pair's vectors and the gold score.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.finetuning import scores
from mlm_jax.runtime import sharding

# Queries scored at once against the corpus: [QUERY_BLOCK, N / devices] floats per device.
QUERY_BLOCK = 256


def _normalised(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@functools.lru_cache(maxsize=4)
def _top_k_fn(mesh, k: int):
  """jit(queries [Q, d], corpus [N, d] split by rows, valid [N]) -> (scores, rows) [Q, k]."""
  devices = mesh.devices.size

  def top_k(queries, corpus, valid):
    n = corpus.shape[0]
    scores_ = jnp.einsum('qd,nd->qn', queries, corpus)
    scores_ = jnp.where(valid[None, :], scores_, -jnp.inf)
    # Each device's rows: [Q, devices, N / devices], the last axis local to a device.
    local = scores_.reshape(scores_.shape[0], devices, n // devices)
    local = jax.lax.with_sharding_constraint(
        local, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            None, (sharding.DATA_AXIS, sharding.FSDP_AXIS), None)))
    value, index = jax.lax.top_k(local, min(k, n // devices))             # [Q, devices, k']
    index = index + (jnp.arange(devices) * (n // devices))[None, :, None]
    value, index = value.reshape(value.shape[0], -1), index.reshape(index.shape[0], -1)
    best, where = jax.lax.top_k(value, k)                                 # The merge.
    return best, jnp.take_along_axis(index, where, axis=1)

  split = sharding.batch_sharding(mesh)
  return jax.jit(top_k, in_shardings=(sharding.replicated(mesh), split, split),
                 out_shardings=sharding.replicated(mesh))


def search(queries: np.ndarray, corpus: np.ndarray, k: int,
           mesh=None) -> tuple[np.ndarray, np.ndarray]:
  """queries [Q, d], corpus [N, d] -> the k best corpus rows of each query by cosine:
  (scores [Q, k] float32, rows [Q, k] int64), best first; k is cut to N."""
  mesh = mesh or sharding.make_mesh()
  devices = mesh.devices.size
  n = len(corpus)
  k = min(k, n)
  padded = -(-n // devices) * devices
  table = np.zeros((padded, corpus.shape[1]), np.float32)
  table[:n] = _normalised(corpus)
  valid = np.arange(padded) < n
  placed = jax.device_put(table, sharding.batch_sharding(mesh))
  valid = jax.device_put(valid, sharding.batch_sharding(mesh))
  fn = _top_k_fn(mesh, k)
  out_scores, out_rows = [], []
  q = _normalised(queries)
  for start in range(0, len(q), QUERY_BLOCK):
    block = q[start:start + QUERY_BLOCK]
    # A short last block is padded, so that every block has one compiled shape.
    pad = np.zeros((QUERY_BLOCK - len(block), q.shape[1]), np.float32)
    value, rows = jax.device_get(fn(np.concatenate([block, pad]), placed, valid))
    out_scores.append(value[:len(block)])
    out_rows.append(rows[:len(block)])
  return np.concatenate(out_scores), np.concatenate(out_rows).astype(np.int64)


def ndcg_at(ranked: Sequence[str], judged: dict[str, int], k: int) -> float:
  """trec_eval's nDCG@k of one query: gains are the qrels scores, discount log2(rank + 1)."""
  dcg = sum(judged.get(d, 0) / np.log2(rank + 2) for rank, d in enumerate(ranked[:k]))
  ideal = sorted((s for s in judged.values() if s > 0), reverse=True)[:k]
  idcg = sum(s / np.log2(rank + 2) for rank, s in enumerate(ideal))
  return float(dcg / idcg) if idcg > 0 else 0.0


def recall_at(ranked: Sequence[str], judged: dict[str, int], k: int) -> float:
  """Relevant (score > 0) documents in the top k over all relevant ones (0 when none)."""
  relevant = {d for d, s in judged.items() if s > 0}
  return len(relevant.intersection(ranked[:k])) / len(relevant) if relevant else 0.0


def retrieval_scores(query_ids: Sequence[str], query_vectors: np.ndarray,
                     doc_ids: Sequence[str], doc_vectors: np.ndarray,
                     qrels: dict[str, dict[str, int]], mesh=None, ndcg_k: int = 10,
                     recall_k: int = 100) -> dict[str, float]:
  """nDCG@ndcg_k and recall@recall_k (means over the queries), and the number of queries.

  query_ids, query_vectors: the queries the qrels judge, in any order.
  """
  depth = max(ndcg_k, recall_k) + 1    # One more: a query's own id is dropped.
  _, rows = search(query_vectors, doc_vectors, depth, mesh)
  ndcg, recall = [], []
  for query_id, found in zip(query_ids, rows):
    ranked = [doc_ids[r] for r in found if doc_ids[r] != query_id]
    ndcg.append(ndcg_at(ranked, qrels[query_id], ndcg_k))
    recall.append(recall_at(ranked, qrels[query_id], recall_k))
  return {f'ndcg@{ndcg_k}': float(np.mean(ndcg)), f'recall@{recall_k}': float(np.mean(recall)),
          'queries': len(query_ids)}


def sts_scores(a: np.ndarray, b: np.ndarray, gold: np.ndarray) -> dict[str, float]:
  """Spearman's rho and Pearson's r of the pairs' cosines against the gold scores."""
  cosine = np.sum(_normalised(a) * _normalised(b), axis=1)
  out = scores.regression(cosine.astype(np.float64), np.asarray(gold, np.float64))
  return {'spearman': out['spearman'], 'pearson': out['pearson'], 'pairs': len(gold)}
