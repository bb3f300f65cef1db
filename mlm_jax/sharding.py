"""The device mesh and the one boundary from host numpy to global jax.Arrays.

Data parallelism is `jax.jit` over a `jax.sharding.Mesh` with a `data` axis
spanning every device of every process: the batch is sharded on `data`, the
train state is replicated. This is the "pmapped" train step in the form JAX
now recommends (`jax.pmap` has been in maintenance mode since JAX 0.8).
"""

from __future__ import annotations

import os
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


def initialize_distributed(coordinator_address: str = '', num_processes: int = 1,
                           process_id: int = 0) -> None:
  """Joins JAX's distributed runtime when the command runs as several processes.

  Explicit arguments win, then the environment variables JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES and JAX_PROCESS_ID; failing those, a multi-host TPU slice
  or a SLURM job of several tasks is detected by `jax.distributed.initialize()`
  itself. A single process does nothing. Must run before anything touches a
  device.
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get('JAX_COORDINATOR_ADDRESS', '')
  num_processes = num_processes if num_processes > 1 else int(env.get('JAX_NUM_PROCESSES', 1))
  process_id = process_id or int(env.get('JAX_PROCESS_ID', 0))
  # CPU processes need a collectives implementation to talk to each other;
  # the setting does not affect GPU or TPU backends.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if coordinator_address or num_processes > 1:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif _in_multi_host_cluster(env):
    jax.distributed.initialize()


def _in_multi_host_cluster(env: Mapping[str, str]) -> bool:
  slurm = int(env.get('SLURM_NTASKS', '1') or 1) > 1 and 'SLURM_JOB_ID' in env
  tpu_pod = ',' in env.get('TPU_WORKER_HOSTNAMES', '')
  return slurm or tpu_pod
