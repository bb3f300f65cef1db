"""How many CPUs this process may use, for every thread pool and worker count we size."""

from __future__ import annotations

import os


def usable_cores() -> int:
  """CPUs this process may run on: its affinity mask, else the machine's count.

  taskset, container cpusets and SLURM allocations narrow the mask, not
  os.cpu_count(); a pool sized by the machine's count oversubscribes the
  cores it has (with 2 of 16 cores usable, 16 PyTorch threads made Hugging
  Face's bert_tiny step about 5x slower).
  """
  if hasattr(os, 'sched_getaffinity'):  # Not on macOS.
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1
