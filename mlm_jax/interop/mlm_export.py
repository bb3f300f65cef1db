"""Export of a training run to Hugging Face (python -m mlm_jax.export).

Writes a Hugging Face model directory from a checkpoint of a training run:

  OUT/config.json             the config of config.model.variant's architecture:
                              BertForMaskedLM, RobertaForMaskedLM or
                              ModernBertForMaskedLM, with the special-token ids of
                              the run's tokenizer and vocab_size its table's rows
  OUT/model.safetensors       the weights, vocabulary padding rows dropped
  OUT/tokenizer.json ...      a sentencepiece tokenizer as a tokenizers Unigram (plus
                              tokenizer_config.json and tokenizer.model); a Hugging
                              Face tokenizer (e.g. that of a published checkpoint the
                              run started from) as its own files, with added words

so that `AutoModelForMaskedLM`, `AutoTokenizer` and `pipeline('fill-mask')`
load it offline. --step picks a checkpoint (default: the latest);
--embedding_correction applies `embedding_correction` to the token embedding.
Needs the interop extra (safetensors, tokenizers), not torch.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from mlm_jax.data import masking
from mlm_jax.interop import hf
from mlm_jax.training import workdir as workdir_lib


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


def correct_run_embedding(run: workdir_lib.TrainedRun) -> dict:
  """The run's params with `embedding_correction` applied as its config's masking did."""
  m, vocab = run.config['masking'], run.model_cfg.vocab_size
  counts = None
  if m['random_source'] == 'unigram':
    counts = np.load(os.path.join(run.config['resolved']['data_dir'], 'unigram_counts.npy'))
  # The distribution the masker drew random tokens from (the tokenizer's ids, specials
  # zeroed); rows of a larger model vocabulary (ModernBERT's) are never drawn.
  weights = np.zeros(vocab)
  weights[:run.tokenizer.vocab_size] = masking.replacement_distribution(
      m['random_source'], run.tokenizer.vocab_size, counts, run.tokenizer.special_ids())
  table = run.params['encoder']['embeddings']['token']['embedding']
  corrected = table.copy()
  corrected[:vocab] = embedding_correction(
      table[:vocab], select_rate=m['select_rate'], mask_prob=m['mask_prob'],
      random_prob=m['random_prob'], random_weights=weights, mask_id=run.tokenizer.specials.mask)
  params = jax.tree_util.tree_map(lambda x: x, run.params)  # New dicts, same arrays.
  params['encoder']['embeddings']['token']['embedding'] = corrected
  return params


def export(workdir: str, out_dir: str, step: int | None = None,
           apply_embedding_correction: bool = False) -> workdir_lib.TrainedRun:
  """Writes the Hugging Face directory `out_dir`; returns the run it was made from."""
  for module in ('safetensors', 'tokenizers'):
    hf.require(module)  # Fail before any work, naming the extra to install.
  run = workdir_lib.load(workdir, step)
  params = correct_run_embedding(run) if apply_embedding_correction else run.params
  hf.save_model(out_dir, params, run.model_cfg, run.tokenizer.specials)
  hf.save_tokenizer(out_dir, run.tokenizer, run.model_cfg.max_position_embeddings,
                    run.model_cfg.variant)
  return run
