"""The layer loop both encoders share: blocks named layer_i (or one scanned block), remat,
the last block at the output rows only, every layer's output on request.

An encoder (bert.Encoder, modern.ModernEncoder) computes its embeddings and
whatever its blocks read besides x (masks, rotary tables), then calls
`run_blocks` from its compact method; the blocks become its children, so
parameters sit at encoder/layer_i/... (encoder/layers/block/... with
scan_layers) whichever encoder it is.

A block is a Linen module whose __call__ takes x [B, T, d], its other inputs
by name, `deterministic` (a Python bool) and `rows` [B, Q] or None (only
those rows' outputs, [B, Q, d]). `run_blocks` passes the arguments by name
and calls the block with them in its signature's order, and tells nn.remat
which position `deterministic` holds by looking the name up in that
signature: a block may gain or reorder arguments without remat tracing the
bool. Shapes: see mlm_jax/model/config.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.layers import REMAT_POLICIES
from mlm_jax.model.layers import take_rows

# The block's __call__ arguments that are Python values, fixed when tracing:
# nn.remat must not trace them.
STATIC_ARGUMENTS = ('deterministic',)


def _arguments(block: type[nn.Module], **by_name: Any) -> tuple[Any, ...]:
  """`by_name` as positional arguments of block.__call__, in its signature's order.

  nn.remat's static_argnums are positions, and a keyword argument would be
  traced; so every argument is passed by position.
  """
  bound = inspect.signature(block.__call__).bind(None, **by_name)
  bound.apply_defaults()
  return bound.args[1:]


def static_argnums(block: type[nn.Module]) -> tuple[int, ...]:
  """Positions of STATIC_ARGUMENTS in block.__call__ (self is 0), as nn.remat counts them."""
  names = list(inspect.signature(block.__call__).parameters)
  return tuple(names.index(name) for name in STATIC_ARGUMENTS)


def _block_class(block: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
  """`block`, or with cfg.remat a version that recomputes what the policy does not keep."""
  if cfg.remat == 'none':
    return block
  return nn.remat(block, policy=REMAT_POLICIES[cfg.remat], static_argnums=static_argnums(block))


class _ScannedBlock(nn.Module):
  """One step of nn.scan over the blocks: (x, inputs) -> (x, x or None)."""

  cfg: ModelConfig
  block: type[nn.Module]
  deterministic: bool
  emit: bool  # Also return every block's output (stacked by the scan).

  @nn.compact
  def __call__(self, x: Array, inputs: dict[str, Any]):
    x = _block_class(self.block, self.cfg)(self.cfg, name='block')(
        *_arguments(self.block, x=x, deterministic=self.deterministic, **inputs))
    return x, (x if self.emit else None)


def run_blocks(cfg: ModelConfig, block: type[nn.Module], x: Array, deterministic: bool,
               inputs: Callable[[int], dict[str, Any]],
               fields: Callable[[int], dict[str, Any]] = lambda layer: {},
               output_rows: Array | None = None, return_all_layers: bool = False,
               finish: Callable[[Array], Array] = lambda y: y) -> Array:
  """x [B, T, d] (the embeddings' output) through cfg.num_layers blocks -> [B, T, d].

  Called from an encoder's compact method. Block i is `block(cfg,
  **fields(i))` called with `inputs(i)` (its arguments besides x,
  deterministic and rows, by name). `finish` acts on every output returned
  (ModernBERT's final LayerNorm).
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
    out, every = blocks(cfg, block, deterministic, return_all_layers, name='layers')(x, inputs(0))
    if return_all_layers:
      return finish(jnp.concatenate([x[None], every]))
    return finish(out if output_rows is None else take_rows(out, output_rows))
  layers = [x]
  for i in range(cfg.num_layers):
    rows = output_rows if i == cfg.num_layers - 1 else None
    x = _block_class(block, cfg)(cfg, name=f'layer_{i}', **fields(i))(
        *_arguments(block, x=x, deterministic=deterministic, rows=rows, **inputs(i)))
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
