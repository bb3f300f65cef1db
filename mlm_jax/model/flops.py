"""Training FLOPs per token and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices, where the model
FLOPs count only the matrix multiplies an MLM step needs (forward + backward =
3x forward = 6 FLOPs per weight per token), not recomputation or overheads.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlm_jax import model as model_lib
from mlm_jax.model import modern as modern_lib
from mlm_jax.runtime import hardware


def flops_per_token(*, num_layers: int, hidden_size: int, intermediate_size: int,
                    seq_len: int, vocab_size: int, max_predictions: int, mlp_matrices: int = 2,
                    attention_context: Sequence[int] | None = None,
                    last_block_rows: int | None = None) -> float:
  """Training FLOPs per token of an MLM step:

    6·(L-1)·(4d² + m·d·d_ff) + 6·(2d² + (2d² + m·d·d_ff)·R/T)
      + 12·d·(C_0 + … + C_{L-2} + C_{L-1}·R/T) + 6·(d² + d·V)·(P/T)

  - 6·(4d² + m·d·d_ff) per block: the q, k, v, out projections and the MLP
    (6 FLOPs per weight per token for forward and backward); the MLP has
    m = 2 matrices (BERT) or 3 (GeGLU: its input projection is 2·d_ff wide);
  - the last block computes only the R rows of T the MLM step needs (R = P,
    the masked slots, unless `last_block_rows` says otherwise): its keys and
    values for every token, its queries, out projection and MLP for R rows;
  - 12·d·C: attention scores QKᵀ and the weighted sum of V (2·C·d each,
    forward, times 3 for the backward pass) for a query that attends to C
    keys: T, or a local window's width (`attention_context`, one per block;
    default T for every block, BERT's 12·L·d·T with R = T);
  - 6·(d² + d·V)·(P/T): the MLM head's transform and tied output projection,
    run only on the P masked slots of every T tokens.

  Embedding lookups, norms, softmax and GELU are left out. V is the padded
  vocabulary: the logits are computed for every row of the table.
  """
  L, d, d_ff, T, V, P = (num_layers, hidden_size, intermediate_size, seq_len, vocab_size,
                         max_predictions)
  context = list(attention_context) if attention_context is not None else [T] * L
  rows = (P if last_block_rows is None else last_block_rows) / T
  block = 4 * d * d + mlp_matrices * d * d_ff
  last_block = 2 * d * d + (2 * d * d + mlp_matrices * d * d_ff) * rows
  attention = 12 * d * (sum(context[:-1]) + context[-1] * rows)
  return 6 * (L - 1) * block + 6 * last_block + attention + 6 * (d * d + d * V) * (P / T)


def model_flops_per_token(cfg: model_lib.ModelConfig, seq_len: int, max_predictions: int,
                          last_block_rows: int | None = None) -> float:
  """`flops_per_token` of a model config, any variant, with the padded vocabulary.

  ModernBERT ('modern') has a GeGLU MLP (3 matrices) and its local blocks
  attend to a window of local_attention + 1 keys (|i - j| <= local_attention
  // 2), counted as such: model FLOPs count what the model needs, not the
  masked-out scores a kernel may compute anyway, nor the last block's rows
  that no loss reads (`last_block_rows=seq_len` counts them: what Hugging
  Face's step computes).
  """
  modern = cfg.variant == 'modern'
  context = [seq_len if not modern or modern_lib.is_global(cfg, i)
             else min(seq_len, cfg.local_attention // 2 * 2 + 1) for i in range(cfg.num_layers)]
  return flops_per_token(
      num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, seq_len=seq_len,
      vocab_size=cfg.padded_vocab_size, max_predictions=max_predictions,
      mlp_matrices=3 if modern else 2, attention_context=context,
      last_block_rows=last_block_rows)


def peak_flops_per_device(device_kind: str, peak_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the override if positive, else hardware.CHIPS; None if unknown.

  Float32 runs are measured against the bf16 peak too: the usual convention.
  """
  if peak_tflops > 0:
    return peak_tflops * 1e12
  chip = hardware.chip_for_device_kind(device_kind)
  return chip.peak_flops if chip else None


def mfu(tokens_per_sec: float | None, flops_per_tok: float, peak_per_device: float | None,
        num_devices: int) -> float | None:
  """Model FLOPs utilisation in [0, 1]; None when the speed or the peak is unknown."""
  if not tokens_per_sec or not peak_per_device:
    return None
  return tokens_per_sec * flops_per_tok / (peak_per_device * num_devices)
