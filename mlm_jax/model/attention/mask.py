"""The mask description: what each query of a layer may see, without a [B, T, T] mask.

A model describes the mask (`Mask`): which tokens are real (padding comes
last in every row), each token's document when packed documents are kept
apart, and, for a local layer, the window in positions of the original row.
Each kernel reads the description in its own form: a dense [B, Q, T] mask
(`allowed`), row lengths (`lengths`) or segment ids (`segments`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@flax.struct.dataclass
class Mask:
  """What each query of a layer may see.

  A query sees key j when j is a real token, lies in the query's document
  (when `documents` is given) and, for a local layer, is at most `window`
  positions away in the original row.
  """

  valid: Array                      # [B, T] bool: real tokens (padding last in every row).
  # [B or 1, T] int: each token's position in the original row, which
  # windows measure distances in. None: 0..T-1 (no token was dropped), so
  # the window is a static band of the [T, T] grid.
  positions: Array | None = None
  documents: Array | None = None    # [B, T] int: document of each token; None: one per row.
  window: int | None = flax.struct.field(pytree_node=False, default=None)  # None: global.

  @property
  def contiguous(self) -> bool:
    return self.positions is None

  def row_positions(self) -> Array:
    """[B or 1, T]: `positions`, or 0..T-1."""
    if self.positions is None:
      return jnp.arange(self.valid.shape[1])[None]
    return self.positions

  def allowed(self, rows: Array | None = None) -> Array:
    """[B, Q, T] bool (or [B, T] when a query sees every real key): what each query sees.

    rows [B, Q]: the queries' indices into T (None: every token is a query).
    """
    if self.window is None and self.documents is None:
      return self.valid
    b, t = self.valid.shape
    allowed = self.valid[:, None, :]
    if self.window is not None:
      keys = self.row_positions()
      if rows is None:
        if self.positions is None:   # A constant of the program.
          i = np.arange(t)
          near = np.abs(i[:, None] - i[None, :]) <= self.window
          allowed = allowed & near[None]
        else:
          allowed = allowed & (jnp.abs(keys[:, :, None] - keys[:, None, :]) <= self.window)
      else:
        queries = rows if self.positions is None else _take(keys, rows)
        allowed = allowed & (jnp.abs(queries[:, :, None] - keys[:, None, :]) <= self.window)
    if self.documents is not None:
      queries = self.documents if rows is None else _take(self.documents, rows)
      allowed = allowed & (queries[:, :, None] == self.documents[:, None, :])
    return jnp.broadcast_to(allowed, (b, t if rows is None else rows.shape[1], t))

  def lengths(self) -> Array:
    """[B] int32: real tokens per row."""
    return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)

  def segments(self) -> Array:
    """[B, T] int32: splash's segment ids; padding is segment 0, a real token its document."""
    if self.documents is not None:
      return jnp.where(self.valid, self.documents, 0).astype(jnp.int32)
    return self.valid.astype(jnp.int32)


def tiled_keys(q_len: int, kv_len: int, window: int | None, block: int) -> float:
  """Keys per query a tiled kernel computes: whole tiles of `block`, those outside the band skipped.

  A query tile computes every key tile its window touches (the whole row
  without a window); lengths are whole tiles.
  """
  if window is None:
    return float(kv_len)
  tiles = 0
  for i in range(q_len // block):
    first = max(0, i * block - window) // block
    last = min(kv_len - 1, (i + 1) * block - 1 + window) // block
    tiles += last - first + 1
  return tiles * block * block / q_len


def _take(x: Array, rows: Array) -> Array:
  """x [B or 1, T] at rows [B, Q] -> [B, Q]."""
  return jnp.take_along_axis(jnp.broadcast_to(x, (rows.shape[0], x.shape[1])), rows, axis=1)
