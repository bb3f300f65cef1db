"""InfoNCE with in-batch negatives gathered from every device, as sums the caller divides.

For a batch of B pairs, query i's candidates are every document of the
batch: the B positives and the B x K hard negatives (masked where a pair has
fewer). logits[i, j] = scale * cos(query_i, document_j); the loss of query i
is the cross-entropy of its own positive among them (sentence-transformers'
MultipleNegativesRankingLoss, directions ('query_to_doc',)). With
`symmetric`, each positive is also scored against every query of the batch
(direction 'doc_to_query'), and the two directions' losses are averaged
('per_direction').

What must stay true: the candidates are the *global* batch. The function is
written on global arrays; under jit on the mesh, the documents' vectors are
constrained to be replicated (XLA all-gathers them across devices and hosts:
B(1 + K) x d floats per device), while each device keeps only its own
queries' rows of the logits [B_local, B(1 + K)]. So the loss on 8 devices
equals the loss on 1 with the same global batch, and no device ever holds
the whole [B, B(1 + K)] matrix. Returned as sums over the global batch
(loss, correct top-1) and their denominator, which the caller divides by.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax.model.layers import BATCH
from mlm_jax.runtime import sharding

Array = jax.Array


def _normalise(x: Array) -> Array:
  """Unit vectors along the last axis (a zero vector stays zero, as torch's normalize)."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _constrain(x: Array, axes: tuple) -> Array:
  """`x` placed as the logical `axes` say on the mesh the step is traced on (else itself)."""
  return nn.with_logical_constraint(x, axes, rules=sharding.LOGICAL_RULES)


def _cross_entropy(logits: Array, target: Array) -> tuple[Array, Array]:
  """logits [B, C] (-inf where masked), target [B] -> (loss [B], correct top-1 [B])."""
  picked = jnp.take_along_axis(logits, target[:, None], axis=1)[:, 0]
  loss = jax.nn.logsumexp(logits, axis=1) - picked
  correct = (jnp.argmax(logits, axis=1) == target).astype(jnp.float32)
  return loss, correct


def info_nce(queries: Array, documents: Array, document_mask: Array, scale: Array | float,
             symmetric: bool = False) -> dict[str, Array]:
  """queries [B, d], documents [B, 1 + K, d] (each pair's positive first), document_mask
  [B, 1 + K] (1: a real document; the positive always is) -> sums over the global batch.

  Returns loss_sum, correct_sum (queries whose positive scores highest) and
  weight_sum (B, or 2B with `symmetric`: the loss is loss_sum / weight_sum).
  """
  b, g, d = documents.shape
  q = _constrain(_normalise(queries.astype(jnp.float32)), (BATCH, None))
  docs = _normalise(documents.astype(jnp.float32))
  # The gather across devices: every device scores its queries against every document.
  candidates = _constrain(docs.reshape(b * g, d), (None, None))           # [B(1+K), d]
  valid = _constrain(document_mask.reshape(b * g) > 0, (None,))
  logits = scale * jnp.einsum('bd,cd->bc', q, candidates)                 # [B, B(1+K)]
  logits = _constrain(jnp.where(valid[None, :], logits, -jnp.inf), (BATCH, None))
  own = jnp.arange(b) * g                              # Pair i's positive in the candidates.
  loss, correct = _cross_entropy(logits, own)
  loss_sum = jnp.sum(loss)
  if symmetric:
    # Each positive against every query: the queries gathered, the positives stay local.
    positives = _constrain(docs[:, 0], (BATCH, None))
    all_queries = _constrain(q, (None, None))
    back = _constrain(scale * jnp.einsum('bd,cd->bc', positives, all_queries), (BATCH, None))
    loss_sum += jnp.sum(_cross_entropy(back, jnp.arange(b))[0])
  return {'loss_sum': loss_sum, 'correct_sum': jnp.sum(correct),
          'weight_sum': jnp.asarray(b * (2 if symmetric else 1), jnp.float32)}


def logit_scale(params: dict, temperature: float, max_scale: float) -> Array:
  """1 / temperature, or the learned scale exp(params['log_scale']) clipped at `max_scale`."""
  if 'log_scale' not in params:
    return jnp.asarray(1.0 / temperature, jnp.float32)
  return jnp.minimum(jnp.exp(params['log_scale']), max_scale)
