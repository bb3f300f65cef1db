"""Accelerator chips: peak compute, memory and bandwidth, in one table.

`model/flops.py` (MFU), the benchmark and the pre-flight all read their chip
figures from here. Figures are per device as JAX sees it: one TPU chip (v4
and v5p in megacore mode: both TensorCores of a chip are one device) or one
GPU. Peaks are dense bf16 (no sparsity).
"""

from __future__ import annotations

import dataclasses

MiB, GiB = 2**20, 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str                     # What users call it: 'v5e', 'h100', ...
  device_kinds: tuple[str, ...]  # Lower-case substrings of jax.Device.device_kind.
  peak_flops: float             # Dense bf16 FLOP/s.
  hbm_bytes: int | None         # Device memory; None where it varies by model.
  hbm_bandwidth: float | None   # Bytes/s.
  link_bandwidth: float         # Bytes/s each way between devices of one host or slice
                                # (TPU ICI, GPU NVLink), data sheet.


# More specific kinds first ('h100 pcie' before 'h100', 'v5 lite' before 'v5').
CHIPS: tuple[Chip, ...] = (
    # The PCIe card runs at a lower clock than the SXM module ('H100 80GB HBM3').
    Chip('h100-pcie', ('h100 pcie',), 756e12, 81559 * MiB, 2.0e12, 64e9),
    Chip('h100', ('h100',), 989e12, 81559 * MiB, 3.35e12, 450e9),
    # The same GH100 compute as the H100 SXM, with more and faster memory.
    Chip('h200', ('h200',), 989e12, 143771 * MiB, 4.8e12, 450e9),
    Chip('a100', ('a100',), 312e12, 81920 * MiB, 2.039e12, 300e9),
    Chip('v6e', ('v6 lite', 'v6e'), 918e12, 32 * GiB, 1.64e12, 224e9),
    Chip('v5e', ('v5 lite', 'v5e'), 197e12, 16 * GiB, 0.819e12, 100e9),
    # TPU v5p reports itself as 'TPU v5'.
    Chip('v5p', ('v5p', 'v5'), 459e12, 95 * GiB, 2.765e12, 300e9),
    Chip('v4', ('v4',), 275e12, 32 * GiB, 1.228e12, 150e9),
)
# Between GPU nodes: one 400 Gb/s InfiniBand NDR port per GPU, each way.
NODE_NETWORK_BANDWIDTH = 50e9


def chip(name: str) -> Chip:
  """The chip called `name` ('v4', 'h100', ...)."""
  for c in CHIPS:
    if c.name == name:
      return c
  raise KeyError(f'unknown chip {name!r}; known: {", ".join(c.name for c in CHIPS)}')


def chip_for_device_kind(device_kind: str) -> Chip | None:
  """The chip of a jax.Device.device_kind ('TPU v5 lite', 'NVIDIA H100 80GB HBM3'), if known."""
  kind = device_kind.lower()
  for c in CHIPS:
    if any(k in kind for k in c.device_kinds):
      return c
  return None
