"""Pallas kernels run per device, on that device's rows of the batch.

A Pallas call is a custom call, which XLA's partitioner cannot split: under
a mesh it would gather every row onto every device. `per_device` runs it
under shard_map instead, on the batch's mesh axes (the 'batch' rule; heads
are not split).
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax

from mlm_jax.runtime import sharding

Array = jax.Array


def per_device(run: Callable[..., Array], *arrays: Array) -> Array:
  """run(*arrays) on each device's rows; every array is [B, ...], and so is the result.

  Traced on a mesh (the step: sharding.traced_on) the call is split by rows;
  unsplit where no sharding applies (one device, or the one-row batch that
  only traces the parameters' shapes).
  """
  mesh = jax.sharding.get_abstract_mesh()
  spec = nn.logical_to_mesh_axes(('batch',), sharding.LOGICAL_RULES)  # The batch's mesh axes.
  if mesh.empty or arrays[0].shape[0] % mesh.size:
    return run(*arrays)
  return jax.shard_map(run, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec,
                       check_vma=False)(*arrays)
