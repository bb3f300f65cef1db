"""ModernBERT (Warner et al., 2024): the encoder of transformers' ModernBertForMaskedLM.

What differs from bert.py, layer by layer, all as Hugging Face computes it:

  embeddings  token table + LayerNorm; no position or segment tables
  blocks      pre-LN: x += Attn(LN(x)); x += MLP(LN(x)); layer 0 has no
              attention LayerNorm (its input is the embeddings' LayerNorm)
  attention   one fused q/k/v projection, rotary positions (rotate-half
              layout) on q and k; layers 0, n, 2n, ... (n =
              global_attn_every_n_layers) see the whole row with base
              global_rope_theta, the others only the tokens at most
              local_attention // 2 positions away, with base local_rope_theta
  MLP         GeGLU: Wi projects to [input, gate] (2·d_ff), GELU(input)·gate, Wo
  output      a final LayerNorm after the last block
  head        dense + GELU + LayerNorm (heads.MLMHead without biases), then
              the tied token embedding plus a bias
  biases      none in projections or LayerNorms (the decoder bias aside)

GELU is the exact (erf) one and LayerNorm's epsilon is config.model.layer_norm_eps
(ModernBERT: 1e-5). Dropout sits where Hugging Face has it: dropout_rate after
the embeddings' LayerNorm and on GELU(input)·gate; attention_dropout_rate on
the attention probabilities and the attention output; then, where Hugging
Face has none, attention_output_dropout_rate on the attention output alone
(FlexBERT's attn_out_dropout_prob). Kernels start from a truncated normal of
std initializer_range, divided by sqrt(2L) for those that write to the
residual stream (attention out, Wo) and the head's dense layer, as ModernBERT
initialises them (truncated at 2 std in both).

The model takes the same batches and gives the same outputs as
bert.BertForMLM (segment_ids are ignored), so the train step, evaluation and
probes use either unchanged. Shapes: see mlm_jax/model/config.py.
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax.numpy as jnp
import numpy as np

from mlm_jax.model import attention
from mlm_jax.model.bert import BertForMLM
from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.encoder import EncoderInputs
from mlm_jax.model.encoder import run_blocks
from mlm_jax.model.heads import MLMHead
from mlm_jax.model.heads import SentencePairHead
from mlm_jax.model.layers import EMBED
from mlm_jax.model.layers import HEADS
from mlm_jax.model.layers import KV
from mlm_jax.model.layers import MLP
from mlm_jax.model.layers import VOCAB
from mlm_jax.model.layers import batch_split
from mlm_jax.model.layers import dense_init
from mlm_jax.model.layers import layer_norm
from mlm_jax.model.layers import take_rows
from mlm_jax.runtime import platform_ops

Rotary = tuple[Array, Array]  # cos, sin: [B or 1, T, 1, H], float32.


def is_global(cfg: ModelConfig, layer: int) -> bool:
  """Whether block `layer` attends to the whole row (else to a local window)."""
  return not attention.is_local(cfg, layer)


def out_std(cfg: ModelConfig) -> float:
  """ModernBERT's init std of the projections that write to the residual stream."""
  return cfg.initializer_range / math.sqrt(2.0 * cfg.num_layers)


def rotary_tables(positions: Array, head_dim: int, theta: float) -> Rotary:
  """positions [B or 1, T] -> (cos, sin) [B or 1, T, 1, H] of rotary base `theta`.

  Frequency i (of H/2) is theta^(-2i/H); the angles are repeated for both
  halves of a head (Hugging Face's rotate-half layout, not interleaved pairs).
  Positions known when tracing (a numpy array: 0..T-1 unless given) make the
  tables constants of the program, computed here once. Traced ones (DropToken's)
  are computed in the program, where XLA may fuse cos and sin into every
  operation that reads them and evaluate them there again; so the default
  positions must stay a numpy array, not a jnp one.
  """
  xp = np if isinstance(positions, np.ndarray) else jnp
  inv_freq = 1.0 / (theta ** (xp.arange(0, head_dim, 2, dtype=xp.float32) / head_dim))
  angles = positions.astype(xp.float32)[..., None] * inv_freq            # [B, T, H/2]
  angles = xp.concatenate([angles, angles], axis=-1)[:, :, None, :]      # [B, T, 1, H]
  return xp.cos(angles), xp.sin(angles)


