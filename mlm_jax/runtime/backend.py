"""Which JAX backend a command runs on, decided before JAX starts one.

With no JAX_PLATFORMS set, JAX initialises every accelerator plugin it finds
installed and falls back to its CPU backend when none has a device. The
`aot` extra installs two such plugins for compiling only (libtpu and XLA's
CUDA compiler, see mlm_jax/targets.py); on a machine without a TPU or GPU each
would fail at start-up with a page of tracebacks before JAX settles on the CPU.
`choose_platform()` makes the same choice directly: no accelerator hardware on
this host and no JAX_PLATFORMS given means the CPU. A host with a TPU or a GPU
is left to JAX.
"""

from __future__ import annotations

import glob
import logging
import os

import jax

# Device files of NVIDIA drivers (bare metal, containers, WSL2) and AMD's ROCm.
_GPU_DEVICE_FILES = ('/dev/nvidiactl', '/dev/nvidia0', '/dev/dxg', '/dev/kfd')
# Google's PCI vendor id: the TPU chips of a TPU VM.
_GOOGLE_PCI_VENDOR = '0x1ae0'


def accelerator_present() -> bool:
  """Whether this host has a GPU or TPU that JAX could use, seen without starting JAX."""
  if any(os.path.exists(path) for path in _GPU_DEVICE_FILES):
    return True
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def choose_platform() -> str:
  """Runs JAX on the CPU when no platform is asked for and no accelerator is present.

  Must run before anything starts a JAX backend. Returns the platforms JAX
  will consider ('' when it is left to JAX).
  """
  platforms = jax.config.jax_platforms or ''
  if not platforms and not accelerator_present():
    platforms = 'cpu'
    jax.config.update('jax_platforms', platforms)
  if platforms.split(',')[0] == 'cpu':
    quiet_compile_only_plugins()
  return platforms


def use_cpu_backend() -> None:
  """Run JAX itself on the CPU: compile-only devices come from the targets' compilers
  (perf/targets.py).

  Must run before JAX starts a backend. The CUDA plugin's check of the local
  CUDA installation is skipped: there is no GPU to check against.
  """
  os.environ['JAX_PLATFORMS'] = 'cpu'
  os.environ['JAX_SKIP_CUDA_CONSTRAINTS_CHECK'] = '1'
  jax.config.update('jax_platforms', 'cpu')
  quiet_compile_only_plugins()


def quiet_compile_only_plugins() -> None:
  """Silences the CUDA compiler plugin's warning that JAX's CUDA kernels are missing.

  The aot extra installs XLA's CUDA compiler (jax-cuda12-pjrt) without the
  kernel package (jax-cuda12-plugin) on purpose: compiling for a GPU needs
  only the former. JAX still loads the plugin when it runs on the CPU, and
  the plugin warns about the package it lacks.
  """
  logging.getLogger('jax_plugins.xla_cuda12').setLevel(logging.ERROR)


def runs_on_cpu() -> bool:
  """Whether JAX's default backend will be the CPU, decided without starting a backend."""
  platforms = jax.config.jax_platforms
  if platforms:
    return platforms.split(',')[0].strip().lower() == 'cpu'
  return not accelerator_present()
