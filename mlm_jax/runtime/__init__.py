"""Where a run executes: the JAX backend, the device mesh and shardings, several processes,
host memory settings, and the chips (hardware.py: peak FLOP/s, memory, links)."""
