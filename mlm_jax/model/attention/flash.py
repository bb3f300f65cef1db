"""'flash': our Pallas flash attention for NVIDIA GPUs: a two-sided window, documents, padding.

One kernel for every mask cuDNN's fused call cannot take: a local layer's
window of w keys each side of its query (ModernBERT's), packed documents
kept apart, DropToken's moved positions, and queries at chosen rows (the
last block at the masked slots). A query sees key j when both carry the same
segment id (`Mask.segments`: its document, or 0 for padding) and, with a
window, their positions lie at most w apart.

Tiles of FLASH_BLOCK queries meet tiles of FLASH_BLOCK keys in the online
softmax of FlashAttention-2 (running max and sum in float32, exp2 of
log2-scaled scores); nothing of size T² is ever stored. Each tile's loop
spans only the tiles it can meet (`tile_spans`, computed before the
kernels): those whose segment ids can match its own (a document's tiles,
not its neighbours' nor the row's padding) and, where the queries are the
row itself and a window is set, those its band touches (DropToken only
brings tokens closer in index than in position, so a key within w
positions is within w indices). The backward pass recomputes the
probabilities tile by tile from the saved log-sum-exp: one kernel for dK
and dV (per key tile, over the query tiles of its span) and one for dQ.

The kernels are lowered through Pallas's Triton backend on GPUs; `interpret`
runs them in Pallas's interpreter on any platform (the equality tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mlm_jax.model.attention.mask import Mask
from mlm_jax.model.attention.mask import tiled_keys
from mlm_jax.model.attention.sharded import per_device

Array = jax.Array

# Queries and keys per tile, forward and backward. Triton's tiles are powers
# of two; 64 keeps a local layer's band (w = 64 each side) to 3 key tiles
# per query tile.
FLASH_BLOCK = 64
# The largest head the kernel takes. Heads are padded with zeros to a power
# of two of at least 16 (Triton's smallest matmul), which leaves the scores
# and the outputs' real columns as they are.
FLASH_MAX_HEAD = 256

_LOG2_E = math.log2(math.e)
# A masked score: finite, so a query that sees no key gets a uniform
# average rather than NaN (only padding queries, whose outputs are unused).
_MASKED = -0.7 * float(np.finfo(np.float32).max)
# Segment ids of the tiles' padding: keys no query matches, queries that match no key.
_PAD_KEY, _PAD_QUERY = -2, -1


def flash_attention(q: Array, k: Array, v: Array, mask: Mask, rows: Array | None = None,
                    interpret: bool = False) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H], softmax(q·kᵀ/√H) over the keys each
  query may see (the description `mask`).

  rows [B, Q]: the queries are those rows' (indices into T); None: Q = T,
  every token. Rows of any length are padded to whole tiles here. Runs per
  device on its rows (sharded.per_device).
  """
  b, q_len, _, h = q.shape
  t = k.shape[1]
  scale = 1.0 / math.sqrt(h)
  window = mask.window
  band = window is not None and rows is None
  k_seg = mask.segments()
  q_seg = k_seg if rows is None else jnp.take_along_axis(k_seg, rows, axis=1)
  ids = [q_seg, k_seg]
  if window is not None:
    k_pos = jnp.broadcast_to(mask.row_positions(), (b, t)).astype(jnp.int32)
    ids += [k_pos if rows is None else jnp.take_along_axis(k_pos, rows, axis=1), k_pos]

  def run(q, k, v, q_seg, k_seg, q_pos=None, k_pos=None):   # This device's rows.
    q, q_seg, q_pos = _pad_to_tiles(q, q_seg, q_pos, _PAD_QUERY)
    k, k_seg, k_pos = _pad_to_tiles(k, k_seg, k_pos, _PAD_KEY)
    v = _pad_rows(v, k.shape[1], 0)
    q, k, v = (_pad_head(x) for x in (q, k, v))
    spans = tile_spans(q_seg, k_seg, window if band else None)
    out = _flash(q, k, v, q_seg, k_seg, q_pos, k_pos, *spans, scale, window, band, interpret)
    return out[:, :q_len, :, :h]

  return per_device(run, q, k, v, *ids)


