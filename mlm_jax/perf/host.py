"""The host a benchmark ran on: CPU model, cores, vector extensions, library versions.

A CPU figure holds for one CPU only: the same step runs at a different speed
with or without AVX-512 or AMX, and on 2 usable cores or 16. The benchmark
prints `describe()['summary']` above its figures and keeps the whole dict
in its JSON, so every figure carries the machine it was measured on.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

from mlm_jax.runtime import cores

# Vector extensions that change CPU matmul speed: (label, /proc/cpuinfo flag).
# AVX-512 is split into subsets (BF16 and FP16 matmuls need their own), and
# AMX into its tile unit and the data types it multiplies.
EXTENSIONS: tuple[tuple[str, str], ...] = (
    ('AVX2', 'avx2'),
    ('FMA', 'fma'),
    ('AVX512F', 'avx512f'),
    ('AVX512-VNNI', 'avx512_vnni'),
    ('AVX512-BF16', 'avx512_bf16'),
    ('AVX512-FP16', 'avx512_fp16'),
    ('AMX-TILE', 'amx_tile'),
    ('AMX-BF16', 'amx_bf16'),
    ('AMX-INT8', 'amx_int8'),
)

# Distributions whose versions are recorded, in this order, when installed.
LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'torch', 'transformers')


def parse_cpuinfo(text: str) -> dict[str, Any]:
  """The CPU model, vendor and vector extensions named by the text of /proc/cpuinfo.

  Only the first processor's block is read: Linux lists the same model and
  flags for every logical core. Fields a CPU does not report (ARM cores have
  no 'model name') are None.

  Args:
    text: the contents of /proc/cpuinfo.

  Returns:
    {'model_name': str | None, 'vendor': str | None, 'family': str | None,
    'extensions': [label, ...]}: family is x86's 'family F model M', which tells
    apart the generations that a virtual machine's generic name ('AMD EPYC')
    hides; the labels of EXTENSIONS present, in that table's order.
  """
  fields: dict[str, str] = {}
  for line in text.splitlines():
    if not line.strip():
      if fields:
        break  # The end of the first processor's block.
      continue
    key, _, value = line.partition(':')
    fields.setdefault(key.strip(), value.strip())
  flags = set(fields.get('flags', '').split())
  family = None
  if fields.get('cpu family') and fields.get('model'):
    family = f"family {fields['cpu family']} model {fields['model']}"
  return {'model_name': fields.get('model name') or None,
          'vendor': fields.get('vendor_id') or None,
          'family': family,
          'extensions': [label for label, flag in EXTENSIONS if flag in flags]}


def _read_cpuinfo() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      return f.read()
  except OSError:  # Not Linux.
    return ''


def _versions() -> dict[str, str]:
  # Read from the installed metadata, so torch is not imported by runs that do not use it.
  versions = {'python': platform.python_version()}
  for name in LIBRARIES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return versions


def describe(accelerator: str | None = None, cpuinfo: str | None = None) -> dict[str, Any]:
  """This host: CPU, cores, vector extensions, library versions and a one-line summary.

  Args:
    accelerator: the device_kind of the accelerator the run used ('NVIDIA H100
      80GB HBM3', 'TPU v5 lite'); None for a CPU run.
    cpuinfo: the text of /proc/cpuinfo; read from the file when None.

  Returns:
    {'cpu': {...}, 'accelerator', 'platform', 'versions': {...}, 'summary': str}.
  """
  cpu = parse_cpuinfo(_read_cpuinfo() if cpuinfo is None else cpuinfo)
  # Off Linux (or on ARM Linux, which names no model) the platform's word for it.
  cpu['model_name'] = (cpu['model_name'] or platform.processor() or platform.machine()
                       or 'unknown CPU')
  cpu.update(logical_cores=os.cpu_count(), usable_cores=cores.usable_cores())
  host = {'cpu': cpu, 'accelerator': accelerator, 'platform': platform.platform(),
          'versions': _versions()}
  host['summary'] = summary(host)
  return host


def summary(host: dict[str, Any]) -> str:
  """One line: 'AMD EPYC 7B13 (family 25 model 1), 2 cores, AVX2+FMA, no AVX-512; jax 0.10.2,
  torch 2.13.0+cpu'."""
  cpu, versions = host['cpu'], host['versions']
  logical, usable = cpu['logical_cores'], cpu['usable_cores']
  if usable is None or usable == logical:
    core_text = f'{logical} cores'
  else:
    core_text = f'{usable} of {logical} cores usable'
  extensions = '+'.join(cpu['extensions']) or 'no AVX2'
  if 'AVX512F' not in cpu['extensions']:
    extensions += ', no AVX-512'
  name = cpu['model_name'] + (f' ({cpu["family"]})' if cpu.get('family') else '')
  line = f'{name}, {core_text}, {extensions}'
  if host['accelerator']:
    line = f'{host["accelerator"]}; host {line}'
  libraries = ', '.join(f'{name} {versions[name]}' for name in ('jax', 'torch') if name in versions)
  return f'{line}; {libraries}'
