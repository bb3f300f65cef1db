"""A masked LM to a Hugging Face model directory (python -m mlm_jax.export --workdir).

Writes, from the parameters, ModelConfig and tokenizer of a masked LM:

  OUT/config.json             the config of the model's architecture
                              (export_format): BertForMaskedLM,
                              DistilBertForMaskedLM (no token types),
                              RobertaForMaskedLM, XLMRobertaForMaskedLM or
                              CamembertForMaskedLM (by the tokenizer), or
                              ModernBertForMaskedLM, with the special-token ids of
                              the run's tokenizer and vocab_size its table's rows
  OUT/model.safetensors       the weights, vocabulary padding rows dropped
  OUT/tokenizer.json ...      a sentencepiece tokenizer as a tokenizers Unigram (plus
                              tokenizer_config.json and tokenizer.model); a Hugging
                              Face tokenizer (e.g. that of a published checkpoint the
                              run started from) as its own files, byte for byte
                              (sentencepiece.bpe.model included), with added words

so that `AutoModelForMaskedLM`, `AutoTokenizer` and `pipeline('fill-mask')`
load it offline. `corrected_params` applies `embedding_correction` to the
token embedding (export's --embedding_correction). Needs the interop extra
(safetensors, tokenizers), not torch.

A converter only: it takes arrays, configs and a tokenizer and reads no
training run. training/workdir.py's `export_hf` loads a run's checkpoint
and calls it, so that interop imports nothing from training.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import hf_tokenizer
from mlm_jax.data import masking
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import hf
from mlm_jax.interop import layout

Params = dict[str, Any]

# The Formats an export may write for each variant's model besides FORMATS[variant]: by
# the tokenizer class transformers must build for the run's tokenizer.
_BY_TOKENIZER_CLASS = {'XLMRobertaTokenizer': hf.XLM_ROBERTA,
                       'CamembertTokenizer': hf.CAMEMBERT}
# CamemBERT's vocabulary begins with fairseq's unused <s>NOTUSED and </s>NOTUSED.
_CAMEMBERT_TOKEN = '<s>NOTUSED'


def export_format(cfg: model_lib.ModelConfig, tokenizer: tok_lib.Tokenizer) -> layout.Format:
  """The architecture an export of this model and tokenizer writes.

  The model's own Format, except that a RoBERTa-encoder model with an XLM-R or
  CamemBERT tokenizer is written as XLMRobertaForMaskedLM or CamembertForMaskedLM:
  transformers builds those tokenizers (sentencepiece pieces) only for their
  model_type, and a RobertaTokenizer over their vocabulary splits text into
  characters. The tokenizer's kind is read from its tokenizer_config.json's
  tokenizer_class, or, where it names none (the hub's xlm-roberta-base has
  no tokenizer_config.json), from its vocabulary: a sentencepiece (Unigram)
  one is XLM-R's, or CamemBERT's where it holds <s>NOTUSED.
  """
  own = hf.model_format(cfg)
  if own is not hf.ROBERTA or not isinstance(tokenizer, hf_tokenizer.HFTokenizer):
    return own
  config = json.loads(tokenizer.files.get('tokenizer_config.json', b'{}'))
  named = config.get('tokenizer_class')
  if named:
    return _BY_TOKENIZER_CLASS.get(named.removesuffix('Fast'), own)
  if tokenizer.kind == 'unigram':
    camembert = _CAMEMBERT_TOKEN in tokenizer.files.get('tokenizer.json', b'').decode()
    return hf.CAMEMBERT if camembert else hf.XLM_ROBERTA
  return own


def embedding_correction(embedding: np.ndarray, *, select_rate: float, mask_prob: float,
                         random_prob: float, random_weights: np.ndarray,
                         mask_id: int) -> np.ndarray:
  """E <- (1-r) E + r (p_mask E[MASK] + p_keep E + p_rand Ebar), row by row.

  In pre-training, a position holding a token fed the encoder that token's
  row when not selected (1-r) and, when selected, [MASK]'s row (p_mask), its
  own (p_keep = 1 - p_mask - p_rand) or a random token's (p_rand; expected
  row Ebar). Each row becomes that expectation, so that unmasked input at
  inference resembles on average what the encoder was trained on. The MLM
  projection is tied to this table, so it changes too.

  embedding: [V, d], the rows of the real vocabulary (special ones included,
  corrected by the same formula). random_weights: [V] unnormalised weights of
  the random replacements (zero on special tokens); Ebar is their weighted
  mean of the rows. All terms use the uncorrected table.
  """
  e = np.asarray(embedding, np.float64)
  w = np.asarray(random_weights, np.float64)
  ebar = w @ e / w.sum()                                    # [d]
  keep = 1.0 - mask_prob - random_prob
  mixed = mask_prob * e[mask_id] + keep * e + random_prob * ebar
  return ((1.0 - select_rate) * e + select_rate * mixed).astype(embedding.dtype)


def require_extras() -> None:
  """Fails before any work if the interop extra is missing, naming what to install."""
  for module in ('safetensors', 'tokenizers'):
    hf.require(module)


def corrected_params(params: Params, model_cfg: model_lib.ModelConfig,
                     tokenizer: tok_lib.Tokenizer, masking_config: ml_collections.ConfigDict,
                     data_dir: str) -> Params:
  """`params` with `embedding_correction` applied to the token embedding as `masking_config`
  (a run's config.masking) masked; `params` itself is left unchanged.

  data_dir: the prepared data the run trained on; its unigram counts are read
  only when random replacements were drawn by frequency (random_source='unigram').
  """
  m, vocab = masking_config, model_cfg.vocab_size
  counts = None
  if m['random_source'] == 'unigram':
    counts = np.load(os.path.join(data_dir, 'unigram_counts.npy'))
  # The distribution the masker drew random tokens from (the tokenizer's ids, specials
  # zeroed); rows of a larger model vocabulary (ModernBERT's) are never drawn.
  weights = np.zeros(vocab)
  weights[:tokenizer.vocab_size] = masking.replacement_distribution(
      m['random_source'], tokenizer.vocab_size, counts, tokenizer.special_ids())
  table = params['encoder']['embeddings']['token']['embedding']
  corrected = table.copy()
  corrected[:vocab] = embedding_correction(
      table[:vocab], select_rate=m['select_rate'], mask_prob=m['mask_prob'],
      random_prob=m['random_prob'], random_weights=weights, mask_id=tokenizer.specials.mask)
  out = jax.tree_util.tree_map(lambda x: x, params)  # New dicts, same arrays.
  out['encoder']['embeddings']['token']['embedding'] = corrected
  return out


def write(out_dir: str, params: Params, model_cfg: model_lib.ModelConfig,
          tokenizer: tok_lib.Tokenizer) -> None:
  """Writes the Hugging Face directory `out_dir`: config, weights and tokenizer."""
  require_extras()
  # XLM-R's and CamemBERT's tokenizers go with their own model_type (export_format).
  fmt = export_format(model_cfg, tokenizer)
  hf.save_model(out_dir, params, model_cfg, tokenizer.specials, fmt)
  hf.save_tokenizer(out_dir, tokenizer, model_cfg.max_position_embeddings, fmt=fmt)