def flash_keys(q_len: int, kv_len: int, window: int | None, rows: bool) -> float:
  """Keys per query the kernel computes at most: whole tiles, only the band's in a local layer
  (fewer where documents or padding let it skip more, `tile_spans`)."""
  if window is None or rows:
    return float(_whole_tiles(kv_len))
  return tiled_keys(_whole_tiles(q_len), _whole_tiles(kv_len), window, FLASH_BLOCK)


def kernel_name(kind: str, window: int | None, band: bool) -> str:
  """The name a pass's kernel carries in the compiled step: 'mlm_flash_fwd', '..._dkv_w64'.

  A banded kernel's name gives its window, so the step's FLOPs can be read
  from the compiled program (perf/hlo_cost.py).
  """
  return f'mlm_flash_{kind}' + (f'_w{window}' if band else '')


def _whole_tiles(length: int) -> int:
  return -(-length // FLASH_BLOCK) * FLASH_BLOCK


def _pad_rows(x: Array, length: int, fill) -> Array:
  pad = length - x.shape[1]
  if not pad:
    return x
  return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def _pad_head(x: Array) -> Array:
  """[..., H] -> [..., H'] with zeros, H' a power of two of at least 16."""
  h = x.shape[-1]
  padded = max(16, 1 << (h - 1).bit_length())
  return x if padded == h else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - h)])


def _pad_to_tiles(x: Array, seg: Array, pos: Array | None, pad_segment: int):
  """x [B, L, N, H] and its ids [B, L] padded to whole tiles; padding matches nothing real."""
  length = _whole_tiles(x.shape[1])
  pos = None if pos is None else _pad_rows(pos, length, 0)
  return _pad_rows(x, length, 0), _pad_rows(seg, length, pad_segment), pos


def tile_spans(q_seg: Array, k_seg: Array, band: int | None) -> tuple[Array, ...]:
  """The tiles each tile's loop visits: (key tiles of each query tile, first and one past the
  last, [B, Q/64] each; query tiles of each key tile, [B, T/64] each), int32.

  Tiles whose segment ids cannot meet are skipped: a query tile holding ids
  lo..hi visits the key tiles holding any id in lo..hi, taken from the first
  such tile to the last (a superset of the tiles it needs, whatever the ids;
  exactly them when ids do not decrease along a row, as packed documents'
  do). Padding and the tiles' own padding count as the largest id, so a row's
  real tokens skip its padding tiles. `band` (a window each side, queries at
  0..T-1): also only the key tiles within the window in index.
  """
  last_id = jnp.iinfo(jnp.int32).max
  def interval(seg: Array) -> tuple[Array, Array]:        # [B, L] -> [B, L/64] twice.
    order = jnp.where(seg > 0, seg, last_id).reshape(seg.shape[0], -1, FLASH_BLOCK)
    return jnp.min(order, axis=-1), jnp.max(order, axis=-1)
  (q_lo, q_hi), (k_lo, k_hi) = interval(q_seg), interval(k_seg)
  meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
  if band is not None:
    i = np.arange(meet.shape[1])[:, None] * FLASH_BLOCK     # First index of each tile.
    j = np.arange(meet.shape[2])[None, :] * FLASH_BLOCK
    meet = meet & ((j <= i + FLASH_BLOCK - 1 + band) & (j + FLASH_BLOCK - 1 >= i - band))

  def span(m: Array) -> tuple[Array, Array]:              # [B, X, Y] -> [B, X] twice.
    n = m.shape[-1]
    first = jnp.argmax(m, axis=-1)
    end = n - jnp.argmax(m[..., ::-1], axis=-1)
    some = jnp.any(m, axis=-1)
    return (jnp.where(some, first, 0).astype(jnp.int32),
            jnp.where(some, end, 0).astype(jnp.int32))
  return (*span(meet), *span(jnp.swapaxes(meet, 1, 2)))


def _scores(q: Array, k: Array, q_seg: Array, k_seg: Array, q_pos: Array | None,
            k_pos: Array | None, scale: float, window: int | None) -> Array:
  """[bq, bk] float32: q·kᵀ·scale in log2 units, masked."""
  s = _dot(q, k.T) * (_LOG2_E * scale)
  allowed = q_seg[:, None] == k_seg[None, :]
  if window is not None:
    allowed = allowed & (jnp.abs(q_pos[:, None] - k_pos[None, :]) <= window)
  return jnp.where(allowed, s, _MASKED)


