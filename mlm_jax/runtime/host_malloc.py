"""glibc malloc settings that keep XLA:CPU's per-step buffers in memory.

XLA:CPU allocates the temporary buffer of each execution (128 MB for the
train step of configs/bert_tiny.py) with malloc and frees it when the step ends.
glibc serves an allocation that large with a fresh `mmap` and gives it back
with `munmap`, so every step the kernel maps the pages again and the step's
first write to each of them faults: ~31,000 page faults and ~65 ms of kernel
time per tiny step on a 2-core machine, a quarter of its CPU time.

`tune()` asks glibc to serve every thread from the one main arena, never to
use `mmap` for an allocation and never to trim the heap, so a buffer freed at
the end of one step is the buffer of the next and its pages stay mapped.
Measured on 2 cores (configs/bert_tiny.py, docs/benchmarks.md): 0 page faults
instead of 31,000 per step and a step about 10-25% shorter. The settings
must be made before a second thread first calls malloc (glibc fixes the
number of arenas then), so the command-line entry points call `tune()`
first thing.

Only the CPU backend gains: on an accelerator host the step's buffers live on
the device, and one arena shared by every host thread of the input pipeline
would only add lock contention. `tune()` therefore acts only when JAX will run
on its CPU backend (JAX_PLATFORMS / jax_platforms names cpu first, or the host
has no GPU or TPU: mlm_jax/backend.py), only with glibc, and only once per
process.
The trade-off: memory the process frees is kept for reuse rather than given
back to the system, so its resident size stays at its peak (BERT-base at
batch 8: 5.3 GiB instead of 3.8 GiB).
"""

from __future__ import annotations

import ctypes
import platform

from absl import flags

from mlm_jax.runtime import backend

_TUNE = flags.DEFINE_bool(
    'tune_host_malloc', True,
    'On the CPU backend with glibc: serve every thread from one malloc arena without mmap '
    'or trimming, so XLA reuses its step buffers instead of faulting in fresh pages each '
    'step (see mlm_jax/host_malloc.py).')

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# A trim threshold of -1 disables trimming (mallopt(3)); the largest positive
# one, 2 GiB, would still trim the heap under a BERT-base step's buffers.
_NEVER = -1

_applied: str | None = None


def tune(enabled: bool | None = None) -> str:
  """Applies the settings when they help; returns a short description of the state.

  `enabled` defaults to the --tune_host_malloc flag (True when flags are unparsed).
  """
  global _applied
  if _applied is not None:
    return _applied
  if enabled is None:
    enabled = _TUNE.value if flags.FLAGS.is_parsed() else True
  if not enabled:
    _applied = 'default (--notune_host_malloc)'
  elif platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    _applied = 'default (not glibc)'
  elif not backend.runs_on_cpu():
    _applied = 'default (accelerator backend)'
  else:
    libc = ctypes.CDLL(None)
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))
    _applied = ('glibc: one arena, no mmap, no trim' if ok else
                'default (mallopt refused the settings)')
  return _applied


def description() -> str:
  """What tune() did in this process ('default' when it was not called)."""
  return _applied or 'default'
