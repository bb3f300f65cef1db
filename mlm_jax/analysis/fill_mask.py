"""What a trained run predicts for the mask token in sentences (python -m mlm_jax.fill_mask).

Each sentence is encoded as [CLS] ids [SEP] with the run's tokenizer (its own
special ids: <s> ... </s> for RoBERTa's), where the mask token as the
tokenizer spells it ('[MASK]', RoBERTa's '<mask>') is the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.training import workdir as workdir_lib

Prediction = list[tuple[str, float]]  # (piece, probability), most probable first


def predict(run: workdir_lib.TrainedRun, texts: Sequence[str],
            top_k: int = 5) -> list[list[Prediction]]:
  """result[i][j]: the top_k (piece, probability) for the j-th mask token of texts[i].

  A text without one gets an empty list. Probabilities are a softmax over
  the model's vocabulary (its padding rows are never predicted).
  """
  cfg, specials = run.model_cfg, run.tokenizer.specials
  # encode, not encode_documents: the user's mask token is the token.
  rows = [[specials.cls, *ids, specials.sep] for ids in run.tokenizer.encode(texts)]
  longest = max(map(len, rows))
  if longest > cfg.max_position_embeddings:
    raise ValueError(f'a text is {longest} tokens long with {specials.token("cls")} and '
                     f'{specials.token("sep")}; the model takes at most '
                     f'{cfg.max_position_embeddings}.')
  masks = [[t for t, i in enumerate(row) if i == specials.mask] for row in rows]
  b, p = len(rows), max(1, max(map(len, masks)))
  input_ids = np.full((b, longest), specials.pad, np.int32)             # [B, T]
  attention_mask = np.zeros((b, longest), np.int32)                     # [B, T]
  positions = np.zeros((b, p), np.int32)                                # [B, P]
  for i, (row, where) in enumerate(zip(rows, masks)):
    input_ids[i, :len(row)] = row
    attention_mask[i, :len(row)] = 1
    positions[i, :len(where)] = where
  batch = {'input_ids': input_ids, 'attention_mask': attention_mask,
           'segment_ids': np.zeros_like(input_ids), 'masked_positions': positions}
  logits = model_lib.mlm_model(cfg).apply({'params': run.params}, batch, deterministic=True)
  probs = np.asarray(jax.nn.softmax(logits[..., :cfg.vocab_size], axis=-1))  # [B, P, V]
  out = []
  for i, where in enumerate(masks):
    per_mask = []
    for j in range(len(where)):
      best = np.argsort(-probs[i, j], kind='stable')[:top_k]
      per_mask.append([(run.tokenizer.id_to_piece(k), float(probs[i, j, k])) for k in best])
    out.append(per_mask)
  return out


def format_predictions(texts: Sequence[str], results: list[list[Prediction]],
                       mask_token: str = '[MASK]') -> str:
  """The candidates of each mask of each text; `mask_token`: how the tokenizer spells it."""
  lines = []
  for text, per_mask in zip(texts, results):
    lines.append(text)
    if not per_mask:
      lines.append(f'  (no {mask_token} in this text)')
    for j, candidates in enumerate(per_mask):
      shown = '  '.join(f'{piece!r} {prob:.3f}' for piece, prob in candidates)
      lines.append(f'  {mask_token} {j + 1}: {shown}')
  return '\n'.join(lines)
