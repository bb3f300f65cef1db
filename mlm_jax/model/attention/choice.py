"""Which kernel each attention call gets, and why: the names config.model.attention takes.

  'dense'    ours (dense.py): softmax over a dense [B, Q, T] mask built from
             the description; with 'blocked', the only kernel with dropout on
             the attention probabilities
  'jax_xla'  jax.nn.dot_product_attention(implementation='xla') (jax_xla.py),
             same dense mask
  'cudnn'    cuDNN's fused flash attention (cudnn.py; NVIDIA GPUs, 16-bit):
             row lengths; it takes no document ids and no two-sided window
  'flash'    our Pallas flash attention (flash.py; NVIDIA GPUs, and CPUs in
             Pallas's interpreter for tests): any description (a two-sided
             window, documents, DropToken's positions, chosen rows), and
             in a local layer only the key tiles of the band
  'splash'   Pallas splash attention (splash.py; TPUs): a static local or
             full mask and segment ids (documents, padding), under shard_map
  'blocked'  XLA in memory and time O(T·w) for a window w (blocked.py): each
             block of queries against its own and its two neighbouring
             blocks of keys; a layer without a window (or queries at chosen
             rows) runs over query chunks instead, whose memory grows with
             T·chunk, not T²
  'auto'     the fastest that can train the config on the platform the step
             is compiled for (`requested`)

A kernel that cannot take a call's mask (cuDNN and document ids or a window, splash and
DropToken's positions, a row length that does not divide into splash's
blocks) hands it to another, for a reason `choose` states; the builder logs
every choice for the training shapes (`describe`). The choice depends on
static properties only (platform, dtype, shapes), so every call of a
compiled step keeps its kernel.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
from absl import logging

from mlm_jax.errors import require
from mlm_jax.model.attention.flash import FLASH_MAX_HEAD
from mlm_jax.model.attention.splash import SPLASH_BLOCK

if TYPE_CHECKING:  # model/config.py imports this module's names.
  from mlm_jax.model.config import ModelConfig

# config.model.attention's values (model/config.py checks them).
ATTENTIONS = ('auto', 'dense', 'jax_xla', 'cudnn', 'flash', 'splash', 'blocked')
# The kernels without dropout on the attention probabilities.
NO_DROPOUT_ATTENTIONS = ('jax_xla', 'cudnn', 'flash', 'splash')
# The kernels that exist on one platform only ('flash' also runs on CPUs, in
# Pallas's interpreter: slowly, for tests).
PLATFORM_ATTENTIONS = {'cudnn': 'gpu', 'splash': 'tpu', 'flash': 'gpu'}
# Names runs were saved with before the kernels were renamed: a saved run's
# config (or a fine-tuned model's record) is read with the new name
# (`current_name`); a config given today is refused, naming the new one.
RENAMED_ATTENTIONS = {'xla': 'dense', 'dot_product': 'jax_xla'}

# 'auto' on TPUs: a global layer without document ids on shorter rows stays
# with XLA's fused attention (BERT's T=128 and 512). Rows of this length or
# more that do not divide into splash's tiles run padded to whole tiles (an
# eighth more at most); shorter ones go to another kernel.
SPLASH_FROM = 1024
# The blocked kernel pays 3 key blocks per query block: below this many
# blocks per row, the dense mask costs no more.
MIN_BLOCKS = 4
# The chunked kernel only pays off when the dense scores would be this many
# elements per row and head (Q·T).
CHUNK_FROM = 1024 * 1024

_logged_renames: set[str] = set()


def current_name(name: str) -> str:
  """config.model.attention as named today: an old saved name (RENAMED_ATTENTIONS) is mapped,
  and logged once per process; any other name is returned as it is."""
  if name not in RENAMED_ATTENTIONS:
    return name
  new = RENAMED_ATTENTIONS[name]
  if name not in _logged_renames:
    _logged_renames.add(name)
    logging.info("config.model.attention=%r, saved before the kernels were renamed, is read "
                 "as %r (the same kernel).", name, new)
  return new


def requested(cfg: ModelConfig, local: bool) -> str:
  """The kernel config.model.attention asks for in a global or a local layer.

  'auto': with attention dropout, ours in a global layer and 'blocked' in a
  local one (the two with dropout); else splash attention on TPUs (`choose`
  keeps short global rows without documents on 'jax_xla'), in 16-bit on
  GPUs cuDNN's fused kernel for global layers (`choose` hands what it cannot
  take to 'flash') and our Pallas flash kernel for local ones, and 'blocked'
  on CPUs, which `choose` turns into ours over a dense
  mask where the scores are small (under CHUNK_FROM per row and head: the
  quick start's rows) and into query chunks above (faster on a CPU from
  rows of 2,048 tokens, docs/long_context.md).
  """
  if cfg.attention != 'auto':
    return cfg.attention
  if cfg.attention_dropout_rate > 0:
    return 'blocked' if local else 'dense'
  if cfg.platform == 'tpu':
    return 'splash'
  if cfg.platform == 'gpu' and jnp.dtype(cfg.dtype).itemsize == 2:
    return 'flash' if local else 'cudnn'
  return 'blocked' if local or cfg.platform == 'cpu' else 'dense'


def check_platform(cfg: ModelConfig) -> None:
  """ConfigError when config.model.attention names a kernel the step's platform lacks."""
  platform = PLATFORM_ATTENTIONS.get(cfg.attention)
  runs_on = (platform, 'cpu') if cfg.attention == 'flash' else (platform,)
  require(platform is None or cfg.platform in runs_on,
          f'config.model.attention={cfg.attention!r} runs on {platform} only and this step is '
          f"compiled for {cfg.platform}: set it to 'auto' (or 'blocked', 'dense').")
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
  why = ''
  if kernel == 'cudnn':
    if local:
      why = "cuDNN's fused kernel has no two-sided window"
    elif documents:
      why = "jax.nn.dot_product_attention's cuDNN path takes row lengths, not document ids"
    elif q_len % 2 or kv_len % 2:
      why = (f"cuDNN's fused kernel trains on even lengths only ({q_len} queries, {kv_len} "
             'keys)')
    if not why:
      return 'cudnn', ''
    kernel = 'flash'
  if kernel == 'flash':
    head_size = cfg.hidden_size // cfg.num_heads
    if head_size > FLASH_MAX_HEAD:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               _join(why, f'the flash kernel takes heads of up to '
                                     f'{FLASH_MAX_HEAD}, not {head_size}'))
    return 'flash', why
  if kernel == 'splash':
    if cfg.attention == 'auto' and not local and not documents and kv_len < SPLASH_FROM:
      return 'jax_xla', ''
    if rows:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "splash attention's masks are static and these queries are "
                               'the masked slots')
    if local and not contiguous:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               "DropToken moved the tokens: splash's static window would "
                               'not follow their positions')
    if (q_len % SPLASH_BLOCK or kv_len % SPLASH_BLOCK) and kv_len < SPLASH_FROM:
      return _blocked_or_dense(window, q_len, kv_len, rows, dropout,
                               f'{q_len} tokens do not divide into splash blocks of '
                               f'{SPLASH_BLOCK}, and rows under {SPLASH_FROM} are not padded '
                               'to them')
    return 'splash', ''
  if kernel == 'blocked':
    return _blocked_or_dense(window, q_len, kv_len, rows, dropout, '')
  return kernel, ''


