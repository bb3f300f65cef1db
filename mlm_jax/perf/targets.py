"""Accelerator targets by the names users type, and compile-only devices for them.

TPU slices use Cloud TPU naming: `v4-N` and `v5p-N` count TensorCores (two
per chip; JAX sees one device per chip in megacore mode), `v5litepod-N` and
`v6e-N` count chips. GPU targets are `h100` (one GPU), `h100xG` (one node of
G GPUs), `h100xGxK` (K nodes of G, e.g. h100x8x4), and the same for `a100`.

`compile_devices(target)` returns JAX devices that exist only to compile for
(no accelerator needed): libtpu's compile-only TPU devices for a topology,
and a deviceless CUDA target described by XLA's GPU target-config proto.
Both need `pip install -e '.[aot]'`, and JAX running on its CPU backend
(JAX_PLATFORMS=cpu), which `runtime.backend.use_cpu_backend()` arranges. A deviceless GPU
compile needs XLA's CUDA compiler only (the jax-cuda12-pjrt plugin): no CUDA
runtime, cuDNN or other NVIDIA library is loaded, and the cuDNN version the
fused-attention call is built for is the target's (`tracing_for`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re

from mlm_jax.errors import TargetError
from mlm_jax.runtime import hardware

INSTALL_HINT = "pip install -e '.[aot]'"
# JAX's GPU client takes this fraction of device memory unless told otherwise.
_JAX_GPU_MEMORY_FRACTION = 0.75



@dataclasses.dataclass(frozen=True)
class Target:
  name: str                 # As typed: 'v4-32', 'h100x8x4'.
  chip: hardware.Chip
  platform: str             # 'tpu' | 'gpu'
  num_devices: int
  devices_per_host: int
  topology: str             # TPU: generation and chip grid 'v4:2x2x4'; GPU: 'nodes x 1 x GPUs'.

  @property
  def num_hosts(self) -> int:
    return self.num_devices // self.devices_per_host

  def usable_memory(self) -> tuple[int, str]:
    """(bytes one device offers JAX, how that was decided)."""
    hbm = self.chip.hbm_bytes
    if self.platform != 'gpu':
      return hbm, f'{hbm / hardware.GiB:.0f} GiB HBM'
    env = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION')
    fraction = float(env) if env else _JAX_GPU_MEMORY_FRACTION
    source = (f'XLA_PYTHON_CLIENT_MEM_FRACTION={env}' if env
              else "JAX's default; set XLA_PYTHON_CLIENT_MEM_FRACTION to change it")
    return int(hbm * fraction), f'{fraction:.2f} of {hbm / hardware.GiB:.1f} GiB, {source}'


# Cloud TPU name prefix -> (chip, what N counts).
_TPU = {'v4': ('v4', 'cores'), 'v5p': ('v5p', 'cores'), 'v5litepod': ('v5e', 'chips'),
        'v6e': ('v6e', 'chips')}
# Generations whose two TensorCores per chip JAX drives as one device.
_MEGACORE = ('v4', 'v5p')
# Chip grids of the single-host slices of the 2-D generations; larger slices
# have 4 chips (2x2) per host.
_SINGLE_HOST_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4)}
_MAX_CHIPS = {'v4': 4096, 'v5p': 8960, 'v5e': 256, 'v6e': 256}
_GPUS = {'h100': 'h100', 'a100': 'a100'}
_GPU_NODE_SIZES = (1, 2, 4, 8)

KNOWN = ('v4-N (N cores: 8, 16, 32, ... 8192)', 'v5p-N (N cores: 8, 16, 32, ...)',
         'v5litepod-N (N chips: 1, 4, 8, 16, 32, 64, 128, 256)', 'v6e-N (N chips: as v5litepod)',
         'h100, h100xG (G = 1, 2, 4, 8 GPUs)', 'h100xGxK (K nodes of G)', 'a100, a100xG, a100xGxK')


def _unknown(name: str, why: str) -> TargetError:
  return TargetError(f'--target={name!r}: {why}. Known targets: {"; ".join(KNOWN)}.')


def parse(name: str) -> Target:
  """The target called `name`; TargetError for an unknown or impossible one."""
  text = name.strip().lower()
  tpu = re.fullmatch(r'(v4|v5p|v5litepod|v6e)-(\d+)', text)
  if tpu:
    return _tpu_target(name, tpu.group(1), int(tpu.group(2)))
  gpu = re.fullmatch(r'(h100|a100)(?:x(\d+))?(?:x(\d+))?', text)
  if gpu:
    per_node = int(gpu.group(2) or 1)
    nodes = int(gpu.group(3) or 1)
    if per_node not in _GPU_NODE_SIZES:
      raise _unknown(name, f'{per_node} GPUs per node is not a node size ({_GPU_NODE_SIZES})')
    if nodes < 1:
      raise _unknown(name, 'the number of nodes K in h100xGxK must be at least 1')
    chip = hardware.chip(_GPUS[gpu.group(1)])
    return Target(name, chip, 'gpu', per_node * nodes, per_node, f'{nodes}x1x{per_node}')
  raise _unknown(name, 'not a known target name')


def _tpu_target(name: str, prefix: str, n: int) -> Target:
  chip_name, unit = _TPU[prefix]
  chip = hardware.chip(chip_name)
  if unit == 'cores':
    if n < 8 or n % 2:
      raise _unknown(name, f'{prefix}-N counts TensorCores (2 per chip), at least 8')
    chips = n // 2
  else:
    chips = n
  if chips > _MAX_CHIPS[chip_name] or chips & (chips - 1):
    raise _unknown(name, f'{prefix} slices have a power-of-two number of chips, at most '
                   f'{_MAX_CHIPS[chip_name]}')
  if chip_name in ('v5e', 'v6e'):
    if chips in _SINGLE_HOST_2D:
      grid, per_host = _SINGLE_HOST_2D[chips], chips
    elif chips >= 16:
      side = int(math.sqrt(chips // 2)) if math.log2(chips) % 2 else int(math.sqrt(chips))
      grid, per_host = (side, chips // side), 4
    else:
      raise _unknown(name, f'{prefix} slices have 1, 4, 8, 16, ... 256 chips')
  else:
    if chips < 4:
      raise _unknown(name, f'{prefix} slices have at least 4 chips ({prefix}-8)')
    grid, per_host = _grid_3d(chips), 4
  return Target(name, chip, 'tpu', chips, per_host, f'{chip_name}:' + 'x'.join(map(str, grid)))


def _grid_3d(chips: int) -> tuple[int, int, int]:
  """Cloud TPU's 3-D chip grid of a v4/v5p slice: 4 -> 2x2x1, 8 -> 2x2x2, 16 -> 2x2x4, 32 -> 2x4x4..."""
  grid = [2, 2, 1]
  while math.prod(grid) < chips:
    i = max(j for j in range(3) if grid[j] == min(grid))
    grid[i] *= 2
  return tuple(grid)