def apply_rotary(x: Array, rotary: Rotary) -> Array:
  """x [B, T, N, H] rotated by position: x·cos + rotate_half(x)·sin, in float32."""
  cos, sin = rotary
  xf = x.astype(jnp.float32)
  first, second = jnp.split(xf, 2, axis=-1)
  return (xf * cos + jnp.concatenate([-second, first], axis=-1) * sin).astype(x.dtype)


class ModernEmbeddings(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, input_ids: Array, deterministic: bool) -> Array:
    """input_ids [B, T] -> LayerNorm(token embedding) [B, T, d]: no position or segment tables."""
    cfg = self.cfg
    x = nn.Embed(cfg.padded_vocab_size, cfg.hidden_size,
                 embedding_init=dense_init(cfg, (VOCAB, EMBED)), name='token')(input_ids)
    x = layer_norm(cfg, 'layer_norm', use_bias=False)(batch_split(x))
    return self.ops.dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class ModernAttention(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, mask: attention.Mask, rotary: Rotary, deterministic: bool,
               rows: Array | None = None) -> Array:
    """x [B, T, d], mask: what each token may see (attention.Mask) -> [B, T, d].

    With rows [B, Q]: only those rows' queries (attending to all T keys), [B, Q, d].
    """
    cfg, ops = self.cfg, self.ops
    n, h = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    # One projection to (q, k, v) as Hugging Face's Wqkv: [d, 3, N, H].
    qkv = ops.dense_general((3, n, h), use_bias=False, dtype=cfg.dtype,
                            kernel_init=dense_init(cfg, (EMBED, None, HEADS, KV)),
                            name='qkv')(x)
    # Split (not indexed): the gradient is one concatenation of dq, dk and dv,
    # not three padded copies added together.
    q, k, v = (batch_split(y[:, :, 0]) for y in jnp.split(qkv, 3, axis=2))  # [B, T, N, H]
    q_rotary = rotary
    if rows is not None:
      q = batch_split(take_rows(q, rows))                                  # [B, Q, N, H]
      q_rotary = tuple(take_rows(jnp.asarray(table), rows) for table in rotary)
    out = attention.attend(cfg, apply_rotary(q, q_rotary), apply_rotary(k, rotary), v, mask,
                           deterministic, rows, ops.dropout)
    out = ops.dense_general(cfg.hidden_size, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
                            kernel_init=dense_init(cfg, (HEADS, KV, EMBED), out_std(cfg)),
                            name='out')(out)
    out = ops.dropout(cfg.attention_dropout_rate)(out, deterministic=deterministic)
    return ops.dropout(cfg.attention_output_dropout_rate)(out, deterministic=deterministic)