def _dot(a: Array, b: Array) -> Array:
  """a [m, k] · b [k, n] -> [m, n] float32; float32 inputs in full precision (not TF32)."""
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _tiles(ref, tile: Array) -> Array:
  """Tile `tile` of a ref's first axis."""
  return ref[pl.ds(tile * FLASH_BLOCK, FLASH_BLOCK)]


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref,
                    first_ref, end_ref, o_ref, lse_ref, *, scale: float, window: int | None):
  """One query tile against the key tiles of its span: out and the log2-sum-exp."""
  tile = pl.program_id(0)
  q = q_ref[...]                                     # [bq, H]
  q_seg = q_seg_ref[...]
  q_pos = None if q_pos_ref is None else q_pos_ref[...]

  def body(j, carry):
    acc, top, total = carry
    s = _scores(q, _tiles(k_ref, j), q_seg, _tiles(k_seg_ref, j), q_pos,
                None if k_pos_ref is None else _tiles(k_pos_ref, j), scale, window)
    new_top = jnp.maximum(top, jnp.max(s, axis=1))
    correction = jnp.exp2(top - new_top)
    p = jnp.exp2(s - new_top[:, None])
    v = _tiles(v_ref, j)
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
    return acc, new_top, total * correction + jnp.sum(p, axis=1)

  start = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:1], -jnp.inf, jnp.float32),
           jnp.zeros(q.shape[:1], jnp.float32))
  acc, top, total = jax.lax.fori_loop(first_ref[tile], end_ref[tile], body, start)
  total = jnp.where(total > 0, total, 1.0)   # An empty span (no key to see): zeros, not NaN.
  o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
  lse_ref[...] = top + jnp.log2(total)


def _dkv_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref, first_ref,
                end_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale: float,
                window: int | None):
  """One key tile's dK and dV, over the query tiles of its span."""
  tile = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]                      # [bk, H]
  k_seg = k_seg_ref[...]
  k_pos = None if k_pos_ref is None else k_pos_ref[...]

  def body(i, carry):
    dk, dv = carry
    q, do = _tiles(q_ref, i), _tiles(do_ref, i)
    s = _scores(q, k, _tiles(q_seg_ref, i), k_seg,
                None if q_pos_ref is None else _tiles(q_pos_ref, i), k_pos, scale, window)
    p = jnp.exp2(s - _tiles(lse_ref, i)[:, None])    # [bq, bk]
    dv = dv + _dot(p.astype(do.dtype).T, do)
    dp = _dot(do, v.T)
    ds = p * (dp - _tiles(delta_ref, i)[:, None])
    return dk + _dot(ds.astype(q.dtype).T, q), dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(first_ref[tile], end_ref[tile], body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, q_pos_ref, k_pos_ref, first_ref,
               end_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale: float, window: int | None):
  """One query tile's dQ, over the key tiles of its span."""
  tile = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]                    # [bq, H]
  q_seg = q_seg_ref[...]
  q_pos = None if q_pos_ref is None else q_pos_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def body(j, dq):
    k, v = _tiles(k_ref, j), _tiles(v_ref, j)
    s = _scores(q, k, q_seg, _tiles(k_seg_ref, j), q_pos,
                None if k_pos_ref is None else _tiles(k_pos_ref, j), scale, window)
    p = jnp.exp2(s - lse[:, None])
    dp = _dot(do, v.T)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = jax.lax.fori_loop(first_ref[tile], end_ref[tile], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _specs(q_len: int, kv_len: int, h: int, tiled: str, positions: bool):
  """BlockSpecs over grid (tile, b, n) for q, k, v, q_seg, k_seg, q_pos, k_pos and the tiled
  side's spans (first, end).

  `tiled` ('q' or 'k') is the side cut into the grid's tiles; the other
  side is whole.
  """
  tile = lambda: pl.BlockSpec((None, FLASH_BLOCK, None, h), lambda i, b, n: (b, i, n, 0))
  whole = lambda length: pl.BlockSpec((None, length, None, h), lambda i, b, n: (b, 0, n, 0))
  ids_tile = lambda: pl.BlockSpec((None, FLASH_BLOCK), lambda i, b, n: (b, i))
  ids_whole = lambda length: pl.BlockSpec((None, length), lambda i, b, n: (b, 0))
  if tiled == 'q':
    q, kv, q_ids, k_ids = tile(), whole(kv_len), ids_tile(), ids_whole(kv_len)
  else:
    q, kv, q_ids, k_ids = whole(q_len), tile(), ids_whole(q_len), ids_tile()
  spans = pl.BlockSpec((None, (q_len if tiled == 'q' else kv_len) // FLASH_BLOCK),
                       lambda i, b, n: (b, 0))
  return [q, kv, kv, q_ids, k_ids, q_ids if positions else None, k_ids if positions else None,
          spans, spans]


def _per_query(length: int, tiled: bool):
  """BlockSpec of a [B, N, Q] float32 per-query figure (lse, delta)."""
  if tiled:
    return pl.BlockSpec((None, None, FLASH_BLOCK), lambda i, b, n: (b, n, i))
  return pl.BlockSpec((None, None, length), lambda i, b, n: (b, n, 0))


def _compiler_params(h: int):
  return plgpu.CompilerParams(num_warps=4 if h <= 64 else 8, num_stages=2)


def _forward(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, scale, window, band,
             interpret):
  b, q_len, n, h = q.shape
  kv_len = k.shape[1]
  out, lse = pl.pallas_call(
      functools.partial(_forward_kernel, scale=scale, window=window),
      grid=(q_len // FLASH_BLOCK, b, n),
      in_specs=_specs(q_len, kv_len, h, 'q', q_pos is not None),
      out_specs=[pl.BlockSpec((None, FLASH_BLOCK, None, h), lambda i, b, n: (b, i, n, 0)),
                 _per_query(q_len, tiled=True)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, n, q_len), jnp.float32)],
      compiler_params=_compiler_params(h), interpret=interpret,
      name=kernel_name('fwd', window, band),
  )(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13, 14))