# --------------------------------------------------------------- devices



def check_compiler(target: Target) -> None:
  """TargetError naming the fix when the target's compiler is not installed."""
  if target.platform == 'tpu':
    missing = [] if importlib.util.find_spec('libtpu') else ['libtpu (jax[tpu])']
  else:
    # jax[cuda12] and jax[cuda13] install it too.
    found = _has_module('jax_plugins.xla_cuda12') or _has_module('jax_plugins.xla_cuda13')
    missing = [] if found else ["XLA's CUDA compiler (jax-cuda12-pjrt)"]
  if missing:
    raise TargetError(f'compiling for {target.name} needs {" and ".join(missing)}, which is not '
                      f'installed: {INSTALL_HINT}')


def _has_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:
    return False


def compile_devices(target: Target) -> list:
  """Compile-only JAX devices of `target`, in the order jax.devices() has them there."""
  check_compiler(target)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  if target.platform == 'tpu':
    # libtpu asks the Cloud metadata server what TPU this host has, and prints
    # a page of errors when there is none; these say it without asking (they
    # describe this host's runtime, not the compile-only topology below).
    os.environ.setdefault('TPU_ACCELERATOR_TYPE', target.name)
    os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    # libtpu locks the host's TPU for one process; compiling uses no TPU.
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    per_host = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[target.devices_per_host]
    topology = topologies.get_topology_desc(
        platform='tpu', topology_name=target.topology,
        chip_config_name='megacore' if target.chip.name in _MEGACORE else 'default',
        chips_per_host_bounds=per_host, num_slices=1)
  else:
    topology = topologies.get_topology_desc(
        platform='cuda', topology_name='', target_config=_gpu_target_config(target.chip),
        topology=target.topology)
  devices = list(topology.devices)
  if len(devices) != target.num_devices:
    raise TargetError(f'{target.name}: the compiler made {len(devices)} devices, expected '
                      f'{target.num_devices}')
  return devices


@contextlib.contextmanager
def tracing_for(target: Target):
  """Trace for `target`: fused-attention calls are built for the target's cuDNN version.

  jax.nn.dot_product_attention(implementation='cudnn') asks the local cuDNN
  library for its version while tracing; a deviceless compile has none (and
  the one that matters is the target's). JAX has no public hook for this, so
  its private check is replaced while the target is traced; the aot extra
  pins the jax version, and tests/test_preflight.py compiles base for an
  H100 and checks the fused calls are there.
  """
  if target.platform != 'gpu':
    yield
    return
  from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=import-outside-toplevel
  saved = fused_attention_stablehlo.check_cudnn_version
  major, minor = _CUDNN_VERSION
  fused_attention_stablehlo.check_cudnn_version = lambda: major * 10000 + minor * 100
  try:
    yield
  finally:
    fused_attention_stablehlo.check_cudnn_version = saved


# The cuDNN and CUDA versions of the GPU targets: those jax[cuda12] 0.10 runs with.
_CUDNN_VERSION, _CUDA_VERSION = (9, 7), (12, 8)

# XLA's GPU target description (stream_executor GpuTargetConfigProto, text
# format): what the compiler needs to know of a card it cannot query. The
# figures are the cards' data-sheet values.
_GPU_SPECS = {
    'h100': dict(description='NVIDIA H100 80GB HBM3', major=9, cores=132, fpus=128,
                 smem_core=233472, smem_optin=232448, bandwidth=3352320000000,
                 l2=52428800, clock=1.98, memory=84978434048),
    'a100': dict(description='NVIDIA A100-SXM4-80GB', major=8, cores=108, fpus=64,
                 smem_core=167936, smem_optin=166912, bandwidth=2039000000000,
                 l2=41943040, clock=1.41, memory=85031714816),
}


def _gpu_target_config(chip: hardware.Chip) -> str:
  s = _GPU_SPECS[chip.name]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {s['smem_core']}
  threads_per_core_limit: 2048
  core_count: {s['cores']}
  fpus_per_core: {s['fpus']}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {s['bandwidth']}
  l2_cache_size: {s['l2']}
  clock_rate_ghz: {s['clock']}
  device_memory_size: {s['memory']}
  shared_memory_per_block_optin: {s['smem_optin']}
  cuda_compute_capability {{ major: {s['major']} minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {_CUDNN_VERSION[0]} minor: {_CUDNN_VERSION[1]} }}
runtime_version {{ major: {_CUDA_VERSION[0]} minor: {_CUDA_VERSION[1]} }}
device_description_str: "{s['description']}"
"""
