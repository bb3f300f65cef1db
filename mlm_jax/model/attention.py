"""Attention from a mask description, by the best kernel the platform has.

A model never builds a [B, T, T] mask to say what each query may see. It
describes the mask (`Mask`): which tokens are real (padding comes last in
every row), each token's document when packed documents are kept apart,
and, for a local layer, the window in positions of the original row. Each
kernel reads the description in its own form:

  'xla'          ours (softmax_attention) over a dense [B, Q, T] mask built
                 from the description; the only kernel besides 'blocked'
                 with dropout on the attention probabilities
  'dot_product'  jax.nn.dot_product_attention's XLA path, same dense mask
  'cudnn'        cuDNN's fused flash attention (NVIDIA GPUs, 16-bit): row
                 lengths; it takes no document ids and no two-sided window
  'splash'       Pallas splash attention (TPUs): a static local or full mask
                 and segment ids (documents, padding), under shard_map
  'blocked'      XLA, memory and time O(T·w) for a window w: each block of
                 queries against its own and its two neighbouring blocks of
                 keys; a layer without a window (or queries at chosen rows)
                 runs over query chunks instead, whose memory grows with
                 T·chunk, not T²

config.model.attention names the kernel, or 'auto' for the fastest that can
train the config on the platform the step is compiled for (`requested`). A
kernel that cannot take a call's mask (cuDNN and document ids, splash and
DropToken's positions, a row length that does not divide into splash's
blocks) hands it to another, for a reason `choose` states; the builder logs
every choice for the training shapes (`describe`). Shapes: see
mlm_jax/model/config.py.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.config_check import require
from mlm_jax.model.config import PLATFORM_ATTENTIONS
from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.runtime import sharding

# Queries per chunk of the chunked kernel (a layer without a window, or
# queries at chosen rows, under 'blocked').
QUERY_CHUNK = 512
# Splash attention's tiles: rows must divide into them.
SPLASH_BLOCK = 128
# 'auto' on TPUs: a global layer without document ids on shorter rows stays
# with XLA's fused attention (BERT's T=128 and 512).
SPLASH_FROM = 1024
# The blocked kernel pays 3 key blocks per query block: below this many
# blocks per row, the dense mask costs no more.
MIN_BLOCKS = 4
# The chunked kernel only pays off when the dense scores would be this many
# elements per row and head (Q·T).
CHUNK_FROM = 1024 * 1024


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


def _take(x: Array, rows: Array) -> Array:
  """x [B or 1, T] at rows [B, Q] -> [B, Q]."""
  return jnp.take_along_axis(jnp.broadcast_to(x, (rows.shape[0], x.shape[1])), rows, axis=1)


# ---------------------------------------------------------------------------
# Which kernel.


def requested(cfg: ModelConfig, local: bool) -> str:
  """The kernel config.model.attention asks for in a global or a local layer.

  'auto': with attention dropout, ours in a global layer and 'blocked' in a
  local one (the two with dropout); else splash attention on TPUs (`choose`
  keeps short global rows without documents on 'dot_product'), cuDNN's
  fused kernel in 16-bit on GPUs for global layers and 'blocked' for local
  ones, and 'blocked' on CPUs, which `choose` turns into ours over a dense
  mask where the scores are small (under CHUNK_FROM per row and head: the
  quick start's rows) and into query chunks above (faster on a CPU from
  rows of 2,048 tokens, docs/long_context.md).
  """
  if cfg.attention != 'auto':
    return cfg.attention
  if cfg.attention_dropout_rate > 0:
    return 'blocked' if local else 'xla'
  if cfg.platform == 'tpu':
    return 'splash'
  if (cfg.platform == 'gpu' and not local
      and jnp.dtype(cfg.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))):
    return 'cudnn'
  return 'blocked' if local or cfg.platform == 'cpu' else 'xla'


def check_platform(cfg: ModelConfig) -> None:
  """ConfigError when config.model.attention names a kernel the step's platform lacks."""
  platform = PLATFORM_ATTENTIONS.get(cfg.attention)
  require(platform in (None, cfg.platform),
          f'config.model.attention={cfg.attention!r} runs on {platform} only and this step is '
          f"compiled for {cfg.platform}: set it to 'auto' (or 'blocked', 'xla').")
  require(cfg.attention != 'cudnn' or jnp.dtype(cfg.dtype).itemsize == 2,
          "config.model.attention='cudnn' needs 16-bit compute: set config.model.dtype to "
          "'bfloat16' (or attention to 'auto').")


