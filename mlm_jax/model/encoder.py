"""The layer loop both encoders share: blocks named layer_i (or one scanned block), remat,
the last block at the output rows only, every layer's output on request; and the
encoders' input (EncoderInputs), which the model builds.

An encoder (bert.Encoder, modern.ModernEncoder) takes one EncoderInputs and
reads the fields it uses; it computes its embeddings and what its blocks
read besides x (its own block-inputs struct: masks, rotary tables), then
calls `run_blocks` from its compact method; the blocks become its children,
so parameters sit at encoder/layer_i/... (encoder/layers/block/... with
scan_layers) whichever encoder it is.

A block is a Linen module made as `block(cfg, ops=ops, **fields)`, whose
__call__ is exactly (x, inputs, deterministic, rows): x [B, T, d], `inputs`
the encoder's struct (a pytree: the same for every call of a layer kind),
`deterministic` a Python bool, and `rows` [B, Q] or None (only those rows'
outputs, [B, Q, d]). That signature fixes remat's static argument:
`deterministic`, STATIC_ARGNUMS. Shapes: see mlm_jax/model/config.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.layers import REMAT_POLICIES
from mlm_jax.model.layers import take_rows
from mlm_jax.runtime import platform_ops

# The positions, in block.__call__(self, x, inputs, deterministic, rows) as
# nn.remat counts them (self is 0), of the arguments that are Python values
# fixed when tracing: remat must not trace `deterministic`.
STATIC_ARGNUMS = (3,)


@flax.struct.dataclass
class EncoderInputs:
  """What an encoder reads, built by the model from a batch. [B, T] each.

  Each encoder reads the fields it uses (BERT: not row_positions; ModernBERT:
  not segment_ids, it has no segment table).
  """

  input_ids: Array
  segment_ids: Array
  attention_mask: Array                # 1 for real tokens (padding last in every row).
  # Each token's position (position embedding or rotary angle); None: 0..T-1.
  # DropToken passes the positions of the tokens it kept; restarted positions
  # count from each document's start.
  positions: Array | None = None
  # Positions in the original row, which a local window measures distances
  # in (DropToken's kept tokens); None: 0..T-1.
  row_positions: Array | None = None
  document_ids: Array | None = None    # Attention stays in each document; None: one per row.

  @classmethod
  def of(cls, batch: dict[str, Array], **fields: Any) -> 'EncoderInputs':
    """From a batch's input_ids, segment_ids and attention_mask, and `fields` (the rest)."""
    return cls(batch['input_ids'], batch['segment_ids'], batch['attention_mask'], **fields)


def _block_class(block: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
  """`block`, or with cfg.remat a version that recomputes what the policy does not keep."""
  if cfg.remat == 'none':
    return block
  return nn.remat(block, policy=REMAT_POLICIES[cfg.remat], static_argnums=STATIC_ARGNUMS)


class _ScannedBlock(nn.Module):
  """One step of nn.scan over the blocks: (x, inputs) -> (x, x or None)."""

  cfg: ModelConfig
  block: type[nn.Module]
  deterministic: bool
  emit: bool  # Also return every block's output (stacked by the scan).
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, inputs: Any):
    x = _block_class(self.block, self.cfg)(self.cfg, ops=self.ops, name='block')(
        x, inputs, self.deterministic, None)
    return x, (x if self.emit else None)


def run_blocks(cfg: ModelConfig, block: type[nn.Module], x: Array, deterministic: bool,
               inputs: Callable[[int], Any], ops: platform_ops.Ops = platform_ops.DEFAULT,
               fields: Callable[[int], dict[str, Any]] = lambda layer: {},
               output_rows: Array | None = None, return_all_layers: bool = False,
               finish: Callable[[Array], Array] = lambda y: y) -> Array:
  """x [B, T, d] (the embeddings' output) through cfg.num_layers blocks -> [B, T, d].

  Called from an encoder's compact method. Block i is `block(cfg, ops=ops,
  **fields(i))` called as (x, inputs(i), deterministic, rows). `finish` acts
  on every output returned (ModernBERT's final LayerNorm).
  With return_all_layers: [L + 1, B, T, d], x and then every block's output.
  With output_rows [B, Q] (indices into T): only those rows, [B, Q, d], the
  same values as the full output's; the last block computes them alone.
  With cfg.scan_layers the blocks are one nn.scan, their parameters stacked
  on a leading 'layers' axis (one block is compiled). The layers must then be
  alike (an encoder whose layers differ refuses scan_layers): the scanned
  block gets no fields and layer 0's inputs, and it runs the last layer in
  full before the rows are taken from its output.
  """
  check_output_rows(output_rows, return_all_layers)
  if cfg.scan_layers:
    blocks = nn.scan(_ScannedBlock, variable_axes={'params': 0},
                     split_rngs={'params': True, 'dropout': True}, in_axes=nn.broadcast,
                     length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
    out, every = blocks(cfg, block, deterministic, return_all_layers, ops,
                        name='layers')(x, inputs(0))
    if return_all_layers:
      return finish(jnp.concatenate([x[None], every]))
    return finish(out if output_rows is None else take_rows(out, output_rows))
  layers = [x]
  for i in range(cfg.num_layers):
    rows = output_rows if i == cfg.num_layers - 1 else None
    x = _block_class(block, cfg)(cfg, ops=ops, name=f'layer_{i}', **fields(i))(
        x, inputs(i), deterministic, rows)
    layers.append(x)
  return jnp.stack([finish(y) for y in layers]) if return_all_layers else finish(x)


def check_output_rows(output_rows: Array | None, return_all_layers: bool) -> None:
  """A subset of rows is for the last layer's output only."""
  if output_rows is not None and return_all_layers:
    raise ValueError('output_rows and return_all_layers exclude each other: '
                     'every layer is returned in full.')


def stack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """Per-layer params (encoder/layer_i) -> the scan layout (encoder/layers/block, [L, ...])."""
  encoder = dict(params['encoder'])
  blocks = [encoder.pop(f'layer_{i}') for i in range(num_layers)]
  encoder['layers'] = {'block': jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)}
  return {**params, 'encoder': encoder}


def unstack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """The scan layout -> per-layer params (what export, import and probes read)."""
  encoder = dict(params['encoder'])
  stacked = encoder.pop('layers')['block']
  for i in range(num_layers):
    encoder[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
  return {**params, 'encoder': encoder}
