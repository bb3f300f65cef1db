"""Attention from a mask description, by the best kernel the platform has.

A model never builds a [B, T, T] mask to say what each query may see: it
describes the mask (`Mask`) and calls `attend`, which runs the kernel the
choice gives that call for the platform the step is compiled for.

  mask.py      the description: real tokens, document ids, the window
  choice.py    which kernel each call gets and why (`choose`, `plan`,
               `describe`); the names config.model.attention takes
  dispatch.py  `attend`, the call a layer makes
  dense.py     'dense': ours, softmax over a dense mask (with dropout)
  jax_xla.py   'jax_xla': jax.nn.dot_product_attention's XLA path
  cudnn.py     'cudnn': cuDNN's fused flash attention (NVIDIA GPUs)
  flash.py     'flash': our Pallas flash attention (NVIDIA GPUs): windows, documents
  splash.py    'splash': Pallas splash attention (TPUs)
  blocked.py   'blocked': banded XLA for local layers, query chunks for others
  sharded.py   Pallas kernels per device, on its rows of the batch

Shapes: see mlm_jax/model/config.py.
"""

from mlm_jax.model.attention.blocked import QUERY_CHUNK
from mlm_jax.model.attention.blocked import banded_attention
from mlm_jax.model.attention.blocked import chunked_attention
from mlm_jax.model.attention.choice import ATTENTIONS
from mlm_jax.model.attention.choice import NAMES
from mlm_jax.model.attention.choice import NO_DROPOUT_ATTENTIONS
from mlm_jax.model.attention.choice import PLATFORM_ATTENTIONS
from mlm_jax.model.attention.choice import RENAMED_ATTENTIONS
from mlm_jax.model.attention.choice import Choice
from mlm_jax.model.attention.choice import check_platform
from mlm_jax.model.attention.choice import choose
from mlm_jax.model.attention.choice import current_name
from mlm_jax.model.attention.choice import describe
from mlm_jax.model.attention.choice import is_local
from mlm_jax.model.attention.choice import plan
from mlm_jax.model.attention.choice import requested
from mlm_jax.model.attention.cudnn import cudnn_attention
from mlm_jax.model.attention.dense import softmax_attention
from mlm_jax.model.attention.flash import FLASH_BLOCK
from mlm_jax.model.attention.flash import flash_attention
from mlm_jax.model.attention.flash import flash_keys
from mlm_jax.model.attention.dispatch import attend
from mlm_jax.model.attention.jax_xla import jax_xla_attention
from mlm_jax.model.attention.mask import Mask
from mlm_jax.model.attention.splash import SPLASH_BLOCK
from mlm_jax.model.attention.splash import splash_attention
from mlm_jax.model.attention.splash import splash_keys

__all__ = ['ATTENTIONS', 'FLASH_BLOCK', 'NAMES', 'NO_DROPOUT_ATTENTIONS', 'PLATFORM_ATTENTIONS', 'QUERY_CHUNK',
           'RENAMED_ATTENTIONS', 'SPLASH_BLOCK', 'Choice', 'Mask', 'attend', 'banded_attention',
           'check_platform', 'choose', 'chunked_attention', 'cudnn_attention', 'current_name',
           'describe', 'flash_attention', 'flash_keys', 'is_local', 'jax_xla_attention', 'plan', 'requested',
           'softmax_attention', 'splash_attention', 'splash_keys']
