"""The device mesh, the state's shardings and the one boundary from host numpy
to global jax.Arrays.

The mesh has two axes, `data` x `fsdp`, spanning every device of every
process. The batch is split over both. The train state (parameters and both
Adam moments) is split over `fsdp` along each tensor's 'embed' axis (the
model names its axes logically; LOGICAL_RULES maps them), and replicated over
`data`: fsdp=1 is plain data parallelism, fsdp=N shards the state N ways and
XLA gathers each weight where it is used (ZeRO-3 / FSDP). All of it is
`jax.jit` over a `jax.sharding.Mesh`: the "pmapped" train step in the form JAX
now recommends (`jax.pmap` has been in maintenance mode since JAX 0.8).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

DATA_AXIS, FSDP_AXIS = 'data', 'fsdp'
# Logical axis -> mesh axes; names not listed are replicated. 'embed' places
# the parameters (and their Adam moments); 'batch' the activations, which
# the model constrains with nn.with_logical_constraint (model/layers.py
# batch_split) to keep the input batch's split over every device.
LOGICAL_RULES = (('embed', FSDP_AXIS), ('batch', (DATA_AXIS, FSDP_AXIS)))


def make_mesh(fsdp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp) mesh over `devices` (default: all devices of all processes).

  Consecutive devices share an `fsdp` group, so with several devices per host
  the weight gathers stay inside a host as long as fsdp divides its device count.
  """
  devices = jax.devices() if devices is None else list(devices)
  if fsdp < 1 or len(devices) % fsdp:
    raise ValueError(f'fsdp={fsdp} does not divide the {len(devices)} devices')
  return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), (DATA_AXIS, FSDP_AXIS))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over every device (`data` and `fsdp`).

  The batch's sharding; inside the step, the model's activations keep it by
  the 'batch' rule of LOGICAL_RULES (see `traced_on`): without that
  constraint XLA may keep a weight split on `fsdp` and gather the activations
  instead, a whole global batch per device (seen compiling BERT-base with
  fsdp=16 for a TPU v5e slice).
  """
  return NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))


def traced_on(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
  """`fn` whose body is traced on `mesh`: give it to jax.jit.

  The model's activation constraints (layers.batch_split: the 'batch' rule of
  LOGICAL_RULES) and the Pallas kernels' shard_map read the mesh from the
  context they are traced in; outside one they do nothing (a model on one
  device, tests, interop). Entered inside the traced body, the context holds
  however the jitted step is then called, lowered or compiled (the trainer,
  the benchmark, the pre-flight). The abstract mesh is enough to trace with,
  and may be entered under jit, where jax.set_mesh may not. The rules are
  not entered as flax's logical_axis_rules context: with a mesh and rules
  both in context, flax constrains each DenseGeneral kernel's flattened
  initial value (which it evaluates in apply, to check shapes) by the
  unflattened kernel's axis names, which fails; the model passes the rules
  to its constraints itself.
  """
  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def state_shardings(boxed_tree: Any, mesh: Mesh) -> Any:
  """NamedShardings for a (possibly abstract) tree whose leaves carry logical axis names.

  `boxed_tree` is what `model.init` returns (leaves wrapped in
  nn.LogicallyPartitioned), or a train state built from it; unnamed leaves
  (the step, optimizer counters) are replicated. The result matches the tree
  after `nn.unbox`.
  """
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, LOGICAL_RULES)


def state_bytes(state: Any) -> dict[str, int]:
  """Bytes of a whole (sharded) train state, and of the part the first local device holds."""
  leaves = jax.tree_util.tree_leaves(state)
  return {'total': sum(x.nbytes for x in leaves),
          'per_device': sum(x.addressable_shards[0].data.nbytes for x in leaves)}


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
