"""Command line: python -m mlm_jax.fill_mask --workdir=runs/tiny "A [MASK] of strings." ...

Loads the latest checkpoint (or --step) of a training run and prints, for
every [MASK] of every sentence, the --top_k most probable tokens. Each
sentence is encoded as [CLS] ids [SEP] with the run's tokenizer, where the
literal text "[MASK]" is the [MASK] token.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import jax
import numpy as np
from absl import app
from absl import flags
from absl import logging

from mlm_jax import backend
from mlm_jax import model as model_lib
from mlm_jax import tokenizer as tok_lib
from mlm_jax import workdir as workdir_lib

Prediction = list[tuple[str, float]]  # (piece, probability), most probable first


def predict(run: workdir_lib.TrainedRun, texts: Sequence[str],
            top_k: int = 5) -> list[list[Prediction]]:
  """result[i][j]: the top_k (piece, probability) for the j-th [MASK] of texts[i].

  A text without [MASK] gets an empty list. Probabilities are a softmax over
  the real vocabulary (padding rows are never predicted).
  """
  cfg = run.model_cfg
  rows = [[tok_lib.CLS_ID, *ids, tok_lib.SEP_ID] for ids in run.tokenizer.encode(texts)]
  longest = max(map(len, rows))
  if longest > cfg.max_position_embeddings:
    raise ValueError(f'a text is {longest} tokens long with [CLS] and [SEP]; the model takes '
                     f'at most {cfg.max_position_embeddings}.')
  masks = [[t for t, i in enumerate(row) if i == tok_lib.MASK_ID] for row in rows]
  b, p = len(rows), max(1, max(map(len, masks)))
  input_ids = np.full((b, longest), tok_lib.PAD_ID, np.int32)          # [B, T]
  positions = np.zeros((b, p), np.int32)                                # [B, P]
  for i, (row, where) in enumerate(zip(rows, masks)):
    input_ids[i, :len(row)] = row
    positions[i, :len(where)] = where
  batch = {'input_ids': input_ids, 'attention_mask': (input_ids != tok_lib.PAD_ID).astype(np.int32),
           'segment_ids': np.zeros_like(input_ids), 'masked_positions': positions}
  logits = model_lib.BertForMLM(cfg).apply({'params': run.params}, batch, deterministic=True)
  probs = np.asarray(jax.nn.softmax(logits[..., :cfg.vocab_size], axis=-1))  # [B, P, V]
  out = []
  for i, where in enumerate(masks):
    per_mask = []
    for j in range(len(where)):
      best = np.argsort(-probs[i, j], kind='stable')[:top_k]
      per_mask.append([(run.tokenizer.id_to_piece(k), float(probs[i, j, k])) for k in best])
    out.append(per_mask)
  return out


def _define_flags() -> None:
  # Defined only when run as a script (see mlm_jax.export).
  flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
  flags.DEFINE_integer('top_k', 5, 'Predictions shown per [MASK].')
  flags.mark_flags_as_required(['workdir'])


def main(argv: list[str]) -> None:
  texts = argv[1:]
  if not texts:
    raise app.UsageError('Give one or more sentences containing [MASK].')
  backend.choose_platform()  # Before JAX starts a backend.
  logging.set_verbosity(logging.WARNING)  # Orbax logs every read at INFO.
  f = flags.FLAGS
  try:
    run = workdir_lib.load(f.workdir, f.step)
    results = predict(run, texts, f.top_k)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')
  for text, per_mask in zip(texts, results):
    print(text)
    if not per_mask:
      print('  (no [MASK] in this text)')
    for j, candidates in enumerate(per_mask):
      shown = '  '.join(f'{piece!r} {prob:.3f}' for piece, prob in candidates)
      print(f'  [MASK] {j + 1}: {shown}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