def _flash(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, k_first, k_end, scale, window,
           band, interpret):
  return _forward(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, scale, window, band,
                  interpret)[0]


def _flash_fwd(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, k_first, k_end, scale,
               window, band, interpret):
  out, lse = _forward(q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, scale, window, band,
                      interpret)
  return out, (q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, k_first, k_end, out, lse)


def _flash_bwd(scale, window, band, interpret, residuals, d_out):
  q, k, v, q_seg, k_seg, q_pos, k_pos, q_first, q_end, k_first, k_end, out, lse = residuals
  b, q_len, n, h = q.shape
  kv_len = k.shape[1]
  delta = jnp.einsum('bqnh,bqnh->bnq', out.astype(jnp.float32), d_out.astype(jnp.float32))
  d_out = d_out.astype(q.dtype)
  ids = (q, k, v, q_seg, k_seg, q_pos, k_pos)
  per_query = (d_out, lse, delta)
  positions = q_pos is not None
  params = dict(compiler_params=_compiler_params(h), interpret=interpret)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, window=window),
      grid=(kv_len // FLASH_BLOCK, b, n),
      in_specs=_specs(q_len, kv_len, h, 'k', positions) + [
          pl.BlockSpec((None, q_len, None, h), lambda i, b, n: (b, 0, n, 0)),
          _per_query(q_len, tiled=False), _per_query(q_len, tiled=False)],
      out_specs=[pl.BlockSpec((None, FLASH_BLOCK, None, h), lambda i, b, n: (b, i, n, 0))] * 2,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      name=kernel_name('dkv', window, band), **params)(*ids, k_first, k_end, *per_query)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, window=window),
      grid=(q_len // FLASH_BLOCK, b, n),
      in_specs=_specs(q_len, kv_len, h, 'q', positions) + [
          pl.BlockSpec((None, FLASH_BLOCK, None, h), lambda i, b, n: (b, i, n, 0)),
          _per_query(q_len, tiled=True), _per_query(q_len, tiled=True)],
      out_specs=pl.BlockSpec((None, FLASH_BLOCK, None, h), lambda i, b, n: (b, i, n, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name=kernel_name('dq', window, band), **params)(*ids, q_first, q_end, *per_query)
  return dq, dk, dv, None, None, None, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
