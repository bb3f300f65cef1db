"""Frozen encoder features for probing: every layer's output, mean-pooled per text.

Texts are encoded as fine-tuning's single texts are ([CLS] pieces [SEP],
cut to the run's T), run through the encoder with `all_layers` (the embeddings' output,
then each block's), and averaged over each text's real tokens: [L + 1, N, d].
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.finetuning import data as data_lib

_BATCH = 64


def pieces(tokenizer: tok_lib.Tokenizer, texts: list[str]) -> list[list[int]]:
  """The ids of `texts` as corpus text (a special token's spelling in them is plain text)."""
  return tokenizer.encode_documents([tok_lib.sanitize(t) for t in texts])


def encode(tokenizer: tok_lib.Tokenizer, texts: list[str],
           seq_len: int) -> tuple[dict[str, np.ndarray], int]:
  """(model inputs [N, T] for `texts` (`pieces`), how many texts were cut to fit T).

  Rows are framed with the tokenizer's own special ids.
  """
  ids, segments, mask, truncated = data_lib.sequence_rows(
      [[p] for p in pieces(tokenizer, texts)], seq_len, data_lib.RowFormat(tokenizer.specials))
  return {'input_ids': ids, 'segment_ids': segments, 'attention_mask': mask}, truncated


@functools.cache
def _pooled_fn(model_cfg: model_lib.ModelConfig):
  """jit(params, batch) -> [L + 1, B, d], compiled once per model shape."""
  model = model_lib.mlm_model(model_cfg)

  @jax.jit
  def pooled(params, batch):
    layers = model.apply({'params': params}, batch, method=model_lib.BertForMLM.all_layers)
    mask = batch['attention_mask'].astype(jnp.float32)[None, :, :, None]
    return jnp.sum(layers.astype(jnp.float32) * mask, axis=2) / jnp.sum(mask, axis=2)

  return pooled


def mean_pooled_layers(model_cfg: model_lib.ModelConfig, params: Any,
                       inputs: dict[str, np.ndarray]) -> np.ndarray:
  """[L + 1, N, d] float32: each layer's output averaged over each row's real tokens."""
  pooled = _pooled_fn(model_cfg)
  n = len(inputs['input_ids'])
  out = []
  for start in range(0, n, _BATCH):
    batch = {k: v[start:start + _BATCH] for k, v in inputs.items()}
    short = _BATCH - len(batch['input_ids'])
    if short:  # One compiled shape: pad the last batch with copies of its first row.
      batch = {k: np.concatenate([v, np.repeat(v[:1], short, axis=0)]) for k, v in batch.items()}
    out.append(np.asarray(pooled(params, batch))[:, :_BATCH - short])
  return np.concatenate(out, axis=1)


def random_params(model_cfg: model_lib.ModelConfig, seed: int) -> Any:
  """A freshly initialised model of the same shape (the baseline a run is compared with)."""
  model = model_lib.mlm_model(model_cfg)
  example = {'input_ids': np.zeros((1, 8), np.int32), 'segment_ids': np.zeros((1, 8), np.int32),
             'attention_mask': np.ones((1, 8), np.int32)}
  variables = jax.jit(lambda rng: model.init(rng, example, deterministic=True,
                                             method=model_lib.BertForMLM.all_layers))(
                                                 jax.random.PRNGKey(seed))
  return jax.tree_util.tree_map(np.asarray, nn.unbox(variables['params']))