def choose(cfg: ModelConfig, *, local: bool, q_len: int, kv_len: int, rows: bool,
           contiguous: bool, documents: bool, dropout: bool) -> tuple[str, str]:
  """(kernel, why) for one attention call of these static properties.

  q_len, kv_len: queries and keys per row; rows: the queries are chosen rows
  (the last block at the masked slots), not every token; contiguous: no
  token was dropped (positions are 0..T-1); documents: document ids are
  given; dropout: dropout on the probabilities is applied in this call.
  `why` is '' when the requested kernel takes the call as it is.
  """
  kernel = requested(cfg, local)
  window = cfg.local_attention // 2 if local else None
  if kernel == 'cudnn':
    if local:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "cuDNN's fused kernel has no two-sided window")
    if documents:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "jax.nn.dot_product_attention's cuDNN path takes row lengths, "
                               'not document ids')
    if q_len % 2 or kv_len % 2:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               f"cuDNN's fused kernel trains on even lengths only ({q_len} "
                               f'queries, {kv_len} keys)')
    return 'cudnn', ''
  if kernel == 'splash':
    if cfg.attention == 'auto' and not local and not documents and kv_len < SPLASH_FROM:
      return 'dot_product', ''
    if rows:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "splash attention's masks are static and these queries are "
                               'the masked slots')
    if local and not contiguous:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "DropToken moved the tokens: splash's static window would "
                               'not follow their positions')
    if q_len % SPLASH_BLOCK or kv_len % SPLASH_BLOCK:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               f'{q_len} tokens do not divide into splash blocks of '
                               f'{SPLASH_BLOCK}')
    return 'splash', ''
  if kernel == 'blocked':
    return _blocked_or_dense(window, q_len, kv_len, rows, dropout, '')
  return kernel, ''


def _blocked_or_dense(window: int | None, q_len: int, kv_len: int, rows: bool, dropout: bool,
                      why: str) -> tuple[str, str]:
  """'blocked' where it saves memory over a dense mask, else 'xla'; with the reason."""
  if window is not None and not rows:
    if kv_len >= MIN_BLOCKS * window:
      return 'blocked', why
    return 'xla', _join(why, f'the window of {window} each side covers most of '
                        f'{kv_len} tokens: dense')
  if dropout:
    return 'xla', _join(why, 'the chunked kernel has no attention dropout')
  if q_len * kv_len >= CHUNK_FROM:
    return 'blocked', why
  return 'xla', _join(why, f'{q_len}x{kv_len} scores are small: dense')


def _join(*reasons: str) -> str:
  return '; '.join(r for r in reasons if r)


# ---------------------------------------------------------------------------
# The kernels.


def softmax_attention(q: Array, k: Array, v: Array, key_mask: Array,
                      dropout=lambda w: w) -> Array:
  """softmax(q·kᵀ/√H, keys masked)·v for q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H].

  Q = T, or fewer queries (the last block at the masked slots only).
  key_mask: [B, T], the keys every query may see, or [B, Q, T], per query
  (e.g. a sliding window).

  The queries are scaled (not the [B, N, T, T] scores), masked keys get a
  large negative bias, and the unnormalised weights exp(s - max s) meet v
  before the division by their sum: one pass less over the scores than
  softmax-then-product, in both directions. `dropout` acts on those weights,
  which is dropout on the probabilities (it commutes with the division).
  The max is a constant to differentiation (softmax does not depend on it).
  Scores, weights and sums are float32 whatever the compute dtype.
  """
  scores = jnp.einsum('bqnh,bknh->bnqk', q * (1.0 / math.sqrt(q.shape[-1])), k)
  bias = jnp.where(key_mask, 0.0, -1e9)
  bias = bias[:, None, None, :] if key_mask.ndim == 2 else bias[:, None]  # [B, 1, 1|Q, T]
  scores = scores.astype(jnp.float32) + bias
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  total = jnp.swapaxes(jnp.sum(weights, axis=-1), 1, 2)[..., None]       # [B, Q, N, 1]
  out = jnp.einsum('bnqk,bknh->bqnh', dropout(weights).astype(v.dtype), v)
  return (out.astype(jnp.float32) / total).astype(v.dtype)