def _blocked_or_dense(window: int | None, q_len: int, kv_len: int, rows: bool, dropout: bool,
                      why: str) -> tuple[str, str]:
  """'blocked' where it saves memory over a dense mask, else 'dense'; with the reason."""
  if window is not None and not rows:
    if kv_len >= MIN_BLOCKS * window:
      return 'blocked', why
    return 'dense', _join(why, f'the window of {window} each side covers most of '
                        f'{kv_len} tokens: dense')
  if dropout:
    return 'dense', _join(why, 'the chunked kernel has no attention dropout')
  if q_len * kv_len >= CHUNK_FROM:
    return 'blocked', why
  return 'dense', _join(why, f'{q_len}x{kv_len} scores are small: dense')


def _join(*reasons: str) -> str:
  return '; '.join(r for r in reasons if r)


# What the log says each kernel is, after its name ('blocked': `_what_it_is`).
NAMES = {'dense': 'ours, softmax over a dense mask',
         'jax_xla': "jax.nn.dot_product_attention(implementation='xla')",
         'cudnn': "cuDNN's fused flash attention, row lengths",
         'flash': 'Pallas flash attention, segment ids',
         'splash': 'Pallas splash attention, segment ids',
         'blocked': 'XLA, banded or in query chunks'}


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
  rows: bool = False   # The queries are chosen rows (the last block's), not every token.


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
                    cfg.local_attention // 2 if local else None, num_rows, t, rows=True))
  return out


def is_local(cfg: ModelConfig, layer: int) -> bool:
  """Whether `layer` attends within a window (ModernBERT's local layers)."""
  return cfg.variant == 'modern' and layer % cfg.global_attn_every_n_layers != 0


def _span(layers: list[int]) -> str:
  return ', '.join(map(str, layers)) if len(layers) <= 4 else (
      f'{layers[0]}, {layers[1]}, ..., {layers[-1]} ({len(layers)})')


def _what_it_is(c: Choice) -> str:
  if c.kernel == 'blocked':
    return 'banded XLA' if c.window is not None and not c.rows else 'XLA in query chunks'
  if c.kernel == 'flash' and c.window is not None and not c.rows:
    return NAMES['flash'] + ", the window's band of tiles"
  return NAMES[c.kernel]


def describe(cfg: ModelConfig, seq_len: int, num_rows: int) -> str:
  """One line per kind of attention call of the train step: its kernel's name (a value of
  config.model.attention), what that kernel is, and why it was chosen when it was not asked for.
  """
  window = (f', window {cfg.local_attention // 2} each side' if cfg.variant == 'modern' else '')
  head = (f'documents {"apart" if cfg.document_mask else "not kept apart"}'
          f'{", positions restart at each document" if cfg.restart_positions else ""}{window}')
  lines = [head]
  for c in plan(cfg, seq_len, num_rows):
    notes = [_what_it_is(c)]
    if c.kernel == 'dense' and cfg.attention_dropout_rate > 0:
      notes[0] += f', attention dropout {cfg.attention_dropout_rate}'
    lines.append(f"{c.what}: {c.kernel} ({'; '.join(notes + ([c.why] if c.why else []))})")
  return '; '.join(lines)