class GeGLU(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    """x [B, T, d] -> Wo(GELU(input)·gate) [B, T, d]; [input, gate] = Wi(x) [B, T, 2·d_ff]."""
    cfg, ops = self.cfg, self.ops
    h = ops.dense(2 * cfg.intermediate_size, use_bias=False, dtype=cfg.dtype,
                  kernel_init=dense_init(cfg, (EMBED, MLP)), name='wi')(x)
    inputs, gate = jnp.split(batch_split(h), 2, axis=-1)
    h = ops.dropout(cfg.dropout_rate)(ops.gelu(inputs) * gate, deterministic=deterministic)
    return ops.dense(cfg.hidden_size, use_bias=False, dtype=cfg.dtype,
                     kernel_init=dense_init(cfg, (MLP, EMBED), out_std(cfg)), name='wo')(h)


@flax.struct.dataclass
class BlockInputs:
  """What a ModernBERT block reads besides x: its layer kind's mask and rotary tables.

  Global and local layers each have one (whole row or window; their rotary base).
  """

  mask: attention.Mask
  rotary: Rotary


class ModernBlock(nn.Module):
  """Pre-LN block: x += Attn(LN(x)); x += GeGLU(LN(x)). No attention LN in layer 0."""

  cfg: ModelConfig
  first: bool  # Layer 0: its input is the embeddings' LayerNorm already.
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, inputs: BlockInputs, deterministic: bool,
               rows: Array | None = None) -> Array:
    """x [B, T, d] -> [B, T, d]; with rows [B, Q] only those rows' outputs, [B, Q, d]
    (their queries attend to all T tokens; the rest of the block runs on Q rows)."""
    cfg = self.cfg
    x = batch_split(x)
    h = x if self.first else layer_norm(cfg, 'attention_norm', use_bias=False)(x)
    if rows is not None:
      x = batch_split(take_rows(x, rows))
    x = x + batch_split(ModernAttention(cfg, self.ops, name='attention')(
        h, inputs.mask, inputs.rotary, deterministic, rows))
    h = layer_norm(cfg, 'mlp_norm', use_bias=False)(x)
    return batch_split(x + GeGLU(cfg, self.ops, name='mlp')(h, deterministic))


class ModernEncoder(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, inputs: EncoderInputs, deterministic: bool = True,
               return_all_layers: bool = False, output_rows: Array | None = None) -> Array:
    """inputs' [B, T] ids -> contextual embeddings [B, T, d] (after the final LayerNorm).

    Reads input_ids, attention_mask, `positions` (the rotary positions),
    `row_positions` (the ones a local window measures distances in:
    DropToken's kept tokens; None: 0..T-1) and document_ids; ModernBERT has
    no segment table, so no segment_ids. With return_all_layers:
    [L + 1, B, T, d], the final LayerNorm of the embeddings' output and of
    every block's output, the last being the usual output: a pre-LN model's
    head reads normalised states. With output_rows [B, Q]: the last block
    computes those rows only, [B, Q, d].
    """
    cfg = self.cfg
    if cfg.scan_layers:
      raise ValueError("scan_layers is not supported by variant 'modern' (see config.py).")
    x = ModernEmbeddings(cfg, self.ops, name='embeddings')(inputs.input_ids, deterministic)
    positions = inputs.positions
    if positions is None:
      positions = np.arange(inputs.input_ids.shape[1])[None]
    valid = inputs.attention_mask.astype(bool)
    head_dim = cfg.hidden_size // cfg.num_heads
    kinds = [BlockInputs(attention.Mask(valid, inputs.row_positions, inputs.document_ids, window),
                         rotary_tables(positions, head_dim, theta))
             for window, theta in ((None, cfg.global_rope_theta),
                                   (cfg.local_attention // 2, cfg.local_rope_theta))]
    return run_blocks(cfg, ModernBlock, x, deterministic,
                      lambda layer: kinds[0 if is_global(cfg, layer) else 1], self.ops,
                      fields=lambda layer: {'first': layer == 0}, output_rows=output_rows,
                      return_all_layers=return_all_layers,
                      finish=layer_norm(cfg, 'final_norm', use_bias=False))


class ModernBertForMLM(BertForMLM):
  """BertForMLM's calls and outputs over the ModernBERT encoder and head.

  Its parameters: encoder/embeddings/{token, layer_norm}, encoder/layer_i/
  {attention_norm (i > 0), attention/{qkv, out}, mlp_norm, mlp/{wi, wo}},
  encoder/final_norm, mlm_head/{transform, layer_norm, output_bias}.
  """

  def setup(self):
    self.encoder = ModernEncoder(self.cfg, self.ops)
    self.mlm_head = MLMHead(self.cfg, use_bias=False, transform_std=out_std(self.cfg),
                            ops=self.ops)
    if self.cfg.sentence_pair_head:
      self.sentence_pair = SentencePairHead(self.cfg, self.ops)
