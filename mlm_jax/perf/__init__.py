"""Speed and size: FLOP counts, chip figures, benchmarks, and the pre-flight that compiles for accelerators on a CPU host."""
