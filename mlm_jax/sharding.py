"""The device mesh and the one boundary from host numpy to global jax.Arrays.

Data parallelism is `jax.jit` over a `jax.sharding.Mesh` with a `data` axis
spanning every device of every process: the batch is sharded on `data`, the
train state is replicated. This is the "pmapped" train step in the form JAX
now recommends (`jax.pmap` has been in maintenance mode since JAX 0.8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = 'data'


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over `data`."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def local_batch_size(global_batch: int, mesh: Mesh) -> int:
  """Rows this process feeds: its share of the devices on the `data` axis."""
  local_devices = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return global_batch * local_devices // mesh.devices.size


def to_global(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Host-local rows of every process -> global arrays sharded on `data`."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
