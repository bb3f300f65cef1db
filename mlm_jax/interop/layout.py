"""What a Hugging Face checkpoint format is to the converter: its tensors and config.

One `Format` per architecture (hf.BERT, modernbert.FORMAT): where each
tensor of its state dict lives in our parameter tree and how it is laid out
there, and how its config.json maps onto our ModelConfig. hf.py converts with
whichever one config.model.variant (or config.json's model_type) names.
"""

from __future__ import annotations

import dataclasses
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

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    x = x.reshape(self.hf_shape[::-1]).T if self.transpose else x.reshape(self.hf_shape)
    return np.ascontiguousarray(x, np.float32)

  def from_hf(self, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray((x.T if self.transpose else x).reshape(self.shape), np.float32)


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

  name: str               # For messages: 'BERT', 'ModernBERT'.
  variant: str            # Our config.model.variant.
  model_type: str         # config.json's model_type.
  architecture: str       # The ...ForMaskedLM class.
  base_model: str         # The encoder-only class, whose files hold no MLM head.
  layout: Callable[[Any], list[Tensor]]  # ModelConfig -> every tensor, in state-dict order.
  # A file's tensors under the ...ForMaskedLM names (base-model files, old names).
  canonical_names: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
  head_tensor: str        # Present exactly when a file has the MLM head.
  embedding_tensor: str   # The token embedding, which the decoder is tied to.
  decoder_tensor: str     # The decoder weight, a copy of the embedding where a file holds it.
  to_config: Callable[[Any], dict[str, Any]]  # ModelConfig -> config.json.
  # (config.json, config.model, dtype) -> ModelConfig; refuses what we do not compute.
  from_config: Callable[[dict[str, Any], Any, Any], Any]
  input_names: tuple[str, ...]  # What its tokenizer gives the model.
