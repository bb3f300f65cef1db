"""Training FLOPs per token and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the devices, where the model
FLOPs count only the matrix multiplies a BERT step needs (forward + backward =
3x forward = 6 FLOPs per weight per token), not recomputation or overheads.
"""

from __future__ import annotations

from mlm_jax.perf import hardware


def flops_per_token(*, num_layers: int, hidden_size: int, intermediate_size: int,
                    seq_len: int, vocab_size: int, max_predictions: int) -> float:
  """Training FLOPs per token of a BERT MLM step:

    6·L·(4d² + 2·d·d_ff) + 12·L·d·T + 6·(d² + d·V)·(P/T)

  - 6·L·(4d² + 2·d·d_ff): the q, k, v, out projections and the MLP of every
    block (6 FLOPs per weight per token for forward and backward);
  - 12·L·d·T: attention scores QKᵀ and the weighted sum of V (2·T·d each,
    forward, times 3 for the backward pass);
  - 6·(d² + d·V)·(P/T): the MLM head's transform and tied output projection,
    run only on the P masked slots of every T tokens.

  Embedding lookups, LayerNorm, softmax and GELU are left out. V is the padded
  vocabulary: the logits are computed for every row of the table.
  """
  L, d, d_ff, T, V, P = (num_layers, hidden_size, intermediate_size, seq_len, vocab_size,
                         max_predictions)
  return 6 * L * (4 * d * d + 2 * d * d_ff) + 12 * L * d * T + 6 * (d * d + d * V) * (P / T)


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