def banded_attention(q: Array, k: Array, v: Array, mask: Mask, dropout=lambda w: w) -> Array:
  """Local attention in O(T·w): q, k, v [B, T, N, H] -> [B, T, N, H], mask.window = w.

  The row is cut into blocks of C = w tokens (the last one padded); block i's
  queries meet the keys of blocks i-1, i and i+1, which hold every key at
  most w positions away (DropToken only brings tokens closer in index than
  in position). Within those 3C keys the description decides, as in
  softmax_attention (same scaling, float32 scores, dropout on the weights).
  """
  b, t, n, h = q.shape
  c = min(mask.window, t)
  nb = -(-t // c)
  pad = nb * c - t

  def blocks(x: Array, fill) -> Array:        # [B, T, ...] -> [B, nb, C, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(x.shape[0], nb, c, *x.shape[2:])

  def neighbours(x: Array, fill) -> Array:    # [B, nb, C, ...] -> [B, nb, 3C, ...]
    x = jnp.pad(x, [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

  far = np.iinfo(np.int32).max // 4  # Outside every window.
  if mask.positions is None:          # Constants of the program.
    index = np.concatenate([np.arange(t), np.full(pad, far)])
    query_pos = index.reshape(1, nb, c)
    padded = np.pad(query_pos, [(0, 0), (1, 1), (0, 0)], constant_values=far)
    key_pos = np.concatenate([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], axis=2)
  else:
    positions = mask.positions.astype(jnp.int32)
    query_pos = blocks(positions, far)
    key_pos = neighbours(query_pos, far)
  allowed = jnp.abs(query_pos[..., :, None] - key_pos[..., None, :]) <= mask.window
  allowed = allowed & neighbours(blocks(mask.valid, False), False)[:, :, None, :]
  if mask.documents is not None:
    docs = blocks(mask.documents, -1)
    allowed = allowed & (docs[..., :, None] == neighbours(docs, -2)[..., None, :])
  # allowed: [B, nb, C, 3C]
  qb = blocks(q * (1.0 / math.sqrt(h)), 0)
  kb, vb = (neighbours(blocks(x, 0), 0) for x in (k, v))
  scores = jnp.einsum('bxqnh,bxknh->bxnqk', qb, kb).astype(jnp.float32)
  scores = scores + jnp.where(allowed, 0.0, -1e9)[:, :, None]
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  total = jnp.moveaxis(jnp.sum(weights, axis=-1), 2, 3)[..., None]      # [B, nb, C, N, 1]
  out = jnp.einsum('bxnqk,bxknh->bxqnh', dropout(weights).astype(v.dtype), vb)
  out = (out.astype(jnp.float32) / total).astype(v.dtype)
  return out.reshape(b, nb * c, n, h)[:, :t]


def chunked_attention(q: Array, k: Array, v: Array, mask: Mask, rows: Array | None,
                      chunk: int = QUERY_CHUNK) -> Array:
  """q [B, Q, N, H] in chunks of `chunk` queries, each dense over all T keys -> [B, Q, N, H].

  One chunk at a time (lax.map), each recomputed in the backward pass
  (jax.checkpoint): memory grows with chunk·T, not Q·T. rows [B, Q]: the
  queries' indices into T (None: Q = T, every token).
  """
  b, q_len, n, h = q.shape
  index = jnp.broadcast_to(jnp.arange(q_len)[None], (b, q_len)) if rows is None else rows
  nc = -(-q_len // chunk)
  pad = nc * chunk - q_len
  q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
  index = jnp.pad(index, [(0, 0), (0, pad)])   # Padding queries read row 0; dropped below.

  @jax.checkpoint
  def one(args):
    q_c, index_c = args                           # [B, chunk, N, H], [B, chunk]
    return softmax_attention(q_c, k, v, mask.allowed(index_c))

  chunks = (jnp.moveaxis(q.reshape(b, nc, chunk, n, h), 1, 0),
            jnp.moveaxis(index.reshape(b, nc, chunk), 1, 0))
  out = jax.lax.map(one, chunks)                  # [nc, B, chunk, N, H]
  return jnp.moveaxis(out, 0, 1).reshape(b, nc * chunk, n, h)[:, :q_len]


def splash_attention(q: Array, k: Array, v: Array, mask: Mask,
                     interpret: bool = False) -> Array:
  """Pallas splash attention (TPUs): q, k, v [B, T, N, H] -> [B, T, N, H].

  A static LocalMask of mask.window each side (or a full mask) and segment
  ids (mask.segments(): documents, padding apart). Traced on a mesh (the
  step: sharding.traced_on) the kernel runs per device under shard_map, on
  that device's rows (the mesh axes of the 'batch' rule; heads are not
  split). `interpret` runs the kernel in Pallas's interpreter (any platform;
  for tests).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  b, t, n, h = q.shape
  shape = (t, t)
  base = (splash.LocalMask(shape, (mask.window, mask.window), 0) if mask.window is not None
          else splash.FullMask(shape))
  blocks = splash.BlockSizes(
      block_q=SPLASH_BLOCK, block_kv=SPLASH_BLOCK, block_kv_compute=SPLASH_BLOCK,
      block_q_dkv=SPLASH_BLOCK, block_kv_dkv=SPLASH_BLOCK, block_kv_dkv_compute=SPLASH_BLOCK,
      block_q_dq=SPLASH_BLOCK, block_kv_dq=SPLASH_BLOCK)
  kernel = splash.make_splash_mha(splash.MultiHeadMask([base] * n), head_shards=1,
                                  q_seq_shards=1, block_sizes=blocks, interpret=interpret)

  def run(q, k, v, segments):                     # This device's rows, [b, T, N, H].
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [b, N, T, H], as the kernel takes them
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s))
    out = jax.vmap(one)(heads_first(q * (1.0 / math.sqrt(h))).astype(k.dtype),
                        heads_first(k), heads_first(v), segments)
    return jnp.swapaxes(out, 1, 2)

  segments = mask.segments()
  mesh = jax.sharding.get_abstract_mesh()
  spec = nn.logical_to_mesh_axes(('batch',), sharding.LOGICAL_RULES)  # The batch's mesh axes.
  # Unsplit where no sharding applies (one device, or the one-row batch that
  # only traces the parameters' shapes).
  if mesh.empty or b % mesh.size:
    return run(q, k, v, segments)
  return jax.shard_map(run, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec,
                       check_vma=False)(q, k, v, segments)


# ---------------------------------------------------------------------------
# The call a layer makes.


def attend(cfg: ModelConfig, q: Array, k: Array, v: Array, mask: Mask, deterministic: bool,
           rows: Array | None = None, dropout_module=None) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H], by the kernel `choose` picks.

  rows [B, Q]: the queries are those rows' (the last block at the masked
  slots); None: Q = T. Called inside a module's compact method (its dropout
  is one): `dropout_module` is the module's dropout class (its ops.dropout;
  None: nn.Dropout). Only 'xla' and the banded 'blocked' apply attention
  dropout; `choose` sends a call with dropout to one of them.
  """
  rate = 0.0 if deterministic else cfg.attention_dropout_rate
  kernel, _ = choose(cfg, local=mask.window is not None, q_len=q.shape[1], kv_len=k.shape[1],
                     rows=rows is not None, contiguous=mask.contiguous,
                     documents=mask.documents is not None, dropout=rate > 0)
  if kernel == 'cudnn':
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=mask.lengths(),
                                        implementation='cudnn')
  if kernel == 'splash':
    return splash_attention(q, k, v, mask)
  drop = (lambda w: w) if rate == 0.0 else (
      lambda w: (dropout_module or nn.Dropout)(rate)(w, deterministic=False))
  if kernel == 'blocked':
    if mask.window is not None and rows is None:
      return banded_attention(q, k, v, mask, drop)
    return chunked_attention(q, k, v, mask, rows)
  allowed = mask.allowed(rows)
  if kernel == 'dot_product':
    dense = allowed[:, None, None, :] if allowed.ndim == 2 else allowed[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation='xla')
  return softmax_attention(q, k, v, allowed, drop)


# ---------------------------------------------------------------------------
# What the log says.

NAMES = {'xla': 'XLA, our formulation over a dense mask',
         'dot_product': "XLA, jax.nn.dot_product_attention(implementation='xla')",
         'cudnn': "cuDNN's fused flash attention (row lengths)",
         'splash': 'Pallas splash attention (segment ids)',
         'blocked': 'blocked XLA'}


@dataclasses.dataclass(frozen=True)
class Choice:
  """The kernel of one kind of attention call in the train step."""

  what: str      # e.g. 'global layers 0, 3', 'last block (layer 3) at the 20 masked slots'
  kernel: str
  why: str
  layers: tuple[int, ...]
  window: int | None   # Keys each side of a query; None: the whole row.
  q_len: int           # Queries and keys per row.
  kv_len: int


def plan(cfg: ModelConfig, seq_len: int, num_rows: int, training: bool = True
         ) -> list[Choice]:
  """The kernel of every kind of attention call of a train step on rows of seq_len tokens.

  num_rows: the rows the last block computes (the masked slots, plus [CLS]
  with a sentence-pair head). DropToken shortens the rows the encoder sees.
  """
  t = seq_len
  dropped = cfg.drop_token_rate > 0 and training
  if dropped:
    p = num_rows - (1 if cfg.sentence_pair_head else 0)
    t = seq_len - int(round(cfg.drop_token_rate * (seq_len - p)))
  dropout = training and cfg.attention_dropout_rate > 0
  kinds: dict[bool, list[int]] = {False: [], True: []}
  for layer in range(cfg.num_layers - 1):
    kinds[is_local(cfg, layer)].append(layer)
  out = []
  for local, layers in kinds.items():
    if layers:
      kernel, why = choose(cfg, local=local, q_len=t, kv_len=t, rows=False,
                           contiguous=not dropped, documents=cfg.document_mask, dropout=dropout)
      what = f"{'local' if local else 'global'} layers {_span(layers)}"
      out.append(Choice(what, kernel, why, tuple(layers),
                        cfg.local_attention // 2 if local else None, t, t))
  last = cfg.num_layers - 1
  kernel, why = choose(cfg, local=is_local(cfg, last), q_len=num_rows, kv_len=t, rows=True,
                       contiguous=not dropped, documents=cfg.document_mask, dropout=dropout)
  local = is_local(cfg, last)
  out.append(Choice(f"last block (layer {last}, {'local' if local else 'global'}) at its "
                    f'{num_rows} output rows', kernel, why, (last,),
                    cfg.local_attention // 2 if local else None, num_rows, t))
  return out


def splash_keys(q_len: int, kv_len: int, window: int | None) -> float:
  """Keys per query that splash attention computes: whole tiles, the masked ones skipped.

  A query tile of SPLASH_BLOCK rows computes every key tile its window
  touches (the whole row without a window).
  """
  if window is None:
    return float(kv_len)
  tiles = 0
  for i in range(q_len // SPLASH_BLOCK):
    first = max(0, i * SPLASH_BLOCK - window) // SPLASH_BLOCK
    last = min(kv_len - 1, (i + 1) * SPLASH_BLOCK - 1 + window) // SPLASH_BLOCK
    tiles += last - first + 1
  return tiles * SPLASH_BLOCK * SPLASH_BLOCK / q_len


def is_local(cfg: ModelConfig, layer: int) -> bool:
  """Whether `layer` attends within a window (ModernBERT's local layers)."""
  return cfg.variant == 'modern' and layer % cfg.global_attn_every_n_layers != 0


def _span(layers: list[int]) -> str:
  return ', '.join(map(str, layers)) if len(layers) <= 4 else (
      f'{layers[0]}, {layers[1]}, ..., {layers[-1]} ({len(layers)})')


def describe(cfg: ModelConfig, seq_len: int, num_rows: int) -> str:
  """One line per kind of attention call of the train step: its kernel, and why."""
  window = (f', window {cfg.local_attention // 2} each side' if cfg.variant == 'modern' else '')
  head = (f'documents {"apart" if cfg.document_mask else "not kept apart"}'
          f'{", positions restart at each document" if cfg.restart_positions else ""}{window}')
  lines = [head]
  for c in plan(cfg, seq_len, num_rows):
    line = f'{c.what}: {NAMES[c.kernel]}'
    if c.kernel == 'xla' and cfg.attention_dropout_rate > 0:
      line += f' (attention dropout {cfg.attention_dropout_rate})'
    lines.append(line + (f' ({c.why})' if c.why else ''))
  return '; '.join(lines)
