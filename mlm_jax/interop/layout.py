"""What a Hugging Face checkpoint format is to the converter: its tensors and config.

One `Format` per architecture (hf.BERT, hf.ROBERTA, modernbert.FORMAT):
where each tensor of its state dict lives in our parameter tree and how it
is laid out there, and how its config.json maps onto our ModelConfig. hf.py
converts with whichever one config.model.variant (or config.json's
model_type) names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Tensor:
  hf_name: str
  path: tuple[str, ...]       # Where it lives in our params tree.
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]      # Ours, with the real (unpadded) vocabulary.
  transpose: bool = False     # A torch Linear weight: [out, in] vs our [in..., out...].
  # Leading rows the Hugging Face tensor has and ours lacks (RoBERTa's
  # position table: ids start after padding_idx). Dropped on import,
  # written back as zeros on export; hf_shape counts them.
  offset_rows: int = 0

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.offset_rows:
      x = np.concatenate([np.zeros((self.offset_rows, *x.shape[1:]), x.dtype), x])
    x = x.reshape(self.hf_shape[::-1]).T if self.transpose else x.reshape(self.hf_shape)
    return np.ascontiguousarray(x, np.float32)

  def from_hf(self, x: np.ndarray) -> np.ndarray:
    x = x[self.offset_rows:]
    return np.ascontiguousarray((x.T if self.transpose else x).reshape(self.shape), np.float32)


def layer_norm_tensors(hf_name: str, path: tuple[str, ...], width: int) -> list[Tensor]:
  """A torch LayerNorm's weight and bias as our LayerNorm's scale and bias [width]."""
  return [Tensor(f'{hf_name}.weight', (*path, 'scale'), (width,), (width,)),
          Tensor(f'{hf_name}.bias', (*path, 'bias'), (width,), (width,))]


def dense_tensors(hf_name: str, path: tuple[str, ...], in_shape: tuple[int, ...],
                  out_shape: tuple[int, ...]) -> list[Tensor]:
  """A torch Linear [out, in] (and its bias) as our kernel [*in_shape, *out_shape]."""
  fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
  return [Tensor(f'{hf_name}.weight', (*path, 'kernel'), (fan_out, fan_in),
                 (*in_shape, *out_shape), transpose=True),
          Tensor(f'{hf_name}.bias', (*path, 'bias'), (fan_out,), out_shape)]


def special_token_ids(specials: Any) -> dict[str, int]:
  """config.json's special-token ids from a tokenizer's Specials (every format writes these
  keys): [CLS] begins a sequence and [SEP] ends it, so they are bos and eos too."""
  return {'pad_token_id': specials.pad, 'bos_token_id': specials.cls,
          'eos_token_id': specials.sep, 'cls_token_id': specials.cls,
          'sep_token_id': specials.sep, 'mask_token_id': specials.mask}


def get_path(tree: Params, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def set_path(tree: Params, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


@dataclasses.dataclass(frozen=True)
class Format:
  """One Hugging Face masked-LM architecture, as the converter sees it."""

  name: str               # For messages: 'BERT', 'RoBERTa', 'ModernBERT'.
  variant: str            # Our config.model.variant.
  model_type: str         # config.json's model_type, as exports write it.
  architecture: str       # The ...ForMaskedLM class.
  base_model: str         # The encoder-only class, whose files hold no MLM head.
  # (ModelConfig, position_offset) -> every tensor, in state-dict order.
  layout: Callable[[Any, int], list[Tensor]]
  # A file's tensors under the ...ForMaskedLM names (base-model files, old names).
  canonical_names: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
  head_tensor: str        # Present exactly when a file has the MLM head.
  embedding_tensor: str   # The token embedding, which the decoder is tied to.
  decoder_tensor: str     # The decoder weight, a copy of the embedding where a file holds it.
  # (ModelConfig, Specials of the run's tokenizer) -> config.json.
  to_config: Callable[[Any, Any], dict[str, Any]]
  # config.json -> the ModelConfig fields it decides (checkpoint_fields in hf.py);
  # ValueError for what our encoder does not compute.
  fields: Callable[[dict[str, Any]], dict[str, Any]]
  input_names: tuple[str, ...]  # What its tokenizer gives the model.
  # Other config.json model_types read with this format (same tensors and config keys).
  also_reads: tuple[str, ...] = ()
  # The checkpoint's pad id -> rows its position table has before position 0
  # (RoBERTa: padding_idx + 1; None: the config gives no pad id).
  position_offset: Callable[[int | None], int] = lambda pad_id: 0

  @property
  def model_types(self) -> tuple[str, ...]:
    return (self.model_type, *self.also_reads)
