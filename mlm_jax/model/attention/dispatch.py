"""The call a layer makes: attention by the kernel `choice.choose` picks for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax

from mlm_jax.model.attention.blocked import banded_attention
from mlm_jax.model.attention.blocked import chunked_attention
from mlm_jax.model.attention.choice import choose
from mlm_jax.model.attention.cudnn import cudnn_attention
from mlm_jax.model.attention.dense import softmax_attention
from mlm_jax.model.attention.flash import flash_attention
from mlm_jax.model.attention.jax_xla import jax_xla_attention
from mlm_jax.model.attention.mask import Mask
from mlm_jax.model.attention.splash import splash_attention

if TYPE_CHECKING:  # model/config.py imports this package.
  from mlm_jax.model.config import ModelConfig

Array = jax.Array


def attend(cfg: ModelConfig, q: Array, k: Array, v: Array, mask: Mask, deterministic: bool,
           rows: Array | None = None, dropout_module=None) -> Array:
  """q [B, Q, N, H], k, v [B, T, N, H] -> [B, Q, N, H], by the kernel `choose` picks.

  rows [B, Q]: the queries are those rows' (the last block at the masked
  slots); None: Q = T. Called inside a module's compact method (its dropout
  is one): `dropout_module` is the module's dropout class (its ops.dropout;
  None: nn.Dropout). Only 'dense' and the banded 'blocked' apply attention
  dropout; `choose` sends a call with dropout to one of them.
  """
  rate = 0.0 if deterministic else cfg.attention_dropout_rate
  kernel, _ = choose(cfg, local=mask.window is not None, q_len=q.shape[1], kv_len=k.shape[1],
                     rows=rows is not None, contiguous=mask.contiguous,
                     documents=mask.documents is not None, dropout=rate > 0)
  if kernel == 'cudnn':
    return cudnn_attention(q, k, v, mask)
  if kernel == 'flash':  # On a CPU (tests) in Pallas's interpreter.
    return flash_attention(q, k, v, mask, rows, interpret=cfg.platform == 'cpu')
  if kernel == 'splash':
    return splash_attention(q, k, v, mask)
  drop = (lambda w: w) if rate == 0.0 else (
      lambda w: (dropout_module or nn.Dropout)(rate)(w, deterministic=False))
  if kernel == 'blocked':
    if mask.window is not None and rows is None:
      return banded_attention(q, k, v, mask, drop)
    return chunked_attention(q, k, v, mask, rows)
  allowed = mask.allowed(rows)
  if kernel == 'jax_xla':
    return jax_xla_attention(q, k, v, allowed)
  return softmax_attention(q, k, v, allowed, drop)
